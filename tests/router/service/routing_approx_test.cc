// Approximate mode (--no-router-kv-events) on the service: events are ignored, the router
// predicts each worker's cache from its own bookings; predictions expire and are pruned.
#include <gtest/gtest.h>

#include "tests/router/service/service_fixture.h"

namespace kvrouter {
namespace {

using testing::kTwelve;
using testing::ServiceTest;

class ApproxTest : public ServiceTest {
 protected:
  void SetUpApprox(std::vector<std::string> extra = {}) {
    std::vector<std::string> flags = {"--router-mode", "kv", "--no-router-kv-events"};
    flags.insert(flags.end(), extra.begin(), extra.end());
    StartWith(flags);
    Register(1, {.lease_ms = 1u << 30});
    Register(2, {.lease_ms = 1u << 30});
  }
  void Finish(const std::string& id) { (void)bus_.Request(svc_->subjects().free, AsBytes(EncodeLifecycleRequest(id))); }
};

TEST_F(ApproxTest, OverlapScoresAreThePredictions) {
  SetUpApprox();
  auto before = OverlapScoresOf(Prompt(kTwelve));
  ASSERT_TRUE(before.ok()) << before.status().ToString();
  ASSERT_EQ(before->scores.size(), 2u);
  for (const RankOverlap& o : before->scores) EXPECT_EQ(o.overlap_blocks, 0u);
  auto routed = Route(Prompt(kTwelve, "a"));
  ASSERT_TRUE(routed.ok());
  auto after = OverlapScoresOf(Prompt(kTwelve));
  ASSERT_TRUE(after.ok());
  for (const RankOverlap& o : after->scores) {
    EXPECT_EQ(o.overlap_blocks, o.worker_id == routed->worker_id ? 3u : 0u) << o.worker_id;
  }
}

TEST_F(ApproxTest, EventsAreIgnoredAndRepeatedPrefixesStickToOneWorker) {
  SetUpApprox();
  StorePrompt(2, 1, kTwelve);  // nobody listens: no prediction comes from events
  EXPECT_EQ(bus_.published(svc_->subjects().kv_events), 1u);
  auto first = Route(Prompt(kTwelve, "a"));
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(first->overlap_blocks, 0u);
  Finish("a");
  for (int i = 0; i < 5; ++i) {
    const std::string id = "again-" + std::to_string(i);
    auto r = Route(Prompt(kTwelve, id));
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->worker_id, first->worker_id);
    EXPECT_EQ(r->overlap_blocks, 3u);
    Finish(id);
  }
  auto doc = Stats();
  EXPECT_EQ(doc.counters.at("events_applied"), 0u);
  EXPECT_EQ(doc.counters.at("predicted_blocks"), 3u);
}

TEST_F(ApproxTest, QueriesWithoutBookingPredictNothing) {
  SetUpApprox();
  ASSERT_TRUE(Route(Prompt(kTwelve, "q"), /*best_worker=*/true).ok());
  RouteRequest no_update = Prompt(kTwelve, "n");
  no_update.update_states = false;
  ASSERT_TRUE(Route(no_update).ok());
  ASSERT_TRUE(Route(Prompt(kTwelve)).ok());  // no request_id: nothing booked
  EXPECT_EQ(Counter("predicted_blocks"), 0u);
}

TEST_F(ApproxTest, PredictionsExpireAfterTheTtlAndGoWithTheWorker) {
  SetUpApprox({"--router-ttl-secs", "10"});
  auto r = Route(Prompt(kTwelve, "a"));
  ASSERT_TRUE(r.ok());
  Finish("a");
  now_ += std::chrono::seconds(9);
  svc_->Tick();
  EXPECT_EQ(Route(Prompt(kTwelve), true)->overlap_blocks, 3u);
  now_ += std::chrono::seconds(1);
  svc_->Tick();
  EXPECT_EQ(Route(Prompt(kTwelve), true)->overlap_blocks, 0u);
  ASSERT_TRUE(Route(Prompt(kTwelve, "b")).ok());
  Finish("b");
  EXPECT_EQ(Counter("predicted_blocks"), 3u);
  Register(1, {.leaving = true});
  Register(2, {.leaving = true});
  EXPECT_EQ(Counter("predicted_blocks"), 0u);
}

TEST_F(ApproxTest, TreeLimitPrunesTheOldest) {
  SetUpApprox({"--router-max-tree-size", "4", "--router-prune-target-ratio", "0.5"});
  ASSERT_TRUE(Route(Prompt(kTwelve, "a")).ok());  // 3 blocks
  now_ += std::chrono::seconds(1);
  ASSERT_TRUE(Route(Prompt({50, 51, 52, 53, 54, 55, 56, 57}, "b")).ok());  // +2 = 5 > 4
  auto doc = Stats();
  EXPECT_EQ(doc.counters.at("predicted_blocks"), 2u);
  EXPECT_EQ(doc.counters.at("predictions_pruned"), 3u);
}

}  // namespace
}  // namespace kvrouter
