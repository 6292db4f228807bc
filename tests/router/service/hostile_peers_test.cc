// The router's bounds against peers that send numbers it must not obey (docs/protocol.md sections 4
// and 5, issue "one message takes the router down"): each test sends what a hostile or broken
// peer could, then checks that it was refused or bounded, counted, and that honest workers keep
// their caches and routing keeps working.
#include <gtest/gtest.h>

#include <limits>

#include "events/event_codec.h"
#include "events/replica_sync_codec.h"
#include "events/router_endpoints_codec.h"
#include "events/msgpack_reader.h"
#include "events/vllm_codec.h"
#include "tests/router/service/service_fixture.h"

namespace kvrouter {
namespace {

using std::chrono::milliseconds;
using testing::kBs;
using testing::kTwelve;

class HostilePeerTest : public testing::ServiceTest {
 protected:
  // One honest worker holding kTwelve; the test checks it survives whatever comes next.
  void StartWithHonestWorker(std::vector<std::string> flags = {}) {
    flags.insert(flags.begin(), {"--router-mode", "kv"});
    StartWith(flags);
    Register(kHonest);
    StorePrompt(kHonest, 1, kTwelve);
  }
  void ExpectHonestWorkerIntact() {
    svc_->index().Flush();
    RouteRequest q = Prompt(kTwelve);
    q.allowed_worker_ids = std::vector<std::uint64_t>{kHonest};
    auto r = Route(q, /*best_worker=*/true);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->worker_id, kHonest);
    EXPECT_EQ(r->overlap_blocks, 3u);
  }
  std::uint64_t Refused(std::string_view reason) {
    return Stats().breakdowns["registrations_refused"][std::string(reason)];
  }
  static constexpr std::uint64_t kHonest = 7;
};

TEST_F(HostilePeerTest, HugeDpSizeIsRefusedAndNeverObeyed) {
  StartWithHonestWorker();
  Register(99, {.dp_size = std::numeric_limits<std::uint32_t>::max()});
  EXPECT_EQ(Refused("dp_size"), 1u);
  EXPECT_EQ(Stats().workers_total, 1u);
  // A known worker asking for too many ranks keeps its registration as it was.
  Register(kHonest, {.dp_size = 1025});
  EXPECT_EQ(Refused("dp_size"), 2u);
  StatsReply s = Stats();
  EXPECT_EQ(s.workers_total, 1u);
  ASSERT_EQ(s.workers.size(), 1u);
  EXPECT_EQ(s.workers[0].worker_id, kHonest);
  ExpectHonestWorkerIntact();
}

// Ranks from 2^30 up hold the index's storage tiers: no worker may claim them.
TEST_F(HostilePeerTest, DpRanksPastTwoToTheThirtyAreRefused) {
  StartWithHonestWorker();
  Register(7, {.dp_start = (1u << 30) - 1, .dp_size = 2});
  EXPECT_EQ(Refused("dp_size"), 1u);
  Register(8, {.dp_start = (1u << 30) - 1, .dp_size = 1});
  EXPECT_EQ(Stats().workers_total, 2u);
  ExpectHonestWorkerIntact();
}

TEST_F(HostilePeerTest, DpSizeBoundIsAFlag) {
  StartWithHonestWorker({"--router-max-dp-size", "4"});
  Register(1, {.dp_size = 4});
  Register(2, {.dp_size = 5});
  EXPECT_EQ(Stats().workers_total, 1u + 4u);
  EXPECT_EQ(Refused("dp_size"), 1u);
  EXPECT_EQ(Stats().counters.at("workers_refused"), 1u);
}

TEST_F(HostilePeerTest, DpRangeThatOverflowsIsRefused) {
  StartWithHonestWorker();
  Register(99, {.dp_start = std::numeric_limits<std::uint32_t>::max(), .dp_size = 1});
  EXPECT_EQ(Refused("invalid"), 1u);
  EXPECT_EQ(Stats().workers_total, 1u);
}

TEST_F(HostilePeerTest, LeaseIsClampedNotObeyed) {
  StartWithHonestWorker();
  // lease_ms 0 becomes 100 ms: the worker is alive until then, gone after.
  Register(1, {.lease_ms = 0});
  now_ += milliseconds(99);
  svc_->Tick();
  EXPECT_EQ(Stats().workers_total, 2u);
  now_ += milliseconds(2);
  svc_->Tick();
  EXPECT_EQ(Stats().workers_total, 1u);
  // The largest lease the wire can carry becomes an hour.
  Register(2, {.lease_ms = std::numeric_limits<std::uint32_t>::max()});
  now_ += std::chrono::hours(1) + milliseconds(1);
  svc_->Tick();
  EXPECT_EQ(Stats().workers_total, 0u);  // the honest worker's 3 s lease ran out as well
}

TEST_F(HostilePeerTest, LargestIdsAreOrdinaryWorkers) {
  StartWithHonestWorker();
  constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
  Register(kMax, {.dp_start = 0, .dp_size = 2});
  StorePrompt(kMax, 1, {50, 51, 52, 53});
  StatsReply s = Stats();
  EXPECT_EQ(s.workers_total, 3u);
  EXPECT_EQ(s.workers.back().worker_id, kMax);
  Register(kMax, {.leaving = true});
  EXPECT_EQ(Stats().workers_total, 1u);
  ExpectHonestWorkerIntact();
}

TEST_F(HostilePeerTest, EventOnAHugeRankIsDroppedAndCounted) {
  StartWithHonestWorker();
  KvEventBatch b = StoredPromptBatch(99, 1, kTwelve, kBs);
  b.dp_rank = std::numeric_limits<std::uint32_t>::max();
  (void)bus_.Publish(svc_->subjects().kv_events, AsBytes(EncodeDynamoEnvelope(b, {})));
  VllmStoredEvent e{.block_hashes = {1, 2, 3}, .token_ids = kTwelve, .block_size = kBs};
  (void)bus_.Publish(svc_->subjects().vllm_events_prefix + "98.4294967295", AsBytes(EncodeVllmBatch(1.0, {e}, 0)));
  EXPECT_EQ(Dropped("dp_rank_out_of_range"), 2u);
  EXPECT_EQ(Stats().workers_total, 1u);
  ExpectHonestWorkerIntact();
}

TEST_F(HostilePeerTest, RegisteredWorkerEventsOutsideItsRanksAreDropped) {
  StartWithHonestWorker();
  const std::vector<std::uint32_t> other = {20, 21, 22, 23};
  KvEventBatch b = StoredPromptBatch(kHonest, 2, other, kBs);
  b.dp_rank = 1;  // kHonest registered rank 0 only
  (void)bus_.Publish(svc_->subjects().kv_events, AsBytes(EncodeDynamoEnvelope(b, {})));
  EXPECT_EQ(Dropped("dp_rank_out_of_range"), 1u);
  EXPECT_EQ(Stats().workers_total, 1u);
}

TEST_F(HostilePeerTest, WorkerRanksAreBounded) {
  StartWithHonestWorker({"--router-max-worker-ranks", "3"});
  Register(1);
  Register(2);  // a third rank would pass the bound of 3
  EXPECT_EQ(Refused("too_many_workers"), 0u);
  Register(3);
  EXPECT_EQ(Refused("too_many_workers"), 1u);
  StorePrompt(4, 1, {1, 2, 3, 4});  // an event-only worker is a worker too
  EXPECT_EQ(Dropped("too_many_workers"), 1u);
  EXPECT_EQ(Stats().workers_total, 3u);
  Register(1, {.leaving = true});  // room again
  Register(3);
  EXPECT_EQ(Stats().workers_total, 3u);
  ExpectHonestWorkerIntact();
}

TEST_F(HostilePeerTest, EventsOfUnknownWorkersPastMaxWorkersAreRefusedButRegistrationsAreNot) {
  StartWithHonestWorker({"--router-max-workers", "3"});
  StorePrompt(2, 1, {1, 2, 3, 4});  // event-only workers: 2 and 3 fit beside the honest one
  StorePrompt(3, 1, {1, 2, 3, 4});
  StorePrompt(4, 1, {1, 2, 3, 4});  // a fourth would pass the bound
  EXPECT_EQ(Dropped("too_many_workers"), 1u);
  EXPECT_EQ(Stats().workers_total, 3u);
  StorePrompt(2, 2, {5, 6, 7, 8});  // a known id goes on
  EXPECT_EQ(Dropped("too_many_workers"), 1u);
  Register(5);  // a registration is bounded by ranks, not by this
  EXPECT_EQ(Refused("too_many_workers"), 0u);
  StorePrompt(5, 1, {1, 2, 3, 4});
  EXPECT_EQ(Dropped("too_many_workers"), 1u);
  EXPECT_EQ(Stats().workers_total, 4u);
  ExpectHonestWorkerIntact();
}

TEST_F(HostilePeerTest, StatsPagesThroughEveryRankInOrder) {
  StartWithHonestWorker();
  for (std::uint64_t id = 100; id < 124; ++id) Register(id, {.dp_size = id % 2 ? 2u : 1u});
  const std::uint64_t total = 1 + 12 + 24;
  StatsReply first = Stats({.offset = 0, .limit = 10});
  EXPECT_EQ(first.workers_total, total);
  EXPECT_EQ(first.workers.size(), 10u);
  ASSERT_TRUE(first.next_offset.has_value());
  EXPECT_EQ(*first.next_offset, 10u);
  std::vector<WorkerKey> seen;
  std::optional<std::uint64_t> next = 0;
  while (next) {
    StatsReply page = Stats({.offset = *next, .limit = 7});
    EXPECT_EQ(page.offset, *next);
    for (const WorkerStats& w : page.workers) seen.push_back({w.worker_id, w.dp_rank});
    next = page.next_offset;
  }
  ASSERT_EQ(seen.size(), total);
  EXPECT_TRUE(std::is_sorted(seen.begin(), seen.end()));
  EXPECT_EQ(std::adjacent_find(seen.begin(), seen.end()), seen.end());
  EXPECT_TRUE(Stats({.offset = total, .limit = 10}).workers.empty());
}

TEST_F(HostilePeerTest, StatsReplyFitsTheMaxPayload) {
  StartWithHonestWorker();
  for (std::uint64_t id = 100; id < 400; ++id) Register(id);
  bus_.set_max_payload(4096);
  StatsReply s = Stats({.offset = 0, .limit = 10000});
  EXPECT_EQ(s.workers_total, 301u);
  EXPECT_GT(s.workers.size(), 0u);
  EXPECT_LT(s.workers.size(), 301u);
  ASSERT_TRUE(s.next_offset.has_value());
  EXPECT_EQ(*s.next_offset, s.workers.size());
  // Too small for even the counters: an error reply, never silence.
  bus_.set_max_payload(300);
  auto reply = bus_.Request(svc_->subjects().stats, AsBytes(EncodeStatsRequest({})));
  ASSERT_TRUE(reply.has_value());
  EXPECT_EQ(DecodeErrorReply(*reply).code(), StatusCode::kInternal);
}

TEST_F(HostilePeerTest, BookingsAreBoundedAndFreeingMakesRoom) {
  StartWithHonestWorker({"--router-max-active-requests", "3"});
  for (const char* id : {"a", "b", "c"}) ASSERT_TRUE(Route(Prompt(kTwelve, id)).ok());
  EXPECT_EQ(Route(Prompt(kTwelve, "d")).status().code(), StatusCode::kOverloaded);
  EXPECT_TRUE(Route(Prompt(kTwelve)).ok());  // no request_id: nothing booked, no bound
  EXPECT_EQ(Counter("active_requests"), 3u);
  (void)bus_.Request(svc_->subjects().free, AsBytes(EncodeLifecycleRequest("a")));
  EXPECT_TRUE(Route(Prompt(kTwelve, "d")).ok());
  EXPECT_EQ(Stats().breakdowns["route_errors"]["overloaded"], 1u);
}

TEST_F(HostilePeerTest, BookedBlocksAreBounded) {
  StartWithHonestWorker({"--router-max-active-blocks", "5"});
  ASSERT_TRUE(Route(Prompt(kTwelve, "three-blocks")).ok());
  EXPECT_EQ(Route(Prompt(kTwelve, "three-more")).status().code(), StatusCode::kOverloaded);
  EXPECT_TRUE(Route(Prompt({1, 2, 3, 4, 5, 6, 7, 8}, "two-more")).ok());
  EXPECT_EQ(Counter("active_booked_blocks"), 5u);
}

TEST_F(HostilePeerTest, LongPromptsAreInvalidArguments) {
  StartWithHonestWorker({"--router-max-prompt-tokens", "8"});
  EXPECT_EQ(Route(Prompt(kTwelve, "x")).status().code(), StatusCode::kInvalidArgument);
  RouteRequest hashes = Prompt({});
  hashes.has_token_ids = false;
  hashes.block_hashes = {1};
  hashes.isl = 9;
  EXPECT_EQ(Route(hashes).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Route(Prompt({1, 2, 3, 4, 5, 6, 7, 8}, "fits")).ok());
}

TEST_F(HostilePeerTest, PinToAHugeRankWithManyAllowedIdsIsNotFound) {
  StartWithHonestWorker();
  RouteRequest r = Prompt(kTwelve, "pinned");
  r.worker_id = kHonest;
  r.dp_rank = std::numeric_limits<std::uint32_t>::max();
  std::vector<std::uint64_t> allowed(10000);
  for (std::size_t i = 0; i < allowed.size(); ++i) allowed[i] = 1000000 + i;
  r.allowed_worker_ids = allowed;
  EXPECT_EQ(Route(r).status().code(), StatusCode::kNotFound);
  r.worker_id.reset();  // unpinned: the rank filter alone matches no rank
  EXPECT_EQ(Route(r).status().code(), StatusCode::kNoWorkers);
  allowed.push_back(kHonest);
  r.allowed_worker_ids = allowed;
  r.dp_rank = 0;
  auto ok = Route(r);
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->worker_id, kHonest);
}

TEST_F(HostilePeerTest, ExtremeOverridesAreSafe) {
  StartWithHonestWorker();
  Register(8);
  RouteRequest r = Prompt(kTwelve);
  r.config_override.router_temperature = 1e308;
  r.config_override.prefill_load_scale = 1e308;
  auto ok = Route(r);
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(ok->worker_id, kHonest);  // the only finite cost: its cached prefix needs no prefill
  // A negative scale cannot be sent through the codec; write it by hand.
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk(buf);
  pk.pack_map(2);
  PackKey(pk, "token_ids");
  pk.pack(kTwelve);
  PackKey(pk, "router_config_override");
  pk.pack_map(1);
  PackKey(pk, "prefill_load_scale");
  pk.pack_double(-1.0);
  auto reply = bus_.Request(svc_->subjects().route, AsBytes(buf));
  ASSERT_TRUE(reply.has_value());
  EXPECT_EQ(DecodeErrorReply(*reply).code(), StatusCode::kInvalidArgument);
}

TEST_F(HostilePeerTest, ReplicaSyncNamesOnlyKnownWorkersAndObeysTheBounds) {
  StartWithHonestWorker(
      {"--router-replica-sync", "--router-max-active-requests", "2", "--router-max-prompt-tokens", "8"});
  auto add = [&](std::string id, std::uint64_t worker, std::uint32_t rank, std::size_t blocks) {
    ActiveSequenceEvent e{.router_id = 555,
                          .request_id = std::move(id),
                          .worker_id = worker,
                          .dp_rank = rank,
                          .kind = ActiveSequenceEvent::Kind::kAdd,
                          .isl = static_cast<std::uint32_t>(blocks * kBs)};
    for (std::size_t i = 0; i < blocks; ++i) e.seq_hashes.push_back(1000 + i);
    (void)bus_.Publish(svc_->subjects().active_sequences, AsBytes(EncodeActiveSequenceEvent(e)));
  };
  for (int i = 0; i < 100; ++i) add("phantom-" + std::to_string(i), 4242 + i, 0, 1);
  add("wrong-rank", kHonest, 1, 1);
  add("too-long", kHonest, 0, 3);  // 12 tokens > 8
  add("ok-1", kHonest, 0, 2);
  add("ok-2", kHonest, 0, 2);
  add("over", kHonest, 0, 2);
  StatsReply s = Stats();
  EXPECT_EQ(s.breakdowns["replica_sync_refused"]["unknown_worker"], 101u);
  EXPECT_EQ(s.breakdowns["replica_sync_refused"]["too_long"], 1u);
  EXPECT_EQ(s.breakdowns["replica_sync_refused"]["overloaded"], 1u);
  EXPECT_EQ(s.counters.at("active_requests"), 2u);
  EXPECT_EQ(s.workers_total, 1u);
}

TEST_F(HostilePeerTest, OverlongRequestIdIsAnInvalidArgument) {
  StartWithHonestWorker();
  EXPECT_EQ(Route(Prompt(kTwelve, std::string(kMaxNameBytes + 1, 'r'))).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Counter("active_requests"), 0u);
}

TEST_F(HostilePeerTest, AWorkerCannotIndexMoreThanTwiceItsCapacity) {
  StartWithHonestWorker({"--router-max-worker-blocks", "9"});
  auto prompt = [](std::uint32_t p) {
    std::vector<std::uint32_t> t(12);  // 3 blocks
    for (std::uint32_t i = 0; i < 12; ++i) t[i] = 500 + p * 100 + i;
    return t;
  };
  Register(2, {.total_kv_blocks = 4});  // at most 8 blocks indexed per rank
  StorePrompt(2, 1, prompt(1));
  StorePrompt(2, 2, prompt(2));
  StorePrompt(2, 3, prompt(3));  // 9 blocks would pass 8: dropped
  EXPECT_EQ(svc_->index().TreeSize({2, 0}), 6u);
  EXPECT_EQ(Dropped("over_capacity"), 1u);
  // Announcing no capacity, or an absurd one, gets the flag's bound (9): no worker sets its own.
  Register(3, {.total_kv_blocks = std::uint64_t{1} << 63});
  for (std::uint32_t p = 1; p <= 4; ++p) StorePrompt(3, p, prompt(10 + p));  // the 4th: 12 > 9
  EXPECT_EQ(svc_->index().TreeSize({3, 0}), 9u);
  EXPECT_EQ(Dropped("over_capacity"), 2u);
  ExpectHonestWorkerIntact();
}

TEST_F(HostilePeerTest, AnEventLateBehindLeavingDoesNotBringTheWorkerBack) {
  StartWithHonestWorker();
  Register(2);
  Register(2, {.leaving = true});
  StorePrompt(2, 5, {40, 41, 42, 43});   // still in flight when it left
  EXPECT_EQ(Stats().workers_total, 1u);  // not back as an event-only worker that never expires
  EXPECT_EQ(Dropped("worker_left"), 1u);
  Register(2);  // it really is back: registered again
  StorePrompt(2, 1, {40, 41, 42, 43});
  EXPECT_EQ(Stats().workers_total, 2u);
  // Forgotten through its lease, it is remembered as gone for 10 s, then events count again.
  now_ += std::chrono::seconds(4);
  svc_->Tick();
  EXPECT_EQ(Stats().workers_total, 0u);  // both leases (3 s) ran out
  StorePrompt(2, 2, {50, 51, 52, 53});
  EXPECT_EQ(Stats().workers_total, 0u);
  now_ += std::chrono::seconds(11);
  StorePrompt(2, 3, {50, 51, 52, 53});
  EXPECT_EQ(Stats().workers_total, 1u);
}

}  // namespace
}  // namespace kvrouter
