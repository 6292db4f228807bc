#include "router/kvbench/offline.h"

#include <gtest/gtest.h>

namespace kvrouter::bench {
namespace {

// A small conversation workload on 4 small workers: big enough for routing to matter, small
// enough to run in well under a second.
std::vector<TraceRequest> Workload() {
  return SyntheticConversations(
      {.sessions = 40, .turns = 4, .system_blocks = 1, .blocks_per_turn = 2, .requests_per_second = 20, .seed = 3});
}

OfflineOptions Options(std::vector<std::string> flags) {
  OfflineOptions o;
  o.router_flags = std::move(flags);
  o.workers = 4;
  o.engine.num_gpu_blocks = 4096;
  o.seed = 5;
  return o;
}

TEST(OfflineReplay, EveryRequestCompletesAndIsCounted) {
  const auto trace = Workload();
  auto s = RunOffline(trace, Options({"--router-mode", "round-robin"}));
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->requests, trace.size());
  EXPECT_EQ(s->errors, 0u);
  std::uint64_t total = 0;
  for (auto n : s->worker_requests) {
    total += n;
    EXPECT_EQ(n, trace.size() / 4);  // round-robin: an equal share each
  }
  EXPECT_EQ(total, trace.size());
  EXPECT_GT(s->ttft_p50, 0);
  EXPECT_GE(s->e2e_p50, s->ttft_p50);
}

TEST(OfflineReplay, CacheAwareRoutingHitsMoreThanRoundRobin) {
  const auto trace = Workload();
  auto rr = RunOffline(trace, Options({"--router-mode", "round-robin"}));
  auto kv = RunOffline(trace, Options({"--router-mode", "kv", "--router-prefill-load-scale", "4"}));
  auto approx =
      RunOffline(trace, Options({"--router-mode", "kv", "--router-prefill-load-scale", "4", "--no-router-kv-events"}));
  ASSERT_TRUE(rr.ok() && kv.ok() && approx.ok());
  EXPECT_GT(kv->kv_hit_rate, rr->kv_hit_rate + 0.1);
  EXPECT_GT(approx->kv_hit_rate, rr->kv_hit_rate + 0.1);
  const double pooled = PooledLruHitRate(trace, 4 * 4096, 64);
  EXPECT_GE(pooled, rr->kv_hit_rate);
}

TEST(OfflineReplay, SameSeedSameResult) {
  const auto trace = Workload();
  auto a = RunOffline(trace, Options({"--router-mode", "kv"}));
  auto b = RunOffline(trace, Options({"--router-mode", "kv"}));
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(SummaryJson(*a), SummaryJson(*b));
}

TEST(OfflineReplay, BadRouterFlagsAreRefused) {
  auto s = RunOffline(Workload(), Options({"--router-mode", "nonsense"}));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("--router-mode"), std::string::npos);
}

}  // namespace
}  // namespace kvrouter::bench
