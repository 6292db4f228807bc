#include "router/kvtop/fleet_view.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>

#include "router/kvtop/config.h"

namespace kvrouter::top {
namespace {

using std::chrono::seconds;

const SteadyTime kT0{};

WorkerStats Rank(std::uint64_t id, std::uint64_t blocks, std::uint32_t active, std::uint64_t routed,
                 std::string role = "both") {
  WorkerStats w;
  w.worker_id = id;
  w.blocks = blocks;
  w.active_requests = active;
  w.routed_requests = routed;
  w.role = std::move(role);
  return w;
}

FleetSample Sample(SteadyTime at, std::vector<WorkerStats> ranks, std::uint64_t decisions, std::uint64_t events,
                   std::uint64_t request_blocks, std::uint64_t cached_blocks) {
  FleetSample s{.at = at, .ranks = std::move(ranks), .decisions = decisions};
  s.counters = {{"events_applied", events},
                {"routed_request_blocks", request_blocks},
                {"routed_cached_blocks", cached_blocks},
                {"queue_length", 3},
                {"active_requests", 5},
                {"workers_without_events", 1}};
  return s;
}

TEST(FleetView, TwoSamplesGiveRatesAndTheHitRateBetweenThem) {
  const FleetSample a = Sample(kT0, {Rank(1, 10, 0, 100), Rank(2, 50, 2, 40)}, 140, 1000, 400, 100);
  const FleetSample b = Sample(kT0 + seconds(2), {Rank(1, 12, 1, 120), Rank(2, 60, 0, 40)}, 160, 1600, 500, 175);
  const FleetView v = MakeView(&a, b, SortKey::kRate);
  ASSERT_TRUE(v.rates);
  EXPECT_DOUBLE_EQ(v.decisions_per_s, 10);
  EXPECT_DOUBLE_EQ(v.events_per_s, 300);
  ASSERT_TRUE(v.hit_rate);
  EXPECT_DOUBLE_EQ(*v.hit_rate, 0.75);  // 75 of the 100 blocks routed between them
  EXPECT_EQ(v.queue_length, 3u);
  EXPECT_EQ(v.silent_workers, 1u);
  ASSERT_EQ(v.rows.size(), 2u);
  EXPECT_EQ(v.rows[0].stats.worker_id, 1u);  // 10 decisions/s against 0
  EXPECT_DOUBLE_EQ(v.rows[0].decisions_per_s, 10);
  EXPECT_EQ(MakeView(&a, b, SortKey::kCache).rows[0].stats.worker_id, 2u);
  EXPECT_EQ(MakeView(&a, b, SortKey::kLoad).rows[0].stats.worker_id, 1u);  // one active request
  // One sample: no rates, no hit rate.
  const FleetView once = MakeView(nullptr, b, SortKey::kLoad);
  EXPECT_FALSE(once.rates);
  EXPECT_FALSE(once.hit_rate);
  // A router that restarted (counters back to 0) gives 0, not a wrapped rate.
  const FleetSample restarted = Sample(kT0 + seconds(3), {Rank(1, 0, 0, 0)}, 0, 0, 0, 0);
  EXPECT_DOUBLE_EQ(MakeView(&b, restarted, SortKey::kRate).decisions_per_s, 0);
}

TEST(FleetView, LinesShowTotalsRowsBarsAndSilentWorkersWithinTheWidth) {
  WorkerStats silent = Rank(7, 0, 0, 9, "decode");
  silent.without_events = true;
  const FleetSample a = Sample(kT0, {Rank(5, 100, 0, 0, "prefill"), Rank(6, 50, 0, 0, "decode"), silent}, 0, 0, 0, 0);
  const FleetSample b = Sample(kT0 + seconds(1), a.ranks, 4, 10, 8, 2);
  const FleetView v = MakeView(&a, b, SortKey::kCache);
  const auto lines = RenderLines(v, 200, 0, 10);
  ASSERT_EQ(lines.size(), kHeaderLines + 3);
  EXPECT_NE(lines[0].find("3 ranks (1 prefill, 2 decode)"), std::string::npos) << lines[0];
  EXPECT_NE(lines[0].find("decisions 4/s"), std::string::npos) << lines[0];
  EXPECT_NE(lines[0].find("hit 25.0%"), std::string::npos) << lines[0];
  EXPECT_NE(lines[1].find("silent workers 1"), std::string::npos) << lines[1];
  EXPECT_NE(lines[kHeaderLines].find("[############]"), std::string::npos) << lines[kHeaderLines];      // the fullest
  EXPECT_NE(lines[kHeaderLines + 1].find("[######      ]"), std::string::npos) << lines[kHeaderLines + 1];  // half
  EXPECT_NE(lines[kHeaderLines + 2].find("NO KV EVENTS"), std::string::npos) << lines[kHeaderLines + 2];
  for (const auto& l : RenderLines(v, 40, 0, 10)) EXPECT_LE(l.size(), 40u) << l;
  // Scrolled: one row from the second, and a line saying which.
  const auto scrolled = RenderLines(v, 200, 1, 1);
  ASSERT_EQ(scrolled.size(), kHeaderLines + 2);
  EXPECT_NE(scrolled[kHeaderLines].find(" 6 "), std::string::npos) << scrolled[kHeaderLines];
  EXPECT_EQ(scrolled.back(), "ranks 2-2 of 3");
}

TEST(KvtopConfig, FlagsAndTheirBounds) {
  const auto parse = [](std::vector<const char*> args) {
    args.insert(args.begin(), "kvtop");
    return ParseKvtopConfig(static_cast<int>(args.size()), args.data(), [](const char*) -> const char* { return nullptr; });
  };
  auto c = parse({"--once", "--sort", "cache", "--interval-ms", "250"});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_TRUE(c->config.once);
  EXPECT_EQ(c->config.sort, SortKey::kCache);
  EXPECT_EQ(c->config.interval_ms, 250u);
  for (const auto& [args, flag] : std::vector<std::pair<std::vector<const char*>, std::string>>{
           {{"--sort", "size"}, "sort"}, {{"--interval-ms", "10"}, "interval-ms"}, {{"--namespace", ""}, "namespace"}}) {
    auto bad = parse(args);
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find(flag), std::string::npos) << bad.status().message();
  }
}

}  // namespace
}  // namespace kvrouter::top
