#include "router/scheduling/costs.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "router/scheduling/scheduler.h"

namespace kvrouter {
namespace {

// The router's prior, pinned on its own: a change to the simulated engine (engine_model.h) must
// not move it, and a change to it must be made here on purpose.
TEST(RouterPrior, KeepsTheMockerFitsValues) {
  EXPECT_EQ(prior::kPrefillMsPerToken, 0.0152);
  EXPECT_EQ(prior::kPrefillMsPerTokenSquared, 4.21e-7);
  EXPECT_EQ(prior::kStepOverheadMs, 16.5);
  EXPECT_EQ(prior::kUnannouncedKvBlocks, 16384);
  EXPECT_DOUBLE_EQ(prior::PrefillMs(0), 16.5);
  EXPECT_NEAR(prior::PrefillMs(1000), 0.421 + 15.2 + 16.5, 1e-9);
  EXPECT_NEAR(prior::PrefillMs(8192), 169.2712, 1e-3);
  EXPECT_DOUBLE_EQ(prior::DecodeStepMs(0), 5.74);
  EXPECT_NEAR(prior::DecodeStepMs(0.5), -25.74 / 4 + 54.01 / 2 + 5.74, 1e-9);
  EXPECT_NEAR(prior::DecodeStepMs(1), 34.01, 1e-9);
  EXPECT_DOUBLE_EQ(prior::DecodeStepMs(3), 1.0);  // the quadratic is negative there
}

// Registered ranks over every combination of a few values of each registration field.
std::vector<RankInfo> RankVariations() {
  std::vector<RankInfo> ranks;
  std::uint64_t id = 1;
  for (const std::uint64_t kv_blocks : {0ull, 1024ull, 16384ull, 200000ull}) {
    for (const std::uint32_t batched : {256u, 2048u, 8192u}) {
      for (const std::uint32_t seqs : {1u, 256u}) {
        for (const bool cpu : {false, true}) {
          ranks.push_back({.worker = {id++, static_cast<std::uint32_t>(id % 3)},
                           .is_cpu = cpu,
                           .max_num_seqs = seqs,
                           .max_num_batched_tokens = batched,
                           .total_kv_blocks = kv_blocks});
        }
      }
    }
  }
  return ranks;
}

// Two idle ranks (nothing booked, nothing learned) whose IdleKeyOf is equal price alike under
// Cost, for any request and overlap: a pick over the fleet prices one rank per class
// (Scheduler::PickFromFleet), so a price that read a field the key omits would choose wrongly.
template <typename Cost>
void ExpectRanksSharingTheKeyPriceAlikeWhenIdle() {
  ShardedIndex index{{.num_shards = 1}};
  SchedulerOptions o;
  o.mode = RouterMode::kKv;
  o.cost.model = Cost::kModel;
  Scheduler s(
      o, index, [] { return SteadyTime{}; }, 1);
  const std::vector<RankInfo> ranks = RankVariations();
  OverlapScores none;
  const std::vector<Candidate> idle = s.Candidates(ranks, {}, none);
  ASSERT_EQ(idle.size(), ranks.size());
  std::size_t pairs = 0;
  for (const std::uint32_t isl : {64u, 5000u, 40000u, 300000u}) {
    const SelectionRequest req{isl, (isl + 63) / 64};
    const KvPricing pricing = Cost::PricingOf(req, o.cost, 0, ranks.size());
    for (const std::uint32_t overlap : {0u, 3u, 60u}) {
      auto price = [&](std::size_t i) {
        Candidate c = idle[i];
        c.overlap_blocks = c.host_overlap_blocks = c.any_overlap_blocks = overlap;
        return Cost::PickPrice(c, req, o.cost, pricing);
      };
      for (std::size_t i = 0; i < ranks.size(); ++i) {
        for (std::size_t j = i + 1; j < ranks.size(); ++j) {
          if (Cost::IdleKeyOf(ranks[i]) != Cost::IdleKeyOf(ranks[j])) continue;
          ++pairs;
          EXPECT_EQ(price(i), price(j)) << "ranks " << i << " and " << j << " at isl " << isl << ", overlap "
                                        << overlap;
        }
      }
    }
  }
  EXPECT_GT(pairs, 0u);
}

TEST(CostIdleKey, RanksSharingTheKvBlocksCostsKeyPriceAlikeWhenIdle) {
  ExpectRanksSharingTheKeyPriceAlikeWhenIdle<KvBlocksCost>();
}

TEST(CostIdleKey, RanksSharingThePredictedCostsKeyPriceAlikeWhenIdle) {
  ExpectRanksSharingTheKeyPriceAlikeWhenIdle<PredictedTimeCost>();
}

// The fleet pick's classes hold every cost's key: ranks of one class share each cost's key.
TEST(CostIdleKey, ARankClassSharesEveryCostsKey) {
  const std::vector<RankInfo> ranks = RankVariations();
  for (const RankInfo& a : ranks) {
    for (const RankInfo& b : ranks) {
      if (RankClassKeyOf(a) != RankClassKeyOf(b)) continue;
      EXPECT_EQ(KvBlocksCost::IdleKeyOf(a), KvBlocksCost::IdleKeyOf(b));
      EXPECT_EQ(PredictedTimeCost::IdleKeyOf(a), PredictedTimeCost::IdleKeyOf(b));
    }
  }
}

// The dispatch hands each model its own cost.
TEST(CostIdleKey, WithCostResolvesEachModelToItsType) {
  for (const CostModel m : {CostModel::kKvBlocks, CostModel::kPredicted}) {
    EXPECT_EQ(WithCost(m, []<class Cost>() { return Cost::kModel; }), m);
  }
}

}  // namespace
}  // namespace kvrouter
