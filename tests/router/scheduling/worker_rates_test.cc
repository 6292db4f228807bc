// WorkerRates (router/scheduling/worker_rates.h): convergence from the prior, bounded moves,
// re-learning, drift of unobserved ranks toward the fleet, and what it refuses to learn from.
#include "router/scheduling/worker_rates.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "events/router_endpoints_codec.h"

namespace kvrouter {
namespace {

using std::chrono::seconds;

constexpr WorkerKey kA{1, 0};
constexpr WorkerKey kB{2, 0};
constexpr WorkerKey kC{3, 0};
constexpr PriorTtft kPrior{.prefill_ms = 100, .decode_ms = 20, .decode_step_ms = 10};

// What a rank `prefill` x slower at prefill and `decode` x slower at decoding than the prior
// would show for kPrior's request.
ResponseTiming Seen(double prefill, double decode) {
  return {.ttfb_ms = prefill * kPrior.prefill_ms + decode * kPrior.decode_ms,
          .chunks = 16,
          .inter_chunk_ms_mean = decode * kPrior.decode_step_ms,
          .inter_chunk_ms_max = decode * kPrior.decode_step_ms};
}

TEST(WorkerRates, ARankFourTimesSlowerThanThePriorIsLearnedWithinFiftyRequests) {
  WorkerRates r;
  SteadyTime t{};
  for (int i = 0; i < 50; ++i) ASSERT_TRUE(r.Observe(kA, kPrior, Seen(4, 4), t += seconds(0)));
  EXPECT_NEAR(r.Of(kA).prefill, 4, 0.2);
  EXPECT_NEAR(r.Of(kA).decode, 4, 0.2);
  EXPECT_EQ(r.Of(kA).observations, 50u);
  for (int i = 0; i < 50; ++i) ASSERT_TRUE(r.Observe(kB, kPrior, Seen(0.25, 0.25), t));
  EXPECT_NEAR(r.Of(kB).prefill, 0.25, 0.02);
  EXPECT_NEAR(r.Of(kB).decode, 0.25, 0.02);
}

TEST(WorkerRates, OneStalledRequestMovesARankByABoundedAmount) {
  WorkerRates r;
  SteadyTime t{};
  for (int i = 0; i < 60; ++i) r.Observe(kA, kPrior, Seen(1, 1), t);
  const WorkerRates::Rates before = r.Of(kA);
  ResponseTiming stalled = Seen(1, 1);
  stalled.ttfb_ms *= 1000;  // stuck behind something for a minute
  stalled.inter_chunk_ms_mean *= 1000;
  ASSERT_TRUE(r.Observe(kA, kPrior, stalled, t));
  const double bound = std::exp(WorkerRates::kLearnRate * WorkerRates::kMaxJump) + 1e-9;
  EXPECT_LE(r.Of(kA).prefill / before.prefill, bound);
  EXPECT_LE(r.Of(kA).decode / before.decode, bound);
  EXPECT_GT(r.Of(kA).prefill, before.prefill);
}

TEST(WorkerRates, ARankThatSlowsDownAndRecoversIsRelearned) {
  WorkerRates r;
  SteadyTime t{};
  for (int i = 0; i < 50; ++i) r.Observe(kA, kPrior, Seen(1, 1), t += seconds(1));
  for (int i = 0; i < 50; ++i) r.Observe(kA, kPrior, Seen(4, 4), t += seconds(1));
  EXPECT_GT(r.Of(kA).prefill, 3.6);
  for (int i = 0; i < 50; ++i) r.Observe(kA, kPrior, Seen(1, 1), t += seconds(1));
  EXPECT_LT(r.Of(kA).prefill, 1.1);
}

TEST(WorkerRates, AnUnobservedRankDriftsTowardTheFleetAndANewOneStartsThere) {
  WorkerRates r;
  SteadyTime t{};
  for (int i = 0; i < 60; ++i) {
    r.Observe(kA, kPrior, Seen(8, 8), t);
    r.Observe(kB, kPrior, Seen(2, 2), t);
    r.Observe(kC, kPrior, Seen(2, 2), t);
  }
  ASSERT_GT(r.Of(kA).prefill, 7);
  // A minute in which only B and C are heard from.
  for (int s = 0; s < 60; ++s) {
    t += seconds(1);
    r.Observe(kB, kPrior, Seen(2, 2), t);
    r.Observe(kC, kPrior, Seen(2, 2), t);
    r.Drift(t);
  }
  EXPECT_NEAR(r.Typical().prefill, 2, 0.1);
  EXPECT_LT(r.Of(kA).prefill, 4);  // most of the way back to the fleet's 2
  EXPECT_GT(r.Of(kA).prefill, 2);
  EXPECT_NEAR(r.Of({9, 0}).prefill, 2, 0.1);  // never observed: the fleet's
  EXPECT_EQ(r.Of({9, 0}).observations, 0u);
  r.RemoveWorker(kB.worker_id);
  EXPECT_EQ(r.Of(kB).observations, 0u);
}

TEST(WorkerRates, TimingsThatSayNothingTeachNothing) {
  WorkerRates r;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  EXPECT_FALSE(r.Observe(kA, kPrior, {.ttfb_ms = 0}, {}));
  EXPECT_FALSE(r.Observe(kA, kPrior, {.ttfb_ms = nan}, {}));
  EXPECT_FALSE(r.Observe(kA, kPrior, {.ttfb_ms = -5}, {}));
  EXPECT_FALSE(r.Observe(kA, PriorTtft{}, Seen(2, 2), {}));
  EXPECT_EQ(r.observations(), 0u);
  EXPECT_EQ(r.Of(kA).prefill, 1);
  // Too few chunks to tell a step: the decode factor stays; the prefill one learns.
  ASSERT_TRUE(r.Observe(kA, kPrior, {.ttfb_ms = 400, .chunks = 3, .inter_chunk_ms_mean = 40}, {}));
  EXPECT_EQ(r.Of(kA).decode, 1);
  EXPECT_GT(r.Of(kA).prefill, 1);
}

TEST(WorkerRates, TheFleetsTypicalRateIsTheMedianAndDriftCountsOnlyTheQuietTime) {
  WorkerRates r;
  SteadyTime t{};
  for (int i = 0; i < 80; ++i) {  // two fast ranks, two slow ones
    r.Observe(kA, kPrior, Seen(1, 1), t);
    r.Observe(kB, kPrior, Seen(1, 1), t);
    r.Observe(kC, kPrior, Seen(4, 4), t);
    r.Observe({4, 0}, kPrior, Seen(4, 4), t);
  }
  r.Drift(t);
  t += seconds(2);
  r.Drift(t);
  EXPECT_NEAR(r.Typical().prefill, 2, 0.1);  // between the halves (geometric), not one of them
  // Drift that runs after a long pause moves a rank by what it was quiet past kDriftAfter only.
  const double before = r.Of(kC).prefill;
  t += WorkerRates::kDriftAfter + seconds(1);
  r.Observe(kA, kPrior, Seen(1, 1), t);
  r.Drift(t);
  // C was last heard at 0: quiet 3 s past kDriftAfter at 13 s (not the 11 s since the last Drift).
  const double moved = std::log(before / r.Of(kC).prefill);
  EXPECT_NEAR(moved, std::log(before / r.Typical().prefill) * (1 - std::exp2(-3.0 / 30)), 1e-6);
}

TEST(WorkerRates, ReportedRatesFollowTheFactors) {
  EXPECT_NEAR(PrefillTokensPerSecond(1), 1000 / 0.0152, 1e-6);
  EXPECT_NEAR(PrefillTokensPerSecond(4), PrefillTokensPerSecond(1) / 4, 1e-6);
  EXPECT_NEAR(DecodeStepSeconds(2), 2 * DecodeStepSeconds(1), 1e-12);
}

}  // namespace
}  // namespace kvrouter
