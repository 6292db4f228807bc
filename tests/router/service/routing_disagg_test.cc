// Disaggregated prefill and decode on the service (docs/protocol.md section 13): the reply's
// fields, both ranks booked and released by prefill_done, mark_prefill and free, the policies'
// decisions, the fallback, replica sync of both parts, a prefill worker leaving, and stats.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <set>

#include "events/subjects.h"
#include "tests/router/service/service_fixture.h"

namespace kvrouter {
namespace {

using testing::kTwelve;
using testing::ServiceTest;

class DisaggTest : public ServiceTest {
 protected:
  // Prefill workers 1 and 2, decode workers 3 and 4, each with its own URL.
  void StartFleet(std::vector<std::string> flags, KvConnector connector = KvConnector::kNixl) {
    flags.insert(flags.begin(), {"--router-mode", "kv"});
    StartWith(flags);
    for (std::uint64_t id : {1, 2}) {
      Register(id, {.http_url = fmt::format("http://10.0.0.{}:8000", id),
                    .role = WorkerRole::kPrefill,
                    .kv_connector = connector});
    }
    for (std::uint64_t id : {3, 4}) {
      Register(id, {.http_url = fmt::format("http://10.0.0.{}:8000", id), .role = WorkerRole::kDecode});
    }
  }
  void Lifecycle(const std::string& subject, const std::string& id) {
    auto reply = bus_.Request(subject, AsBytes(EncodeLifecycleRequest(id)));
    ASSERT_TRUE(reply.has_value());
  }
  // The stats row of worker `id` (dp rank 0).
  WorkerStats Worker(std::uint64_t id) {
    for (const WorkerStats& w : Stats().workers) {
      if (w.worker_id == id) return w;
    }
    ADD_FAILURE() << "no worker " << id;
    return {};
  }
  std::uint64_t Decisions(const std::string& path) { return Stats().breakdowns["disagg_decisions"][path]; }
};

TEST_F(DisaggTest, AlwaysRepliesWithBothRanksAndBooksEachItsPart) {
  StartFleet({"--router-disagg-policy", "always"});
  StorePrompt(2, 1, {1, 2, 3, 4, 5, 6, 7, 8});  // 2 of the 3 blocks on prefill worker 2
  auto r = Route(Prompt(kTwelve, "a"));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->disaggregated);
  EXPECT_EQ(r->prefill_worker_id, 2u);
  EXPECT_EQ(r->prefill_dp_rank, 0u);
  EXPECT_EQ(r->prefill_http_url, "http://10.0.0.2:8000");
  EXPECT_EQ(r->prefill_cached_tokens, 8u);
  EXPECT_EQ(r->cached_tokens, 8u);  // the prefill rank's: the decode rank prefills nothing
  EXPECT_EQ(r->kv_connector, "nixl");
  EXPECT_TRUE(r->bootstrap_host.empty());
  ASSERT_TRUE(r->worker_id == 3 || r->worker_id == 4) << r->worker_id;
  EXPECT_EQ(r->http_url, fmt::format("http://10.0.0.{}:8000", r->worker_id));
  const std::uint64_t decode = r->worker_id;

  // The prefill rank: one request and its 4 uncached tokens, no blocks. The decode rank: the
  // prompt's 3 blocks and one request, nothing to prefill.
  WorkerStats p = Worker(2), d = Worker(decode);
  EXPECT_EQ(p.active_requests, 1u);
  EXPECT_EQ(p.active_prefill_tokens, 4u);
  EXPECT_EQ(p.active_blocks, 0u);
  EXPECT_EQ(d.active_requests, 1u);
  EXPECT_EQ(d.active_prefill_tokens, 0u);
  EXPECT_EQ(d.active_blocks, 3u);
  EXPECT_EQ(Counter("active_requests"), 1u);
  EXPECT_EQ(Counter("active_prefill_legs"), 1u);
  EXPECT_EQ(Decisions("disaggregated"), 1u);

  Lifecycle(svc_->subjects().prefill_done, "a");
  p = Worker(2);
  EXPECT_EQ(p.active_requests, 0u);
  EXPECT_EQ(p.active_prefill_tokens, 0u);
  EXPECT_EQ(Worker(decode).active_blocks, 3u);
  Lifecycle(svc_->subjects().free, "a");
  EXPECT_EQ(Worker(decode).active_blocks, 0u);
  EXPECT_EQ(Counter("active_requests"), 0u);

  // mark_prefill (the decode leg's first byte) releases the prefill part too; free the rest.
  ASSERT_TRUE(Route(Prompt(kTwelve, "b")).ok());
  EXPECT_EQ(Worker(2).active_requests, 1u);
  Lifecycle(svc_->subjects().mark_prefill, "b");
  EXPECT_EQ(Worker(2).active_requests, 0u);
  EXPECT_EQ(Counter("active_requests"), 1u);
  Lifecycle(svc_->subjects().free, "b");
  EXPECT_EQ(Counter("active_requests"), 0u);

  // best_worker answers the same and books nothing, nor counts a decision.
  auto best = Route(Prompt(kTwelve, "c"), /*best_worker=*/true);
  ASSERT_TRUE(best.ok());
  EXPECT_TRUE(best->disaggregated);
  EXPECT_EQ(Counter("active_requests"), 0u);
  EXPECT_EQ(Decisions("disaggregated"), 2u);
}

TEST_F(DisaggTest, NeverRoutesWholeToADecodeWorkerByItsOwnCache) {
  StartFleet({"--router-disagg-policy", "never"});
  StorePrompt(4, 1, {1, 2, 3, 4, 5, 6, 7, 8});
  auto r = Route(Prompt(kTwelve, "a"));
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->disaggregated);
  EXPECT_EQ(r->worker_id, 4u);
  EXPECT_EQ(r->cached_tokens, 8u);
  EXPECT_EQ(Worker(4).active_prefill_tokens, 4u);  // it prefills locally
  EXPECT_EQ(Decisions("local"), 1u);
}

// A prefill worker holding the whole prompt goes through the prefill pool under isl_bounding;
// a decode worker holding most of it prefills the rest itself.
TEST_F(DisaggTest, IslBoundingSkipsThePrefillPoolForShortUncachedParts) {
  StartFleet({"--router-disagg-policy", "isl_bounding", "--router-conditional-disagg-eff-isl-threshold", "6"});
  StorePrompt(3, 1, {1, 2, 3, 4, 5, 6, 7, 8});  // 4 of 12 uncached on decode 3: 4 < 6, 0.33 < 0.7
  auto local = Route(Prompt(kTwelve, "a"));
  ASSERT_TRUE(local.ok());
  EXPECT_FALSE(local->disaggregated);
  EXPECT_EQ(local->worker_id, 3u);
  const std::vector<std::uint32_t> other = {21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32};
  auto remote = Route(Prompt(other, "b"));  // nothing cached: 12 uncached
  ASSERT_TRUE(remote.ok());
  EXPECT_TRUE(remote->disaggregated);
  EXPECT_EQ(Decisions("local"), 1u);
  EXPECT_EQ(Decisions("disaggregated"), 1u);
}

TEST_F(DisaggTest, PrefillLoadSkipsAPrefillPoolPastItsThreshold) {
  // Dynamo's boolean switch with its policy flag; the busy threshold is 1 x 16 tokens.
  StartWith({"--router-mode", "kv", "--router-conditional-disagg", "--router-conditional-disagg-policy",
             "prefill_load", "--router-conditional-disagg-prefill-busy-threshold", "1"});
  Register(1, {.max_num_batched_tokens = 16, .role = WorkerRole::kPrefill});
  Register(3, {.role = WorkerRole::kDecode});
  std::vector<bool> disaggregated;
  for (int i = 0; i < 3; ++i) {
    std::vector<std::uint32_t> prompt(8);
    for (std::uint32_t t = 0; t < 8; ++t) prompt[t] = 100 * (i + 1) + t;
    auto r = Route(Prompt(prompt, fmt::format("r{}", i)));
    ASSERT_TRUE(r.ok());
    disaggregated.push_back(r->disaggregated);
  }
  // 0, 8 and 16 prefill tokens booked on worker 1 as each comes: none past 16.
  EXPECT_EQ(disaggregated, (std::vector<bool>{true, true, true}));
  std::vector<std::uint32_t> prompt(8, 7);
  auto r = Route(Prompt(prompt, "r3"));  // 24 > 16
  ASSERT_TRUE(r.ok());
  EXPECT_FALSE(r->disaggregated);
  EXPECT_EQ(r->worker_id, 3u);
}

TEST_F(DisaggTest, EveryPrefillWorkerExcludedFallsBackToADecodeWorkerUnlessTurnedOff) {
  StartFleet({"--router-disagg-policy", "always"});
  RouteRequest req = Prompt(kTwelve, "a");
  req.excluded_worker_ids = std::vector<std::uint64_t>{1, 2};
  auto r = Route(req);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_FALSE(r->disaggregated);
  EXPECT_TRUE(r->worker_id == 3 || r->worker_id == 4);
  EXPECT_EQ(Decisions("fallback"), 1u);
  // Allowed workers without any prefill worker are not eligible: no decision is counted.
  RouteRequest decode_only = Prompt(kTwelve, "b");
  decode_only.allowed_worker_ids = std::vector<std::uint64_t>{3, 4};
  auto whole = Route(decode_only);
  ASSERT_TRUE(whole.ok());
  EXPECT_FALSE(whole->disaggregated);
  EXPECT_EQ(Decisions("fallback"), 1u);
}

TEST_F(DisaggTest, WithoutFallbackEveryPrefillWorkerExcludedIsNoWorkers) {
  StartFleet({"--router-disagg-policy", "always", "--router-decode-fallback", "false"});
  RouteRequest req = Prompt(kTwelve, "a");
  req.excluded_worker_ids = std::vector<std::uint64_t>{1, 2};
  auto r = Route(req);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNoWorkers);
  req.excluded_worker_ids = std::vector<std::uint64_t>{1};
  auto other = Route(req);
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(other->prefill_worker_id, 2u);
}

// SGLang: the bootstrap fields, with a room that lands on the chosen rank of a data-parallel
// prefill worker.
TEST_F(DisaggTest, SglangRepliesCarryTheBootstrapFieldsAndARoomForTheChosenRank) {
  StartWith({"--router-mode", "kv", "--router-disagg-policy", "always"});
  Register(1, {.dp_start = 2,
               .dp_size = 4,
               .http_url = "http://[fd00::7]:30000",
               .role = WorkerRole::kPrefill,
               .kv_connector = KvConnector::kSglang,
               .bootstrap_port = 9001});
  Register(3, {.role = WorkerRole::kDecode});
  std::set<std::uint64_t> rooms;
  for (int i = 0; i < 16; ++i) {
    auto r = Route(Prompt(kTwelve, fmt::format("r{}", i)));
    ASSERT_TRUE(r.ok());
    ASSERT_TRUE(r->disaggregated);
    EXPECT_EQ(r->kv_connector, "sglang");
    EXPECT_EQ(r->bootstrap_host, "fd00::7");
    EXPECT_EQ(r->bootstrap_port, 9001u);
    ASSERT_GE(r->prefill_dp_rank, 2u);
    EXPECT_EQ(r->bootstrap_room % 4, r->prefill_dp_rank - 2);
    rooms.insert(r->bootstrap_room);
  }
  EXPECT_EQ(rooms.size(), 16u);  // random: never the same room twice here
}

// Replica sync: the other replica books both parts, releases the prefill part on prefill_done
// and the rest on free.
TEST_F(DisaggTest, ReplicasShareBothPartsOfABooking) {
  StartFleet({"--router-disagg-policy", "always", "--router-replica-sync"});
  std::vector<const char*> argv = {"kvrouter",  "--block-size", "4", "--router-mode", "kv", "--router-disagg-policy",
                                   "always", "--router-replica-sync"};
  auto cfg = ParseRouterConfig(static_cast<int>(argv.size()), argv.data(), [](const char*) { return nullptr; });
  ASSERT_TRUE(cfg.ok());
  KvRouterService other(cfg->config, bus_, [this] { return now_.now(); }, 43);
  ASSERT_TRUE(other.Start().ok());
  Register(1, {.role = WorkerRole::kPrefill});  // the other replica learns the fleet too
  Register(2, {.role = WorkerRole::kPrefill});
  Register(3, {.role = WorkerRole::kDecode});
  Register(4, {.role = WorkerRole::kDecode});
  auto r = Route(Prompt(kTwelve, "shared"));
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(r->disaggregated);
  // Each replica's stats (the queue group alternates) shows the same parts.
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(Worker(r->prefill_worker_id).active_prefill_tokens, 12u);
    EXPECT_EQ(Worker(r->worker_id).active_prefill_tokens, 0u);
    EXPECT_EQ(Worker(r->worker_id).active_blocks, 3u);
  }
  Lifecycle(svc_->subjects().prefill_done, "shared");
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(Worker(r->prefill_worker_id).active_requests, 0u);
    EXPECT_EQ(Worker(r->worker_id).active_requests, 1u);
  }
  Lifecycle(svc_->subjects().free, "shared");
  for (int i = 0; i < 2; ++i) EXPECT_EQ(Counter("active_requests"), 0u);
}

// prefill_done teaches the prefill rank its speed (the time since booking against the prior);
// mark_prefill after it teaches the transfer.
TEST_F(DisaggTest, PrefillDoneTeachesThePrefillRankAndMarkPrefillTheTransfer) {
  StartFleet({"--router-disagg-policy", "always"});
  auto r = Route(Prompt(kTwelve, "a"));
  ASSERT_TRUE(r.ok() && r->disaggregated);
  const double before = Worker(r->prefill_worker_id).prefill_tokens_per_second;
  now_ += std::chrono::seconds(2);  // far slower than the prior's 17 ms
  Lifecycle(svc_->subjects().prefill_done, "a");
  const WorkerStats learned = Worker(r->prefill_worker_id);
  EXPECT_EQ(learned.rate_observations, 1u);
  EXPECT_LT(learned.prefill_tokens_per_second, before);
  EXPECT_EQ(Worker(r->worker_id).rate_observations, 0u);
  EXPECT_EQ(Counter("kv_transfers_observed"), 0u);
  now_ += std::chrono::milliseconds(30);
  Lifecycle(svc_->subjects().mark_prefill, "a");
  EXPECT_EQ(Counter("kv_transfers_observed"), 1u);
  // A mark_prefill without a prefill_done before it times nothing.
  ASSERT_TRUE(Route(Prompt(kTwelve, "b")).ok());
  Lifecycle(svc_->subjects().mark_prefill, "b");
  EXPECT_EQ(Counter("kv_transfers_observed"), 1u);
}

// A peer's sync messages (section 8): the request's add, then its prefill part's (another rank);
// prefill_done naming the prefill rank releases that part only; a repeated or late add of it
// changes nothing; free releases the rest.
TEST_F(DisaggTest, APeersPrefillPartIsBookedOnceAndReleasedByItsPrefillDone) {
  StartFleet({"--router-replica-sync"});
  auto sync = [&](ActiveSequenceEvent e) {
    e.router_id = 77;
    e.request_id = "peer";
    (void)bus_.Publish(svc_->subjects().active_sequences, AsBytes(EncodeActiveSequenceEvent(e)));
  };
  const ActiveSequenceEvent decode{.worker_id = 3, .seq_hashes = {11, 12, 13}, .isl = 12};
  const ActiveSequenceEvent prefill{.worker_id = 1, .isl = 12, .overlap_blocks = 1};
  sync(decode);
  EXPECT_EQ(Worker(3).active_prefill_tokens, 12u);
  sync(prefill);
  EXPECT_EQ(Worker(3).active_prefill_tokens, 0u);  // the prefill rank prefills it
  EXPECT_EQ(Worker(3).active_blocks, 3u);
  EXPECT_EQ(Worker(1).active_prefill_tokens, 8u);
  EXPECT_EQ(Worker(1).active_requests, 1u);
  sync(prefill);  // repeated
  EXPECT_EQ(Worker(1).active_requests, 1u);
  EXPECT_EQ(Counter("active_prefill_legs"), 1u);
  sync({.worker_id = 1, .kind = ActiveSequenceEvent::Kind::kPrefillDone});
  EXPECT_EQ(Worker(1).active_requests, 0u);
  EXPECT_EQ(Worker(3).active_requests, 1u);
  sync(prefill);  // late, after its prefill_done
  EXPECT_EQ(Worker(1).active_requests, 0u);
  EXPECT_EQ(Counter("active_prefill_legs"), 0u);
  sync({.worker_id = 3, .kind = ActiveSequenceEvent::Kind::kFree});
  EXPECT_EQ(Counter("active_requests"), 0u);
}

// A prefill worker that leaves takes its parts with it; the decode part stays booked until free.
TEST_F(DisaggTest, APrefillWorkerLeavingReleasesOnlyThePrefillParts) {
  StartFleet({"--router-disagg-policy", "always"});
  auto r = Route(Prompt(kTwelve, "a"));
  ASSERT_TRUE(r.ok() && r->disaggregated);
  Register(r->prefill_worker_id, {.leaving = true, .role = WorkerRole::kPrefill});
  EXPECT_EQ(Counter("active_prefill_legs"), 0u);
  EXPECT_EQ(Counter("active_requests"), 1u);
  EXPECT_EQ(Worker(r->worker_id).active_blocks, 3u);
  // The next request goes to the remaining prefill worker.
  auto next = Route(Prompt(kTwelve, "b"));
  ASSERT_TRUE(next.ok() && next->disaggregated);
  EXPECT_NE(next->prefill_worker_id, r->prefill_worker_id);
}

// The predicted policy prefills locally where the decode rank holds most of the prompt, and
// sends a long uncached prompt through the prefill pool while its decode ranks are decoding.
TEST_F(DisaggTest, PredictedKeepsCachedPromptsLocalAndSendsLongOnesToThePrefillPool) {
  StartFleet({});
  StorePrompt(3, 1, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12});
  auto cached = Route(Prompt(kTwelve, "cached"));
  ASSERT_TRUE(cached.ok());
  EXPECT_FALSE(cached->disaggregated);
  EXPECT_EQ(cached->worker_id, 3u);
  // On an idle decode rank a long prompt too prefills locally: the transfer would only add.
  std::vector<std::uint32_t> long_prompt(6000);
  for (std::uint32_t t = 0; t < long_prompt.size(); ++t) long_prompt[t] = 1000 + t;
  RouteRequest pinned = Prompt(long_prompt, "idle");
  pinned.worker_id = 4;
  auto idle = Route(pinned);
  ASSERT_TRUE(idle.ok());
  EXPECT_FALSE(idle->disaggregated);
  Lifecycle(svc_->subjects().free, "idle");
  RouteRequest busy = Prompt({41, 42, 43, 44}, "busy");  // decode 4 decodes a request too
  busy.worker_id = 4;
  ASSERT_TRUE(Route(busy).ok());
  // Now each would stall a request decoding there by the whole prefill.
  auto remote = Route(Prompt(long_prompt, "long"));
  ASSERT_TRUE(remote.ok());
  EXPECT_TRUE(remote->disaggregated);
  EXPECT_EQ(Decisions("local"), 3u);
  EXPECT_EQ(Decisions("disaggregated"), 1u);
}

}  // namespace
}  // namespace kvrouter
