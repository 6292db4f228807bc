// KvRouterService's wiring on an in-memory bus (service_fixture.h): each subject decoded and
// answered, error codes, leases and heartbeats, events indexed (Dynamo, vLLM, backlogs), garbage.
// Its parts have their own files: cost_model_test.cc, admission_queue_test.cc,
// approx_routing_test.cc, replica_sync_test.cc, generate_relay_test.cc, recovery_test.cc.
#include "router/service/kv_router_service.h"

#include <gtest/gtest.h>
#include <sched.h>

#include <set>
#include <thread>

#include "events/event_codec.h"
#include "events/vllm_codec.h"
#include "tests/router/service/service_fixture.h"
#include "transport/memory_bus.h"

namespace kvrouter {
namespace {

using std::chrono::milliseconds;
using testing::kBs;
using testing::kTwelve;
using testing::ServiceTest;

TEST_F(ServiceTest, KvModeRoutesToTheWorkerHoldingThePrefix) {
  StartWith({"--router-mode", "kv"});
  for (std::uint64_t id : {1, 2, 3}) Register(id);
  StorePrompt(2, 1, {1, 2, 3, 4, 5, 6, 7, 8});
  auto r = Route(Prompt(kTwelve));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->worker_id, 2u);
  EXPECT_EQ(r->overlap_blocks, 2u);
  EXPECT_EQ(r->request_blocks, 3u);
  EXPECT_EQ(r->cached_tokens, 8u);
}

// Section 13: a prefill worker is never a request's worker, even holding the whole prompt (its
// events are still indexed); route and best_worker go to the others, a pin to it is refused, and
// stats name every worker's role.
TEST_F(ServiceTest, APrefillWorkerIsNeverChosenAndStatsNameEachRole) {
  StartWith({"--router-mode", "kv"});
  Register(1, {.role = WorkerRole::kPrefill});
  Register(2, {.role = WorkerRole::kDecode});
  Register(3);
  StorePrompt(1, 1, {1, 2, 3, 4, 5, 6, 7, 8});
  for (bool best_worker : {false, true}) {
    for (int i = 0; i < 8; ++i) {
      auto r = Route(Prompt(kTwelve), best_worker);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      EXPECT_NE(r->worker_id, 1u);
    }
  }
  RouteRequest pinned = Prompt(kTwelve);
  pinned.worker_id = 1;
  auto refused = Route(pinned);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  const StatsReply s = Stats();
  ASSERT_EQ(s.workers.size(), 3u);
  EXPECT_EQ(s.workers[0].role, "prefill");
  EXPECT_EQ(s.workers[0].blocks, 2u);
  EXPECT_EQ(s.workers[1].role, "decode");
  EXPECT_EQ(s.workers[2].role, "both");
}

// overlap_scores: every known rank in order, its overlap with the prompt (also outside mode kv),
// paged; a LoRA prompt hashes apart; a bad prompt is an error reply.
TEST_F(ServiceTest, OverlapScoresGivesEveryRankItsOverlapInPages) {
  StartWith({"--router-mode", "round-robin"});
  for (std::uint64_t id : {1, 2, 3}) Register(id);
  StorePrompt(2, 1, {1, 2, 3, 4, 5, 6, 7, 8});
  StorePrompt(3, 1, {1, 2, 3, 4});
  auto all = OverlapScoresOf(Prompt(kTwelve));
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  ASSERT_EQ(all->scores.size(), 3u);
  EXPECT_EQ(all->workers_total, 3u);
  EXPECT_FALSE(all->next_offset.has_value());
  const std::vector<std::uint32_t> want = {0, 2, 1};
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(all->scores[i].worker_id, i + 1);
    EXPECT_EQ(all->scores[i].overlap_blocks, want[i]);
    EXPECT_EQ(all->scores[i].overlap_by_tier, (OverlapByTier{want[i], want[i], want[i]}));
  }
  auto first = OverlapScoresOf(Prompt(kTwelve), 0, 2);
  ASSERT_TRUE(first.ok());
  ASSERT_EQ(first->scores.size(), 2u);
  ASSERT_TRUE(first->next_offset.has_value());
  auto second = OverlapScoresOf(Prompt(kTwelve), *first->next_offset, 2);
  ASSERT_TRUE(second.ok());
  ASSERT_EQ(second->scores.size(), 1u);
  EXPECT_EQ(second->scores[0].worker_id, 3u);
  EXPECT_EQ(second->scores[0].overlap_blocks, 1u);
  EXPECT_FALSE(second->next_offset.has_value());
  RouteRequest lora = Prompt(kTwelve);
  lora.lora_name = "adapter";
  auto other = OverlapScoresOf(lora);
  ASSERT_TRUE(other.ok());
  for (const RankOverlap& o : other->scores) EXPECT_EQ(o.overlap_blocks, 0u) << o.worker_id;
  RouteRequest bad;
  bad.block_hashes = {1, 2, 3};
  bad.isl = 4;  // three blocks cannot fit in four tokens at block size 4
  EXPECT_EQ(OverlapScoresOf(bad).status().code(), StatusCode::kInvalidArgument);
}

// Multimodal items (protocol.md section 12): the same text with another image is not a shared
// prefix; with the same image it is. The worker's event carries the local hashes of its rule.
TEST_F(ServiceTest, AnImageIsPartOfThePrefix) {
  StartWith({"--router-mode", "kv"});
  for (std::uint64_t id : {1, 2}) Register(id);
  const MmItem image{.hash = MmItemHash(std::string(64, 'c')), .offset = 4, .length = 4};
  const auto local = ComputeLocalHashes(kTwelve, kBs, "", std::span<const MmItem>(&image, 1));
  const auto seq = ComputeSequenceHashes(local);
  KvEventBatch b{.worker_id = 2, .sequence = {SequenceKind::kEventId, 1}};
  KvStored stored;
  for (std::size_t i = 0; i < local.size(); ++i) stored.blocks.push_back({seq[i], local[i]});
  b.ops.push_back({StorageTier::kDevice, std::move(stored)});
  (void)bus_.Publish(svc_->subjects().kv_events, AsBytes(EncodeDynamoEnvelope(b, {})));
  svc_->index().Flush();
  RouteRequest same = Prompt(kTwelve);
  same.mm_items = {image};
  auto r = Route(same, /*best_worker=*/true);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->worker_id, 2u);
  EXPECT_EQ(r->overlap_blocks, 3u);
  RouteRequest other = same;
  other.mm_items[0].hash = MmItemHash("another image");
  auto o = OverlapScoresOf(other);
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(o->scores[1].overlap_blocks, 1u);  // only the text block before the image
  auto text_only = OverlapScoresOf(Prompt(kTwelve));
  ASSERT_TRUE(text_only.ok());
  EXPECT_EQ(text_only->scores[1].overlap_blocks, 1u);
  auto with_image = OverlapScoresOf(same);
  ASSERT_TRUE(with_image.ok());
  EXPECT_EQ(with_image->scores[1].overlap_blocks, 3u);
}

// Storage tiers (protocol.md section 12): a prompt moved from GPU to CPU (removed on device,
// stored on host) stays credited at the host weight: reported per tier, counted in stats, and
// preferred to a cold worker, though a device copy is preferred to it.
TEST_F(ServiceTest, APromptMovedToHostIsCreditedAtTheHostWeight) {
  StartWith({"--router-mode", "kv"});
  for (std::uint64_t id : {1, 2, 3}) Register(id);
  StorePrompt(1, 1, kTwelve);
  StorePrompt(2, 1, kTwelve);
  KvEventBatch removed{.worker_id = 2, .sequence = {SequenceKind::kEventId, 2}};
  KvEventBatch stored = StoredPromptBatch(2, 3, kTwelve, kBs);
  removed.ops.push_back({StorageTier::kDevice, KvRemoved{}});
  for (const StoredBlock& b : std::get<KvStored>(stored.ops[0].data).blocks)
    std::get<KvRemoved>(removed.ops[0].data).block_hashes.push_back(b.block_hash);
  stored.ops[0].tier = StorageTier::kHostPinned;
  for (const KvEventBatch& b : {removed, stored})
    (void)bus_.Publish(svc_->subjects().kv_events, AsBytes(EncodeDynamoEnvelope(b, {})));
  svc_->index().Flush();

  auto scores = OverlapScoresOf(Prompt(kTwelve));
  ASSERT_TRUE(scores.ok()) << scores.status().ToString();
  ASSERT_EQ(scores->scores.size(), 3u);
  EXPECT_EQ(scores->scores[0].overlap_by_tier, (OverlapByTier{3, 3, 3}));
  EXPECT_EQ(scores->scores[1].overlap_blocks, 0u);
  EXPECT_EQ(scores->scores[1].overlap_by_tier, (OverlapByTier{0, 3, 3}));
  EXPECT_EQ(scores->scores[2].overlap_by_tier, (OverlapByTier{0, 0, 0}));
  const StatsReply stats = Stats();
  ASSERT_EQ(stats.workers.size(), 3u);
  EXPECT_EQ(stats.workers[1].blocks, 3u);  // blocks on any tier

  auto device = Route(Prompt(kTwelve), /*best_worker=*/true);
  ASSERT_TRUE(device.ok());
  EXPECT_EQ(device->worker_id, 1u);
  EXPECT_EQ(device->overlap_by_tier, (OverlapByTier{3, 3, 3}));
  Register(1, {.leaving = true});
  auto host = Route(Prompt(kTwelve), /*best_worker=*/true);
  ASSERT_TRUE(host.ok());
  EXPECT_EQ(host->worker_id, 2u);  // not the cold worker 3
  EXPECT_EQ(host->overlap_blocks, 0u);
  EXPECT_EQ(host->cached_tokens, 0u);
  EXPECT_EQ(host->overlap_by_tier, (OverlapByTier{0, 3, 3}));
}

// The thread that delivers events runs as ingestion (batch scheduling class), so that on a
// busy machine it does not preempt a route's thread when it wakes; the threads that deliver
// requests keep their class.
TEST_F(ServiceTest, TheEventThreadRunsAsBatchAndTheRouteThreadDoesNot) {
  StartWith({"--router-mode", "kv"});
  Register(1);
  int event_thread = -1, route_thread = -1;
  // A new thread inherits its creator's class: start each one in the default class.
  const auto fresh = [] {
    const sched_param none{};
    return sched_setscheduler(0, SCHED_OTHER, &none) == 0;
  };
  std::thread([&] {  // the in-memory bus delivers on the publishing thread
    ASSERT_TRUE(fresh());
    StorePrompt(1, 1, {1, 2, 3, 4});
    event_thread = sched_getscheduler(0);
  })
      .join();
  std::thread([&] {
    ASSERT_TRUE(fresh());
    EXPECT_TRUE(Route(Prompt(kTwelve)).ok());
    route_thread = sched_getscheduler(0);
  }).join();
  EXPECT_EQ(event_thread, SCHED_BATCH);
  EXPECT_EQ(route_thread, SCHED_OTHER);
}

TEST_F(ServiceTest, VllmEventsFromTheSubjectAreIndexed) {
  StartWith({"--router-mode", "kv"});
  Register(1);
  Register(7);
  VllmStoredEvent e{.block_hashes = {900, 901, 902}, .token_ids = kTwelve, .block_size = kBs};
  auto body = EncodeVllmBatch(1.0, {e}, 0);
  (void)bus_.PublishWithHeaders(svc_->subjects().vllm_events_prefix + "7.0", AsBytes(body), {{"Kv-Seq", "0"}});
  svc_->index().Flush();
  auto r = Route(Prompt(kTwelve));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->worker_id, 7u);
  EXPECT_EQ(r->overlap_blocks, 3u);
}

TEST_F(ServiceTest, WorkerSeenOnlyThroughEventsIsRoutable) {
  StartWith({"--router-mode", "kv"});
  StorePrompt(5, 1, {1, 2, 3, 4});
  auto r = Route(Prompt(kTwelve));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->worker_id, 5u);
  // No lease: it does not expire.
  now_ += std::chrono::hours(1);
  svc_->Tick();
  EXPECT_TRUE(Route(Prompt(kTwelve)).ok());
}

TEST_F(ServiceTest, ARegisteredWorkerRoutedToThatSendsNoEventsIsNamedAndCounted) {
  StartWith({"--router-mode", "kv"});
  Register(1);
  Register(2);
  Register(3);  // idle: no request, so no events to send
  StorePrompt(2, 1, {1, 2, 3, 4});
  RouteRequest to1 = Prompt(kTwelve);
  to1.worker_id = 1;
  ASSERT_TRUE(Route(to1).ok());
  for (auto t = std::chrono::seconds(0); t < KvRouterService::kSilentAfter; t += std::chrono::seconds(1)) {
    now_ += std::chrono::seconds(1);
    for (std::uint64_t id : {1, 2, 3}) Register(id);  // heartbeats keep the leases
    svc_->Tick();
  }
  StatsReply s = Stats();
  EXPECT_EQ(s.counters["workers_without_events"], 1u);
  ASSERT_EQ(s.workers.size(), 3u);
  EXPECT_TRUE(s.workers[0].without_events);  // worker 1
  EXPECT_FALSE(s.workers[1].without_events);
  EXPECT_FALSE(s.workers[2].without_events);
  EXPECT_NE(svc_->MetricsText().find("kvrouter_workers_without_events 1"), std::string::npos);
  // Its first event ends it.
  StorePrompt(1, 1, {5, 6, 7, 8});
  now_ += std::chrono::seconds(1);
  svc_->Tick();
  EXPECT_EQ(Stats().counters["workers_without_events"], 0u);
}

TEST_F(ServiceTest, WithoutEventsToReadNoWorkerIsSilent) {
  StartWith({"--router-mode", "kv", "--no-router-kv-events"});
  for (auto t = std::chrono::seconds(0); t < KvRouterService::kSilentAfter; t += std::chrono::seconds(1)) {
    now_ += std::chrono::seconds(1);
    Register(1);
    svc_->Tick();
  }
  ASSERT_EQ(Stats().workers.size(), 1u);
  EXPECT_EQ(Stats().counters["workers_without_events"], 0u);
}

TEST_F(ServiceTest, BookingCountsAgainstTheWorkerUntilFreed) {
  StartWith({"--router-mode", "kv"});
  Register(1);
  Register(2);
  auto a = Route(Prompt(kTwelve, "a"));
  ASSERT_TRUE(a.ok());
  // The same prompt again goes to the other, idle worker: the first is busy with "a".
  auto b = Route(Prompt(kTwelve, "b"));
  ASSERT_TRUE(b.ok());
  EXPECT_NE(a->worker_id, b->worker_id);
  auto doc = Stats();
  EXPECT_EQ(doc.counters.at("active_requests"), 2u);
  for (const char* id : {"a", "b"}) {
    auto reply = bus_.Request(svc_->subjects().free, AsBytes(EncodeLifecycleRequest(id)));
    ASSERT_TRUE(reply.has_value());
    EXPECT_TRUE(DecodeErrorReply(*reply).ok());
  }
  auto doc2 = Stats();
  EXPECT_EQ(doc2.counters.at("active_requests"), 0u);
  EXPECT_GT(bus_.published(svc_->subjects().kv_metrics), 0u);
}

TEST_F(ServiceTest, MarkPrefillRemovesPrefillTokensOnly) {
  StartWith({"--router-mode", "kv"});
  Register(1);
  ASSERT_TRUE(Route(Prompt(kTwelve, "a")).ok());
  auto workers = [&] {
    auto ranks = Stats().workers;
    EXPECT_EQ(ranks.size(), 1u);
    return std::make_pair(ranks.at(0).active_prefill_tokens, ranks.at(0).active_blocks);
  };
  EXPECT_EQ(workers(), std::make_pair(std::uint64_t{12}, std::uint64_t{3}));
  (void)bus_.Request(svc_->subjects().mark_prefill, AsBytes(EncodeLifecycleRequest("a")));
  (void)bus_.Request(svc_->subjects().mark_prefill, AsBytes(EncodeLifecycleRequest("a")));  // idempotent
  EXPECT_EQ(workers(), std::make_pair(std::uint64_t{0}, std::uint64_t{3}));
}

TEST_F(ServiceTest, BestWorkerBooksNothing) {
  StartWith({"--router-mode", "kv"});
  Register(1);
  ASSERT_TRUE(Route(Prompt(kTwelve, "q"), /*best_worker=*/true).ok());
  auto doc = Stats();
  EXPECT_EQ(doc.counters.at("active_requests"), 0u);
}

TEST_F(ServiceTest, ErrorsCarryTheRightCodes) {
  StartWith({"--router-mode", "kv"});
  auto none = Route(Prompt(kTwelve));
  EXPECT_EQ(none.status().code(), StatusCode::kNoWorkers);
  Register(1, {.dp_size = 2});
  RouteRequest pinned = Prompt(kTwelve);
  pinned.worker_id = 99;
  EXPECT_EQ(Route(pinned).status().code(), StatusCode::kNotFound);
  pinned.worker_id = 1;
  pinned.dp_rank = 5;
  EXPECT_EQ(Route(pinned).status().code(), StatusCode::kNotFound);
  pinned.dp_rank = 1;
  auto ok = Route(pinned);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->dp_rank, 1u);
  RouteRequest too_many = Prompt({});
  too_many.has_token_ids = false;
  too_many.block_hashes = {1, 2, 3};
  too_many.isl = 4;
  EXPECT_EQ(Route(too_many).status().code(), StatusCode::kInvalidArgument);
  auto garbage = bus_.Request(svc_->subjects().route, AsBytes(std::string_view("\xc1garbage")));
  ASSERT_TRUE(garbage.has_value());
  EXPECT_EQ(DecodeErrorReply(*garbage).code(), StatusCode::kInvalidArgument);
  auto bad_free = bus_.Request(svc_->subjects().free, AsBytes(std::string_view("\x93")));
  ASSERT_TRUE(bad_free.has_value());
  EXPECT_EQ(DecodeErrorReply(*bad_free).code(), StatusCode::kInvalidArgument);
}

TEST_F(ServiceTest, DirectModeNeedsAPin) {
  StartWith({"--router-mode", "direct"});
  Register(1);
  Register(2);
  EXPECT_EQ(Route(Prompt(kTwelve)).status().code(), StatusCode::kInvalidArgument);
  RouteRequest r = Prompt(kTwelve);
  r.worker_id = 2;
  auto ok = Route(r);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->worker_id, 2u);
}

TEST_F(ServiceTest, AllowedWorkerIdsFilterCandidates) {
  StartWith({"--router-mode", "round-robin"});
  for (std::uint64_t id : {1, 2, 3}) Register(id);
  RouteRequest r = Prompt(kTwelve);
  r.allowed_worker_ids = std::vector<std::uint64_t>{3};
  for (int i = 0; i < 5; ++i) EXPECT_EQ(Route(r)->worker_id, 3u);
  r.allowed_worker_ids = std::vector<std::uint64_t>{42};
  EXPECT_EQ(Route(r).status().code(), StatusCode::kNoWorkers);
}

TEST_F(ServiceTest, LeaseExpiryAndLeavingForgetTheWorker) {
  StartWith({"--router-mode", "kv"});
  Register(1, {.lease_ms = 1000});
  Register(2, {.lease_ms = 5000});
  StorePrompt(1, 1, kTwelve);
  ASSERT_TRUE(Route(Prompt(kTwelve, "on-1")).ok());
  now_ += milliseconds(1001);
  svc_->Tick();
  svc_->index().Flush();
  for (int i = 0; i < 5; ++i) EXPECT_EQ(Route(Prompt(kTwelve))->worker_id, 2u);
  auto doc = Stats();
  EXPECT_EQ(doc.counters.at("leases_expired"), 1u);
  EXPECT_EQ(doc.counters.at("active_requests"), 0u);  // the booking on 1 was released
  Register(2, {.lease_ms = 5000, .leaving = true});
  EXPECT_EQ(Route(Prompt(kTwelve)).status().code(), StatusCode::kNoWorkers);
}

TEST_F(ServiceTest, HeartbeatRenewsTheLease) {
  StartWith({"--router-mode", "kv"});
  Register(1, {.lease_ms = 1000});
  now_ += milliseconds(900);
  Register(1, {.lease_ms = 1000});
  now_ += milliseconds(900);
  svc_->Tick();
  EXPECT_TRUE(Route(Prompt(kTwelve)).ok());
}

TEST_F(ServiceTest, WorkerWithOtherBlockSizeIsRefusedAndCounted) {
  StartWith({"--router-mode", "kv"});
  Register(1, {.block_size = 16});
  EXPECT_EQ(Route(Prompt(kTwelve)).status().code(), StatusCode::kNoWorkers);
  auto doc = Stats();
  EXPECT_EQ(doc.counters.at("workers_refused"), 1u);
}

TEST_F(ServiceTest, GarbageOnEverySubjectLeavesTheIndexIntact) {
  StartWith({"--router-mode", "kv"});
  Register(1);
  Register(2);
  StorePrompt(2, 1, kTwelve);
  const std::vector<std::string_view> junk = {std::string_view("\xc1", 1), std::string_view("\x92\x01", 2),
                                              std::string_view("\xdd\xff\xff\xff\xff", 5), "", "plain text"};
  for (auto j : junk) {
    for (const std::string& s : {svc_->subjects().kv_events, svc_->subjects().vllm_events_prefix + "2.0",
                                 svc_->subjects().vllm_events_prefix + "x.y", svc_->subjects().instances,
                                 svc_->subjects().mark_prefill, svc_->subjects().free}) {
      (void)bus_.Publish(s, AsBytes(j));
    }
    auto r = bus_.Request(svc_->subjects().route, AsBytes(j));
    ASSERT_TRUE(r.has_value());
    EXPECT_EQ(DecodeErrorReply(*r).code(), StatusCode::kInvalidArgument);
  }
  svc_->index().Flush();
  auto r = Route(Prompt(kTwelve));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->worker_id, 2u);
  EXPECT_EQ(r->overlap_blocks, 3u);
  EXPECT_GE(Dropped("decode_error"), 3 * junk.size() - 2);
}

// A backlog delivered the way a NATS subscription does (every message but the last marked
// more_pending) reaches the index in bulks: nothing is lost, per-worker order holds, more than
// one bulk's worth (256) is applied, and a last message that is garbage still hands the bulk on.
TEST_F(ServiceTest, AnEventBacklogIsAppliedWholeAndInOrderWhateverItsLastMessage) {
  StartWith({"--router-mode", "kv"});
  std::vector<std::vector<std::byte>> burst;
  auto add = [&](const msgpack::sbuffer& b) { burst.emplace_back(AsBytes(b).begin(), AsBytes(b).end()); };
  std::uint64_t next_id[4] = {1, 1, 1, 1};
  for (int i = 0; i < 300; ++i) {  // 300 stored prompts over 4 workers: more than one bulk
    const std::uint64_t w = 1 + i % 4;
    const std::vector<std::uint32_t> tokens = {static_cast<std::uint32_t>(1000 + i), 2, 3, 4};
    add(EncodeDynamoEnvelope(StoredPromptBatch(w, next_id[w - 1]++, tokens, kBs), {}));
  }
  // Worker 1 stores the twelve tokens and removes their last block, in that order.
  const KvEventBatch stored = StoredPromptBatch(1, next_id[0]++, kTwelve, kBs);
  add(EncodeDynamoEnvelope(stored, {}));
  KvEventBatch removed{.worker_id = 1, .sequence = {SequenceKind::kEventId, next_id[0]++}};
  removed.ops.push_back(
      {StorageTier::kDevice, KvRemoved{{std::get<KvStored>(stored.ops[0].data).blocks.back().block_hash}}});
  add(EncodeDynamoEnvelope(removed, {}));
  burst.push_back({std::byte{0xc1}});  // undecodable, and the last of the backlog
  ASSERT_TRUE(bus_.PublishBurst(svc_->subjects().kv_events, burst).ok());
  svc_->index().Flush();
  EXPECT_EQ(svc_->index().Counters().batches_applied, 302u);
  EXPECT_EQ(Dropped("decode_error"), 1u);
  for (std::uint64_t w = 2; w <= 4; ++w) EXPECT_EQ(svc_->index().TreeSize({w, 0}), 75u) << w;
  EXPECT_EQ(svc_->index().TreeSize({1, 0}), 75u + 2u);
  auto r = Route(Prompt(kTwelve));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->worker_id, 1u);
  EXPECT_EQ(r->overlap_blocks, 2u);  // the removal came after the store
}

// A fleet where most ranks hold the prompt's prefix: each shard's holders are a crowd (a run of
// the index's matches of 64 ranks or more), translated once and then found translated again (by
// stamp, not copied), and every request still goes to a rank holding the prefix, the tie spread
// over them; a rank with a booking is priced apart, and a request that books a holder is seen
// there.
TEST_F(ServiceTest, ACrowdHoldingThePrefixIsTranslatedOnceAndTheTieSpreadOverIt) {
  StartWith({"--router-mode", "kv", "--router-index-shards", "2"});
  const std::vector<std::uint32_t> prefix(kTwelve.begin(), kTwelve.begin() + 8);  // 2 blocks
  std::set<std::uint64_t> holders;
  for (std::uint64_t id = 1; id <= 400; ++id) {
    Register(id);
    if (id % 4 == 0) continue;
    StorePrompt(id, 1, prefix);
    holders.insert(id);
  }
  std::vector<std::uint32_t> tokens = kTwelve;  // the prefix, then a block of its own
  std::set<std::uint64_t> chosen;
  for (int i = 0; i < 200; ++i) {
    auto r = Route(Prompt(tokens), /*best_worker=*/true);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_TRUE(holders.contains(r->worker_id)) << r->worker_id;
    EXPECT_EQ(r->overlap_blocks, 2u);
    chosen.insert(r->worker_id);
  }
  EXPECT_GT(chosen.size(), 100u);               // of 300 holders, 200 uniform draws
  EXPECT_EQ(Counter("crowds_translated"), 2u);  // one crowd per shard
  EXPECT_EQ(Counter("crowds_reused"), 2u * 199);
  // Each route thread's next read names the crowds it met by their stamps instead of copying
  // them: all but its first read of each.
  EXPECT_GT(Counter("crowds_elided"), 2u * 150);
  EXPECT_LE(Counter("crowds_elided"), Counter("crowds_reused"));
  // Booked requests: the rank each lands on is priced apart from its crowd from then on, and
  // with its booking costs more than the idle holders, so the next one goes elsewhere.
  std::set<std::uint64_t> booked_on;
  for (int i = 0; i < 20; ++i) {
    auto r = Route(Prompt(tokens, "booked-" + std::to_string(i)));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_TRUE(holders.contains(r->worker_id)) << r->worker_id;
    EXPECT_EQ(r->overlap_blocks, 2u);
    booked_on.insert(r->worker_id);
  }
  EXPECT_EQ(booked_on.size(), 20u);
  EXPECT_EQ(Counter("crowds_translated"), 2u);
}

}  // namespace
}  // namespace kvrouter
