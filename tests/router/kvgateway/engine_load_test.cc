// EngineLoad (router/kvgateway/engine_load.h): calls counted while their hold lives, the least
// loaded candidate, equal ones taking turns.
#include "router/kvgateway/engine_load.h"

#include <gtest/gtest.h>

#include <set>
#include <vector>

namespace kvrouter {
namespace {

TEST(EngineLoad, ACallCountsUntilItsLastHoldIsDropped) {
  EngineLoad load;
  auto a = load.Add(7);
  auto copy = a;  // a call's callbacks may be copied
  auto b = load.Add(7);
  EXPECT_EQ(load.InFlight(7), 2u);
  a.reset();
  EXPECT_EQ(load.InFlight(7), 2u);
  copy.reset();
  EXPECT_EQ(load.InFlight(7), 1u);
  b.reset();
  EXPECT_EQ(load.InFlight(7), 0u);
  EXPECT_EQ(load.InFlight(8), 0u);
}

TEST(EngineLoad, AHoldMayOutliveTheLoad) {
  EngineLoad::Hold hold;
  {
    EngineLoad load;
    hold = load.Add(1);
  }
  hold.reset();  // no use of the gone EngineLoad (ASan would see it)
}

TEST(EngineLoad, TheLeastLoadedCandidateAndEqualOnesTakeTurns) {
  EngineLoad load;
  const SteadyTime now{};
  const std::vector<std::uint64_t> workers = {1, 2, 3};
  EXPECT_FALSE(load.Least({}, 0, now).has_value());
  std::set<std::uint64_t> picked;
  for (std::size_t r = 0; r < 3; ++r) picked.insert(*load.Least(workers, r, now));
  EXPECT_EQ(picked, (std::set<std::uint64_t>{1, 2, 3}));
  auto h1 = load.Add(1), h3 = load.Add(3), h3b = load.Add(3);
  for (std::size_t r = 0; r < 3; ++r) EXPECT_EQ(load.Least(workers, r, now), 2u);
  auto h2 = load.Add(2), h2b = load.Add(2);
  for (std::size_t r = 0; r < 3; ++r) EXPECT_EQ(load.Least(workers, r, now), 1u);
  // Only candidates count (1, the least loaded, is not one); 2 and 3 are equal: the rotation picks.
  const std::vector<std::uint64_t> two = {2, 3};
  EXPECT_EQ(load.Least(two, 0, now), 2u);
  EXPECT_EQ(load.Least(two, 1, now), 3u);
}

TEST(EngineLoad, AnEngineThatJustFailedIsPassedOverUnlessEveryOneDid) {
  EngineLoad load;
  const SteadyTime t0{std::chrono::seconds(100)};
  const std::vector<std::uint64_t> workers = {1, 2};
  auto busy = load.Add(2);  // 1 is idle, and would be chosen
  load.Failed(1, t0);
  EXPECT_EQ(load.Least(workers, 0, t0 + std::chrono::seconds(1)), 2u);
  EXPECT_TRUE(load.AnyHealthy(workers, t0));
  load.Failed(2, t0);
  EXPECT_FALSE(load.AnyHealthy(workers, t0));
  EXPECT_EQ(load.Least(workers, 0, t0), 1u);  // both failed: by load again
  // The pause ends.
  const SteadyTime later = t0 + EngineLoad::kFailedPause;
  EXPECT_TRUE(load.AnyHealthy(workers, later));
  EXPECT_EQ(load.Least(workers, 1, later), 1u);
}

}  // namespace
}  // namespace kvrouter
