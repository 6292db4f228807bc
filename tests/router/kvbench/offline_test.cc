#include "router/kvbench/offline.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <numeric>

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

// Every later token of every request of `trace`.
std::uint64_t LaterTokens(const std::vector<TraceRequest>& trace) {
  std::uint64_t n = 0;
  for (const TraceRequest& r : trace) n += std::max<std::uint32_t>(1, r.output_length) - 1;
  return n;
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
  OfflineOptions o = Options({"--router-mode", "kv"});
  auto a = RunOffline(trace, o);
  auto b = RunOffline(trace, o);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(SummaryJson(*a), SummaryJson(*b));
  o.worker_speedups = {1, 1, 0.25, 0.25};  // a mixed fleet too
  auto c = RunOffline(trace, o);
  auto d = RunOffline(trace, o);
  ASSERT_TRUE(c.ok() && d.ok());
  EXPECT_EQ(SummaryJson(*c), SummaryJson(*d));
}

TEST(OfflineReplay, WorkerSpeedupsMultiplyTheSpeedupRatio) {
  const auto trace = Workload();
  OfflineOptions global = Options({"--router-mode", "kv"});
  global.engine.speedup_ratio = 2;
  OfflineOptions per_worker = Options({"--router-mode", "kv"});
  per_worker.worker_speedups = {2, 2, 2, 2};
  OfflineOptions both = Options({"--router-mode", "kv"});
  both.engine.speedup_ratio = 4;
  both.worker_speedups = {0.5, 0.5, 0.5, 0.5};
  auto a = RunOffline(trace, global);
  auto b = RunOffline(trace, per_worker);
  auto c = RunOffline(trace, both);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(SummaryJson(*a), SummaryJson(*b));
  EXPECT_EQ(SummaryJson(*a), SummaryJson(*c));
}

TEST(OfflineReplay, SlowWorkersAnswerLaterAndAreBusier) {
  // Round-robin gives every worker the same share, so a fleet with two workers at a quarter of
  // the speed answers its slowest requests later than a uniform one, and those two workers spend
  // longer in engine steps than the others.
  const auto trace = Workload();
  OfflineOptions uniform = Options({"--router-mode", "round-robin"});
  OfflineOptions mixed = uniform;
  mixed.worker_speedups = {1, 1, 0.25, 0.25};
  auto u = RunOffline(trace, uniform);
  auto m = RunOffline(trace, mixed);
  ASSERT_TRUE(u.ok() && m.ok());
  EXPECT_EQ(m->errors, 0u);
  EXPECT_EQ(m->worker_requests, u->worker_requests);
  EXPECT_GT(m->ttft_p90, u->ttft_p90);
  EXPECT_GT(m->e2e_p90, u->e2e_p90);
  EXPECT_GE(m->ttft_p50, u->ttft_p50);

  ASSERT_EQ(m->worker_busy_ms.size(), 4u);
  const double slowest_fast = std::max(m->worker_busy_ms[0], m->worker_busy_ms[1]);
  EXPECT_GT(m->worker_busy_ms[2], slowest_fast);
  EXPECT_GT(m->worker_busy_ms[3], slowest_fast);
  for (std::size_t w = 0; w < 2; ++w) EXPECT_DOUBLE_EQ(m->worker_busy_ms[w], u->worker_busy_ms[w]) << w;
  ASSERT_TRUE(BusyTimeMaxOverMean(*u) && BusyTimeMaxOverMean(*m));
  EXPECT_GT(*BusyTimeMaxOverMean(*m), *BusyTimeMaxOverMean(*u));
}

TEST(OfflineReplay, BusyTimeIsTheSumOfTheEngineStepDurations) {
  // Three distinct one-token requests far apart: each is one engine step, a prefill of its
  // whole prompt, on a worker that is otherwise idle.
  std::vector<TraceRequest> trace;
  for (std::uint64_t i = 0; i < 3; ++i) {
    trace.push_back({.timestamp_ms = 10000.0 * static_cast<double>(i),
                     .input_length = 1024,
                     .output_length = 1,
                     .hash_ids = {10 * i + 1, 10 * i + 2}});
  }
  OfflineOptions o = Options({"--router-mode", "round-robin"});
  o.workers = 2;
  o.engine.speedup_ratio = 2;
  o.worker_speedups = {1, 0.25};
  auto s = RunOffline(trace, o);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  ASSERT_EQ(s->errors, 0u);
  ASSERT_EQ(s->worker_busy_ms.size(), 2u);
  for (std::size_t w = 0; w < 2; ++w) {
    const double speedup = o.engine.speedup_ratio * o.worker_speedups[w];
    EXPECT_DOUBLE_EQ(s->worker_busy_ms[w], static_cast<double>(s->worker_requests[w]) * MockPrefillMs(1024, speedup))
        << w;
  }
}

TEST(OfflineReplay, EachLaterTokensGapIsTheDecodeStepThatMadeIt) {
  // One request alone on its worker: a prefill step, then one decode step per later token, each
  // at the utilisation of its 16 blocks.
  const std::vector<TraceRequest> trace = {{.input_length = 1024, .output_length = 5, .hash_ids = {1, 2}}};
  OfflineOptions o = Options({"--router-mode", "round-robin"});
  auto s = RunOffline(trace, o);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  ASSERT_EQ(s->errors, 0u);
  const double step = MockDecodeStepMs(16.0 / o.engine.num_gpu_blocks, o.engine.speedup_ratio);
  EXPECT_EQ(s->itl_gaps, 4u);
  ASSERT_TRUE(s->itl_p50 && s->itl_p99);
  EXPECT_NEAR(*s->itl_p50, step, 0.0005);  // kept to the microsecond
  EXPECT_NEAR(*s->itl_p99, step, 0.0005);
  EXPECT_NEAR(s->tpot_p50, step, 1e-9);  // (finish - first token) / 4
  EXPECT_DOUBLE_EQ(s->goodput, 1.0);
}

TEST(OfflineReplay, EveryLaterTokenOfEveryRequestHasItsGap) {
  const auto trace = Workload();
  auto s = RunOffline(trace, Options({"--router-mode", "kv"}));
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  ASSERT_EQ(s->errors, 0u);
  EXPECT_EQ(s->itl_gaps, LaterTokens(trace));
  ASSERT_TRUE(s->itl_p50 && s->itl_p99);
  EXPECT_GT(*s->itl_p50, 0);
  EXPECT_LE(*s->itl_p50, *s->itl_p99);
  EXPECT_GT(s->tpot_p50, 0);
  EXPECT_GT(s->goodput, 0);
  EXPECT_LE(s->goodput, 1);
  // An aggregated fleet is one pool, "both", of every worker's busy time.
  ASSERT_EQ(s->pool_busy_ms.size(), 1u);
  EXPECT_DOUBLE_EQ(s->pool_busy_ms.at("both"),
                   std::accumulate(s->worker_busy_ms.begin(), s->worker_busy_ms.end(), 0.0));
  EXPECT_FALSE(s->prefill_busy_max_over_mean.has_value());
}

TEST(OfflineReplay, PrefillWorkersAreTheFirstWorkersAndNeverARequestsWorker) {
  const auto trace = Workload();
  OfflineOptions o = Options({"--router-mode", "kv"});
  o.prefill_workers = 1;
  auto s = RunOffline(trace, o);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->errors, 0u);
  ASSERT_EQ(s->worker_requests.size(), 4u);
  EXPECT_EQ(s->worker_requests[0], 0u);  // registered as a prefill worker
  EXPECT_EQ(s->worker_requests[1] + s->worker_requests[2] + s->worker_requests[3], trace.size());
  ASSERT_EQ(s->worker_busy_ms.size(), 4u);
  EXPECT_DOUBLE_EQ(s->pool_busy_ms.at("prefill"), s->worker_busy_ms[0]);
  EXPECT_DOUBLE_EQ(s->pool_busy_ms.at("decode"), s->worker_busy_ms[1] + s->worker_busy_ms[2] + s->worker_busy_ms[3]);
  EXPECT_TRUE(s->prefill_busy_max_over_mean.has_value());
}

// `trace` on the 4 workers of Options, the first 2 of them prefill workers, under `policy`.
Result<Summary> RunPd(const std::vector<TraceRequest>& trace, const std::string& policy) {
  OfflineOptions o = Options({"--router-mode", "kv", "--router-disagg-policy", policy});
  o.prefill_workers = 2;
  return RunOffline(trace, o);
}

TEST(OfflineReplay, DisaggregatedRequestsRunAPrefillLegThenADecodeLegThatPullsIt) {
  const auto trace = Workload();
  auto s = RunPd(trace, "always");
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->errors, 0u);
  EXPECT_EQ(s->disagg_decisions["disaggregated"], trace.size());
  // The decode workers are the requests' workers; the prefill workers ran the prefill legs.
  EXPECT_EQ(s->worker_requests[0] + s->worker_requests[1], 0u);
  EXPECT_EQ(s->worker_requests[2] + s->worker_requests[3], trace.size());
  EXPECT_GT(s->worker_busy_ms[0], 0);
  EXPECT_GT(s->worker_busy_ms[1], 0);
  EXPECT_GT(s->pool_busy_ms.at("prefill"), 0);
  EXPECT_GT(s->pool_busy_ms.at("decode"), 0);
  ASSERT_TRUE(s->prefill_busy_max_over_mean.has_value());
  EXPECT_GE(*s->prefill_busy_max_over_mean, 1.0);
  // Every later token is the decode leg's; the prefill leg's one token is no gap of the request.
  EXPECT_EQ(s->itl_gaps, LaterTokens(trace));
  EXPECT_GT(s->kv_hit_rate, 0);  // the prefill engines' cache hits
  // prefill_done, mark_prefill and free released every booking.
  ASSERT_TRUE(s->bookings_left.has_value());
  EXPECT_EQ(*s->bookings_left, BookingsLeft{});
  // Deterministic for a seed, as the aggregated replay is.
  auto again = RunPd(trace, "always");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(SummaryJson(*s), SummaryJson(*again));
}

TEST(OfflineReplay, ADisaggregatedRequestsFirstTokenIsItsDecodeLegsAfterThePull) {
  // One request on an idle fleet of a prefill and a decode worker: the prefill leg's step (its
  // whole prompt), the pull of its 16 blocks, then the decode leg's first step.
  const std::vector<TraceRequest> trace = {{.input_length = 1024, .output_length = 3, .hash_ids = {1, 2}}};
  OfflineOptions o = Options({"--router-mode", "kv", "--router-disagg-policy", "always"});
  o.workers = 2;
  o.prefill_workers = 1;
  auto s = RunOffline(trace, o);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  ASSERT_EQ(s->errors, 0u);
  ASSERT_EQ(s->disagg_decisions["disaggregated"], 1u);
  const double prefill = MockPrefillMs(1024, o.engine.speedup_ratio);
  const double pull = MockKvTransferMs(16, o.engine);
  const double step = MockDecodeStepMs(16.0 / o.engine.num_gpu_blocks, o.engine.speedup_ratio);
  EXPECT_NEAR(s->ttft_p50, prefill + pull + step, 1e-6);
  EXPECT_NEAR(s->e2e_p50, prefill + pull + 3 * step, 1e-6);
  EXPECT_DOUBLE_EQ(s->worker_busy_ms[0], prefill);  // the prefill leg: one step, no decode
  EXPECT_NEAR(s->worker_busy_ms[1], 3 * step, 1e-9);
  EXPECT_EQ(s->itl_gaps, 2u);
  ASSERT_TRUE(s->bookings_left.has_value());
  EXPECT_EQ(*s->bookings_left, BookingsLeft{});
}

TEST(OfflineReplay, NeverKeepsThePrefillPoolIdle) {
  const auto trace = Workload();
  auto s = RunPd(trace, "never");
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_EQ(s->errors, 0u);
  EXPECT_EQ(s->disagg_decisions["local"], trace.size());
  EXPECT_EQ(s->disagg_decisions["disaggregated"], 0u);
  EXPECT_EQ(s->pool_busy_ms.at("prefill"), 0);
  EXPECT_EQ(s->prefill_busy_max_over_mean, 0.0);
  EXPECT_EQ(s->itl_gaps, LaterTokens(trace));
}

TEST(OfflineReplay, AFleetWithoutDecodeWorkersIsRefused) {
  for (std::uint32_t prefill : {4u, 5u}) {
    OfflineOptions o = Options({"--router-mode", "kv"});
    o.prefill_workers = prefill;
    auto s = RunOffline(Workload(), o);
    ASSERT_FALSE(s.ok()) << prefill;
    EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.status().message().find("--prefill-workers"), std::string::npos) << s.status().message();
  }
}

TEST(OfflineReplay, WorkerSpeedupsNeedOnePositiveValuePerWorker) {
  for (const std::vector<double>& bad : std::vector<std::vector<double>>{
           {1, 1}, {1, 1, 1, 1, 1}, {1, 1, 1, 0}, {1, 1, 1, -1}, {1, 1, 1, std::numeric_limits<double>::infinity()}}) {
    OfflineOptions o = Options({"--router-mode", "kv"});
    o.worker_speedups = bad;
    auto s = RunOffline(Workload(), o);
    ASSERT_FALSE(s.ok()) << bad.size();
    EXPECT_EQ(s.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.status().message().find("--worker-speedups"), std::string::npos) << s.status().message();
  }
}

TEST(OfflineReplay, BadRouterFlagsAreRefused) {
  auto s = RunOffline(Workload(), Options({"--router-mode", "nonsense"}));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("--router-mode"), std::string::npos);
}

}  // namespace
}  // namespace kvrouter::bench
