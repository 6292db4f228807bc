#include "router/selector.h"

#include <gtest/gtest.h>

#include <map>

namespace kvrouter {
namespace {

// A candidate with `prefill` active prefill blocks and `decode` active decode blocks.
Candidate Loaded(std::uint64_t id, double prefill_blocks, std::uint64_t decode_blocks, std::uint32_t bs = 64) {
  Candidate c;
  c.worker = {id, 0};
  c.active_prefill_tokens = static_cast<std::uint64_t>(prefill_blocks * bs);
  c.active_blocks = decode_blocks;
  return c;
}

TEST(KvCost, TableOfCases) {
  struct Case {
    const char* name;
    Candidate c;
    SelectionRequest req;
    CostParams p;
    double want;
  };
  Candidate overlap4 = Loaded(1, 0, 0);
  overlap4.overlap_blocks = 4;
  Candidate busy = Loaded(1, 2, 10);
  Candidate active_prefix = Loaded(1, 0, 6);
  active_prefix.active_prefix_blocks = 3;
  const std::vector<Case> cases = {
      {"idle, 4-block prompt", Loaded(1, 0, 0), {256, 4}, {}, 4 + 4},
      {"cached prefix credits prefill", overlap4, {256, 4}, {}, 0 + 4},
      {"credit never makes prefill negative", overlap4, {128, 2}, {}, 0 + 2},
      {"half credit", overlap4, {256, 4}, {.overlap_score_credit = 0.5}, 2 + 4},
      {"active prefill and decode load", busy, {128, 2}, {}, (2 + 2) + (10 + 2)},
      {"prefill scale", busy, {128, 2}, {.prefill_load_scale = 2}, 2 * 4 + 12},
      {"untracked prefill keeps the prompt", busy, {128, 2}, {.track_prefill_tokens = false}, 2 + 12},
      {"partial block divides exactly", Loaded(1, 0, 0), {96, 2}, {}, 1.5 + 2},
      {"active prefix is not double-counted", active_prefix, {256, 4}, {}, 4 + (6 + 4 - 3)},
  };
  for (const Case& k : cases) {
    EXPECT_DOUBLE_EQ(KvCost(k.c, k.req, k.p), k.want) << k.name;
  }
}

// DESIGN.md's worked example: prefill+decode blocks 8+10, 5+5, 2+9 -> the 5+5 worker.
TEST(Selector, WorkedExamplePicksTheFivePlusFiveWorker) {
  std::vector<Candidate> c = {Loaded(1, 8, 10), Loaded(2, 5, 5), Loaded(3, 2, 9)};
  Selector sel;
  std::mt19937_64 rng(1);
  // An empty request (isl 0) leaves just the existing load: costs 18, 10, 11.
  EXPECT_EQ(sel.Pick(RouterMode::kKv, {0, 0}, c, {}, rng), 1u);
}

TEST(Selector, KvPrefersTheCachedWorkerWhenLoadIsEqual) {
  std::vector<Candidate> c = {Loaded(1, 0, 0), Loaded(2, 0, 0), Loaded(3, 0, 0)};
  c[2].overlap_blocks = 3;
  Selector sel;
  std::mt19937_64 rng(1);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(sel.Pick(RouterMode::kKv, {256, 4}, c, {}, rng), 2u);
}

TEST(Selector, TiesAreBrokenUniformly) {
  std::vector<Candidate> c = {Loaded(1, 0, 0), Loaded(2, 0, 0), Loaded(3, 0, 0), Loaded(4, 9, 9)};
  Selector sel;
  std::mt19937_64 rng(7);
  std::map<std::size_t, int> hits;
  for (int i = 0; i < 3000; ++i) ++hits[sel.Pick(RouterMode::kKv, {64, 1}, c, {}, rng)];
  EXPECT_EQ(hits.count(3), 0u);
  for (std::size_t i = 0; i < 3; ++i) EXPECT_NEAR(hits[i], 1000, 120) << i;
}

TEST(Selector, TemperatureSamplesBySoftmaxOfNormalisedCost) {
  // Costs 0, 1, 2 (max - min = 2), T = 1: weights exp(0), exp(-0.5), exp(-1).
  std::vector<Candidate> c = {Loaded(1, 0, 0), Loaded(2, 0, 1), Loaded(3, 0, 2)};
  Selector sel;
  std::mt19937_64 rng(12345);
  std::map<std::size_t, int> hits;
  constexpr int kN = 20000;
  for (int i = 0; i < kN; ++i) ++hits[sel.Pick(RouterMode::kKv, {0, 0}, c, {.temperature = 1.0}, rng)];
  const double w[3] = {1.0, std::exp(-0.5), std::exp(-1.0)};
  const double sum = w[0] + w[1] + w[2];
  for (std::size_t i = 0; i < 3; ++i) EXPECT_NEAR(hits[i] / double(kN), w[i] / sum, 0.015) << i;
}

TEST(Selector, ExtremeWeightsStillPickTheCheapestFiniteCandidate) {
  // A scale of 1e308 makes every loaded candidate's cost inf; the idle cached one stays finite.
  std::vector<Candidate> c = {Loaded(1, 4, 4), Loaded(2, 0, 0), Loaded(3, 9, 9)};
  c[1].overlap_blocks = 4;
  Selector sel;
  std::mt19937_64 rng(3);
  const CostParams huge{.prefill_load_scale = 1e308, .temperature = 1e308};
  for (int i = 0; i < 50; ++i) EXPECT_EQ(sel.Pick(RouterMode::kKv, {256, 4}, c, huge, rng), 1u);
  // Temperature 1e308 over finite costs: (max - min) * T overflows; sampling stays valid.
  std::vector<Candidate> finite = {Loaded(1, 0, 0), Loaded(2, 0, 5)};
  std::map<std::size_t, int> hits;
  for (int i = 0; i < 200; ++i) ++hits[sel.Pick(RouterMode::kKv, {0, 0}, finite, {.temperature = 1e308}, rng)];
  EXPECT_EQ(hits[0] + hits[1], 200);
}

TEST(Selector, RoundRobinCycles) {
  std::vector<Candidate> c = {Loaded(1, 0, 0), Loaded(2, 0, 0), Loaded(3, 0, 0)};
  Selector sel;
  std::mt19937_64 rng(1);
  std::vector<std::size_t> got;
  for (int i = 0; i < 6; ++i) got.push_back(sel.Pick(RouterMode::kRoundRobin, {}, c, {}, rng));
  EXPECT_EQ(got, (std::vector<std::size_t>{0, 1, 2, 0, 1, 2}));
}

TEST(Selector, RandomCoversEveryCandidate) {
  std::vector<Candidate> c = {Loaded(1, 0, 0), Loaded(2, 0, 0), Loaded(3, 0, 0)};
  Selector sel;
  std::mt19937_64 rng(3);
  std::map<std::size_t, int> hits;
  for (int i = 0; i < 3000; ++i) ++hits[sel.Pick(RouterMode::kRandom, {}, c, {}, rng)];
  for (std::size_t i = 0; i < 3; ++i) EXPECT_NEAR(hits[i], 1000, 120);
}

TEST(Selector, LeastLoadedAndPowerOfTwoAvoidTheBusiest) {
  std::vector<Candidate> c = {Loaded(1, 0, 0), Loaded(2, 0, 0), Loaded(3, 0, 0)};
  c[0].active_requests = 5;
  c[1].active_requests = 1;
  c[2].active_requests = 3;
  Selector sel;
  std::mt19937_64 rng(5);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(sel.Pick(RouterMode::kLeastLoaded, {}, c, {}, rng), 1u);
  // Power of two never picks the busiest of three: it always loses its pair.
  for (int i = 0; i < 200; ++i) EXPECT_NE(sel.Pick(RouterMode::kPowerOfTwo, {}, c, {}, rng), 0u);
}

TEST(Selector, DeviceAwareSplitsByRatioTimesCapacity) {
  std::vector<Candidate> c = {Loaded(1, 0, 0), Loaded(2, 0, 0)};
  c[0].is_cpu = true;
  Selector sel;
  std::mt19937_64 rng(11);
  int cpu = 0;
  constexpr int kN = 9000;
  for (int i = 0; i < kN; ++i) cpu += sel.Pick(RouterMode::kDeviceAwareWeighted, {}, c, {.device_ratio = 8}, rng) == 0;
  EXPECT_NEAR(cpu / double(kN), 1.0 / 9.0, 0.015);  // accelerator weight 8 x 1 vs CPU 1
}

}  // namespace
}  // namespace kvrouter
