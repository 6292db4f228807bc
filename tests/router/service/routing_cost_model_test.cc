// The cost models on the service: the default (predicted) cost against Dynamo's formula, whose
// weights come by flag or per request (config_override).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <numeric>

#include "router/scheduling/worker_rates.h"
#include "tests/router/service/service_fixture.h"

namespace kvrouter {
namespace {

using testing::ServiceTest;

// Worker 1 holds all but the last block of a 4,000-token prompt and decodes two other requests
// (1,000 blocks); worker 2 is idle. The default (predicted) cost keeps the prompt with its cache;
// Dynamo's formula at scale 1 (2,001 blocks against 2,000) sends it to the idle worker, and
// setting either of Dynamo's weights, by flag or per request, gives exactly that decision.
class CostModelTest : public ServiceTest {
 protected:
  void SetUpFleet(std::vector<std::string> flags) {
    flags.insert(flags.begin(), {"--router-mode", "kv"});
    StartWith(flags);
    Register(1);
    Register(2);
    StorePrompt(1, 1, std::vector<std::uint32_t>(prompt_.begin(), prompt_.end() - 4));
    for (std::uint32_t r = 0; r < 2; ++r) {
      std::vector<std::uint32_t> other(2000);
      for (std::uint32_t k = 0; k < other.size(); ++k) other[k] = 100000 * (r + 1) + k;
      RouteRequest pinned = Prompt(other, "decoding-" + std::to_string(r));
      pinned.worker_id = 1;
      ASSERT_TRUE(Route(pinned).ok());
      (void)bus_.Request(svc_->subjects().mark_prefill, AsBytes(EncodeLifecycleRequest(pinned.request_id)));
    }
  }
  std::uint64_t RouteThePrompt(RouterConfigOverride o = {}) {
    RouteRequest r = Prompt(prompt_);
    r.config_override = o;
    auto reply = Route(r);
    EXPECT_TRUE(reply.ok()) << reply.status().ToString();
    return reply.ok() ? reply->worker_id : 0;
  }
  std::vector<std::uint32_t> prompt_ = [] {
    std::vector<std::uint32_t> p(4000);
    for (std::uint32_t k = 0; k < p.size(); ++k) p[k] = k + 1;
    return p;
  }();
};

TEST_F(CostModelTest, TheDefaultKeepsThePromptWithItsCache) {
  SetUpFleet({});
  EXPECT_EQ(RouteThePrompt(), 1u);
}

TEST_F(CostModelTest, DynamosWeightsInARequestGiveDynamosDecision) {
  SetUpFleet({});
  EXPECT_EQ(RouteThePrompt({.prefill_load_scale = 1.0}), 2u);
  EXPECT_EQ(RouteThePrompt({.overlap_score_credit = 1.0}), 2u);
  EXPECT_EQ(RouteThePrompt(), 1u);  // the next request without them: the default again
}

TEST_F(CostModelTest, DynamosWeightsAsFlagsGiveDynamosDecision) {
  SetUpFleet({"--router-prefill-load-scale", "1"});
  EXPECT_EQ(RouteThePrompt(), 2u);
}

// Both workers answer 64x faster than the prior (timings of 60 requests each, carried by their
// `free`s). Worker 1 holds half of a 16,384-token prompt, which at that speed saves about 3.3 ms,
// and got one request more than worker 2 lately (an excess of half a request over the mean): 5 ms
// of spread in the prior's time, 2.5 ms in the fleet's (the scale at most halves it). Routed,
// the prompt stays with its cache.
TEST_F(CostModelTest, OnAFleetFasterThanThePriorTheSpreadIsPricedInTheFleetsTime) {
  StartWith({"--router-mode", "kv"});
  Register(1);
  Register(2);
  std::uint32_t next_token = 1'000'000;
  auto route_and_free = [&](std::uint64_t worker, const std::string& id, bool timed) {
    std::vector<std::uint32_t> tokens(64);
    for (auto& t : tokens) t = next_token++;
    RouteRequest r = Prompt(tokens, id);
    r.worker_id = worker;
    ASSERT_TRUE(Route(r).ok());
    const auto body = timed ? EncodeLifecycleRequest(id, {.ttfb_ms = 0.001}) : EncodeLifecycleRequest(id);
    ASSERT_TRUE(bus_.Request(svc_->subjects().free, AsBytes(body)).has_value());
  };
  for (int i = 0; i < 60; ++i) {  // a factor moves at most ln 2 / 5 per observation
    for (std::uint64_t w : {1, 2}) route_and_free(w, fmt::format("teach-{}-{}", w, i), true);
    now_ += std::chrono::milliseconds(40);  // the fleet's typical factor is taken each second
  }
  for (const WorkerStats& w : Stats().workers) {
    const double fastest = PrefillTokensPerSecond(WorkerRates::kMinFactor);  // 64x the prior's
    EXPECT_NEAR(w.prefill_tokens_per_second, fastest, 1e-3 * fastest) << w.worker_id;
  }
  std::vector<std::uint32_t> prompt(16384);
  std::iota(prompt.begin(), prompt.end(), 1u);
  StorePrompt(1, 1, std::vector<std::uint32_t>(prompt.begin(), prompt.begin() + 8188));
  route_and_free(1, "one-more", false);
  auto reply = Route(Prompt(prompt));
  ASSERT_TRUE(reply.ok()) << reply.status().ToString();
  EXPECT_EQ(reply->worker_id, 1u);
}

// What is learned of a worker is of that engine: it goes when the worker leaves, and when the
// worker registers again as another device (new hardware behind the same id). A heartbeat, or
// a registration that changes something else, keeps it.
TEST_F(CostModelTest, ALearnedRateSurvivesNeitherLeavingNorAnotherDevice) {
  StartWith({"--router-mode", "kv"});
  Register(1, {.device = "gpu"});
  Register(2, {.device = "gpu"});
  int n = 0;
  auto teach = [&](std::uint64_t worker, double ttfb_ms) {  // 60 requests with that time to first byte
    for (int i = 0; i < 60; ++i) {
      const std::string id = fmt::format("teach-{}", ++n);
      RouteRequest r = Prompt({static_cast<std::uint32_t>(n), 2, 3, 4}, id);
      r.worker_id = worker;
      ASSERT_TRUE(Route(r).ok());
      ASSERT_TRUE(
          bus_.Request(svc_->subjects().free, AsBytes(EncodeLifecycleRequest(id, {.ttfb_ms = ttfb_ms}))).has_value());
    }
  };
  auto rate = [&](std::uint64_t worker) {
    for (const WorkerStats& w : Stats().workers) {
      if (w.worker_id == worker) return w.prefill_tokens_per_second;
    }
    return -1.0;
  };
  const double prior = rate(1);
  ASSERT_EQ(prior, PrefillTokensPerSecond(1));
  teach(1, 0.001);  // as fast as a rate may be learned
  teach(2, 200);    // several times slower than the prior
  const double fast = rate(1), slow = rate(2);
  ASSERT_GT(fast, 10 * prior);
  ASSERT_LT(slow, prior / 2);
  Register(1, {.device = "gpu"});  // a heartbeat
  Register(1, {.max_num_seqs = 128, .device = "gpu"});
  EXPECT_EQ(rate(1), fast);
  // Another device: worker 1 starts again where a new worker would, at the fleet's typical rate
  // (worker 2's, the only one learned now), and worker 2 keeps its own. A request booked on the
  // old hardware and freed after the change teaches the new one nothing.
  RouteRequest before = Prompt({9, 9, 9, 9}, "booked-before");
  before.worker_id = 1;
  ASSERT_TRUE(Route(before).ok());
  Register(1, {.device = "cpu"});
  EXPECT_EQ(rate(1), slow);
  EXPECT_EQ(rate(2), slow);
  ASSERT_TRUE(bus_.Request(svc_->subjects().free, AsBytes(EncodeLifecycleRequest("booked-before", {.ttfb_ms = 0.001})))
                  .has_value());
  EXPECT_EQ(rate(1), slow);
  teach(1, 0.001);
  ASSERT_GT(rate(1), 10 * prior);
  Register(1, {.device = "cpu", .leaving = true});
  Register(1, {.device = "cpu"});
  EXPECT_EQ(rate(1), slow);
  EXPECT_EQ(rate(2), slow);
}

}  // namespace
}  // namespace kvrouter
