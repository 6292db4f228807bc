// Routing quality of the default kv cost (issue 13's goal), replayed offline with fixed seeds:
// on every synthetic workload shape and on a slice of the shared Mooncake trace, the default
// reaches 90 % of the pooled-LRU hit rate, keeps the busiest worker's busy time within 1.3x the
// mean (and every worker serving), and its TTFT p50 and p99 are no worse than round-robin's and
// Dynamo's formula's (scale 1).
// Fixed seeds make these exact regressions tests: a change that costs hit rate fails here.
// On a mixed fleet (four workers 4x slower than the other four, the router told nothing of it:
// it learns their speeds), the default's TTFT p50 and p99 are at least 25 % below the best of
// Dynamo's formula, round-robin and least-loaded, its hit rate at least Dynamo's, and the
// busiest worker's busy time within 1.3x the mean. With every engine 4x slower or 4x faster than
// the prior, on the whole trace, the default still meets the first goal.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>

#include "router/kvbench/offline.h"

namespace kvrouter::bench {
namespace {

struct Runs {
  Summary ours, dynamo, round_robin;
  double pooled = 0;
};

// The default, Dynamo's formula and round-robin (and, when asked, least-loaded) on `trace`.
Runs Replay(const std::vector<TraceRequest>& trace, OfflineOptions o = {}, Summary* least_loaded = nullptr) {
  // Default options: 8 workers x 16,384 blocks x 64 tokens, as in docs/performance.md.
  Runs r;
  r.pooled = PooledLruHitRate(trace, std::uint64_t{o.workers} * o.engine.num_gpu_blocks, o.engine.block_size);
  auto run = [&](std::vector<std::string> flags) {
    o.router_flags = std::move(flags);
    auto s = RunOffline(trace, o);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    EXPECT_EQ(s.ok() ? s->errors : 1, 0u);
    return s.ok() ? *s : Summary{};
  };
  r.ours = run({"--router-mode", "kv"});
  r.dynamo = run({"--router-mode", "kv", "--router-prefill-load-scale", "1"});
  r.round_robin = run({"--router-mode", "round-robin"});
  if (least_loaded) *least_loaded = run({"--router-mode", "least-loaded"});
  return r;
}

// Balance as it costs users: the busiest worker's busy time (its prefill and decode) within 1.3x
// the mean, and no worker left without a request (request counts mislead when sessions differ
// in length).
void ExpectBalanced(const Summary& s) {
  const auto busy = BusyTimeMaxOverMean(s);
  ASSERT_TRUE(busy.has_value());
  EXPECT_LE(*busy, 1.3) << s.mode;
  for (std::size_t w = 0; w < s.worker_requests.size(); ++w) EXPECT_GT(s.worker_requests[w], 0u) << "worker " << w;
}

// "No worse": within 1 % (the percentiles of equal runs can differ by a step's rounding).
void ExpectTheGoal(const Runs& r) {
  EXPECT_GE(r.ours.kv_hit_rate, 0.9 * r.pooled) << "hit rate against the pooled-LRU bound";
  EXPECT_GE(r.ours.kv_hit_rate, r.dynamo.kv_hit_rate);
  ExpectBalanced(r.ours);
  for (const Summary* other : {&r.dynamo, &r.round_robin}) {
    EXPECT_LE(r.ours.ttft_p50, 1.01 * other->ttft_p50) << other->mode;
    EXPECT_LE(r.ours.ttft_p99, 1.01 * other->ttft_p99) << other->mode;
  }
}

class QualityByShape : public ::testing::TestWithParam<WorkloadShape> {};

TEST_P(QualityByShape, TheDefaultMeetsTheGoal) {
  const Runs r = Replay(SyntheticConversations(WorkloadDefaults(GetParam())));
  ExpectTheGoal(r);
}

INSTANTIATE_TEST_SUITE_P(Workloads, QualityByShape,
                         ::testing::Values(WorkloadShape::kChat, WorkloadShape::kSystemPrompts, WorkloadShape::kAgentic,
                                           WorkloadShape::kBursts),
                         [](const ::testing::TestParamInfo<WorkloadShape>& shape) {
                           std::string n = WorkloadName(shape.param);
                           std::erase(n, '-');
                           return n;
                         });

TEST(Quality, TheFirst2000RequestsOfTheSharedTrace) {
  if (!std::filesystem::exists(KVROUTER_TRACE)) GTEST_SKIP() << "no trace at " << KVROUTER_TRACE;
  auto trace = ReadMooncakeTrace(KVROUTER_TRACE);
  ASSERT_TRUE(trace.ok()) << trace.status().ToString();
  trace->resize(std::min<std::size_t>(trace->size(), 2000));
  ExpectTheGoal(Replay(*trace));
}

// A prior wrong for the whole fleet (every engine 4x slower or faster than the timing model
// says), on the whole trace: the rates are learned, and the default still meets the goal. With
// every engine slower the fleet is overloaded and the p99 is the longest prompts' (90k tokens
// and more), which the bound on inflicted waits keeps from queueing behind a busy worker. With
// every engine faster a cache hit saves a quarter of the prior's time, and the spread term is
// priced in the fleet's time (halved) so as to stay below it: unscaled, 0.895x the pooled bound.
void ExpectTheGoalUnderAWrongPrior(double speedup) {
  if (!std::filesystem::exists(KVROUTER_TRACE)) GTEST_SKIP() << "no trace at " << KVROUTER_TRACE;
  auto trace = ReadMooncakeTrace(KVROUTER_TRACE);
  ASSERT_TRUE(trace.ok()) << trace.status().ToString();
  ExpectTheGoal(Replay(*trace, {.worker_speedups = std::vector<double>(8, speedup)}));
}

TEST(Quality, EveryEngine4xSlowerThanThePriorOnTheSharedTrace) { ExpectTheGoalUnderAWrongPrior(0.25); }
TEST(Quality, EveryEngine4xFasterThanThePriorOnTheSharedTrace) { ExpectTheGoalUnderAWrongPrior(4); }

// Fan-out (32 questions at one instant on a document nobody holds) is where the pooled bound is
// out of reach at equal TTFT: sharing the prefill means queueing behind it. The default must
// still be no worse than the others on every count.
TEST(Quality, FanoutIsNoWorseThanTheOthers) {
  const Runs r = Replay(SyntheticConversations(WorkloadDefaults(WorkloadShape::kFanout)));
  EXPECT_GE(r.ours.kv_hit_rate, 0.99 * r.dynamo.kv_hit_rate);
  EXPECT_GE(r.ours.kv_hit_rate, 0.99 * r.round_robin.kv_hit_rate);
  ExpectBalanced(r.ours);
  EXPECT_LE(r.ours.ttft_p50, 1.01 * r.round_robin.ttft_p50);
  EXPECT_LE(r.ours.ttft_p50, 1.01 * r.dynamo.ttft_p50);
}

void ExpectTheMixedFleetGoal(const std::vector<TraceRequest>& trace) {
  // Four workers at full speed, four 4x slower.
  Summary least_loaded;
  const Runs r = Replay(trace, {.worker_speedups = {1, 1, 1, 1, 0.25, 0.25, 0.25, 0.25}}, &least_loaded);
  EXPECT_GE(r.ours.kv_hit_rate, r.dynamo.kv_hit_rate);
  ExpectBalanced(r.ours);
  // The fast half serves most of the traffic (it is learned fast; the prior says all are equal).
  ASSERT_EQ(r.ours.worker_requests.size(), 8u);
  const std::uint64_t fast =
      r.ours.worker_requests[0] + r.ours.worker_requests[1] + r.ours.worker_requests[2] + r.ours.worker_requests[3];
  std::printf("mixed fleet: fast half served %.1f %% of the requests\n", 100.0 * fast / r.ours.requests);
  EXPECT_GE(static_cast<double>(fast), 0.7 * r.ours.requests);
  for (const Summary* other : {&r.dynamo, &r.round_robin, static_cast<const Summary*>(&least_loaded)}) {
    EXPECT_LE(r.ours.ttft_p50, 0.75 * other->ttft_p50) << other->mode;
    EXPECT_LE(r.ours.ttft_p99, 0.75 * other->ttft_p99) << other->mode;
  }
}

TEST(Quality, AMixedFleetOnTheFirst2000RequestsOfTheSharedTrace) {
  if (!std::filesystem::exists(KVROUTER_TRACE)) GTEST_SKIP() << "no trace at " << KVROUTER_TRACE;
  auto trace = ReadMooncakeTrace(KVROUTER_TRACE);
  ASSERT_TRUE(trace.ok()) << trace.status().ToString();
  trace->resize(std::min<std::size_t>(trace->size(), 2000));
  ExpectTheMixedFleetGoal(*trace);
}

class MixedFleetByShape : public ::testing::TestWithParam<WorkloadShape> {};

TEST_P(MixedFleetByShape, TheDefaultLearnsTheSlowWorkersAndMeetsTheGoal) {
  ExpectTheMixedFleetGoal(SyntheticConversations(WorkloadDefaults(GetParam())));
}

INSTANTIATE_TEST_SUITE_P(Workloads, MixedFleetByShape, ::testing::Values(WorkloadShape::kChat, WorkloadShape::kAgentic),
                         [](const ::testing::TestParamInfo<WorkloadShape>& shape) {
                           std::string n = WorkloadName(shape.param);
                           std::erase(n, '-');
                           return n;
                         });


// Disaggregated prefill and decode (docs/protocol.md section 13), issue 48's goal, on the whole
// shared trace at twice and four times its rate, on 4 prefill + 4 decode workers: the default
// policy (predicted) serves at least the SLO goodput of Dynamo's default (always) and of the best
// fixed policy here (isl_or_load), with a TTFT p50 no worse than always's; the prefill pool is not
// herded (its busiest rank within 1.3x its mean busy time); nothing fails and nothing stays booked.
// With `against_aggregated`, also the aggregated fleet of the same 8 workers, and what P/D is for:
// always's ITL p99 at most half the aggregated fleet's.
void ExpectThePdGoal(double rate, const MockEngineConfig& engine = {}, bool against_aggregated = false) {
  if (!std::filesystem::exists(KVROUTER_TRACE)) GTEST_SKIP() << "no trace at " << KVROUTER_TRACE;
  auto trace = ReadMooncakeTrace(KVROUTER_TRACE);
  ASSERT_TRUE(trace.ok()) << trace.status().ToString();
  for (TraceRequest& r : *trace) r.timestamp_ms /= rate;
  // The P/D fleet with `policy`, or (nullptr) the aggregated fleet of the same 8 workers as
  // kvbench --compare runs it.
  auto run = [&](const char* policy) {
    OfflineOptions o{.router_flags = {"--router-mode", "kv"}, .engine = engine};
    if (policy) {
      o.router_flags.insert(o.router_flags.end(), {"--router-disagg-policy", policy,
                                                   "--router-conditional-disagg-prefill-busy-threshold", "4"});
      o.prefill_workers = 4;
    }
    const char* name = policy ? policy : "aggregated";
    auto s = RunOffline(*trace, o);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    if (!s.ok()) return Summary{};
    EXPECT_EQ(s->errors, 0u) << name;
    EXPECT_TRUE(s->bookings_left.has_value() && *s->bookings_left == BookingsLeft{}) << name;
    return *s;
  };
  const Summary ours = run("predicted"), always = run("always"), isl_or_load = run("isl_or_load");
  std::printf("P/D at %.0fx: goodput predicted %.3f, always %.3f, isl_or_load %.3f; TTFT p50 %.0f / %.0f ms\n", rate,
              ours.goodput, always.goodput, isl_or_load.goodput, ours.ttft_p50, always.ttft_p50);
  EXPECT_GE(ours.goodput, always.goodput);
  EXPECT_GE(ours.goodput, isl_or_load.goodput);
  EXPECT_LE(ours.ttft_p50, always.ttft_p50);
  ASSERT_TRUE(ours.prefill_busy_max_over_mean.has_value());
  EXPECT_LE(*ours.prefill_busy_max_over_mean, 1.3);
  ASSERT_TRUE(ours.disagg_decisions.count("disaggregated") && ours.disagg_decisions.count("local"));
  EXPECT_GT(ours.disagg_decisions.at("disaggregated"), 0u);  // it chooses per request, both ways
  EXPECT_GT(ours.disagg_decisions.at("local"), 0u);
  if (!against_aggregated) return;
  const Summary aggregated = run(nullptr);
  ASSERT_TRUE(always.itl_p99.has_value() && aggregated.itl_p99.has_value());
  std::printf("P/D at %.0fx: ITL p99 always %.1f ms, aggregated %.1f ms\n", rate, *always.itl_p99,
              *aggregated.itl_p99);
  EXPECT_LE(*always.itl_p99, 0.5 * *aggregated.itl_p99);
}

// vLLM V1's scheduler as `vllm serve` configures it on GPUs under 70 GiB and on A100s
// (EngineArgs' batch defaults for its OpenAI server): prompts prefilled in chunks, each step's
// budget 2,048 tokens. A long prompt then stretches the gaps of several steps on an aggregated
// engine, which is what its ITL p99 shows; the engine model's default (each prompt whole in one
// step) stretches one gap per prompt, too few for the p99 at this rate. The whole goal is pinned
// on this engine at twice the rate, and on the engine model's default at four times.
constexpr MockEngineConfig kVllmServeChunked{.max_num_batched_tokens = 2048, .chunked_prefill = true};

TEST(Quality, DisaggregatedAtTwiceTheSharedTracesRate) { ExpectThePdGoal(2, kVllmServeChunked, true); }
TEST(Quality, DisaggregatedAtFourTimesTheSharedTracesRate) { ExpectThePdGoal(4); }

}  // namespace
}  // namespace kvrouter::bench
