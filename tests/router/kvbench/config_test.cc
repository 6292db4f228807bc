#include "router/kvbench/config.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>

namespace kvrouter::bench {
namespace {

Result<ParsedBenchArgs> Parse(std::vector<std::string> args, std::map<std::string, std::string> env = {}) {
  std::vector<const char*> argv = {"kvbench"};
  for (const auto& a : args) argv.push_back(a.c_str());
  return ParseBenchConfig(static_cast<int>(argv.size()), argv.data(), [env](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

TEST(BenchConfig, EnvironmentFillsFlagsAndTheCommandLineWins) {
  auto c = Parse({"--synthetic", "--concurrency", "8"},
                 {{"NATS_SERVER", "nats://10.0.0.1:4222"}, {"DYN_CONCURRENCY", "99"}, {"DYN_SESSIONS", "7"}});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->config.online.nats_url, "nats://10.0.0.1:4222");
  EXPECT_EQ(c->config.online.concurrency, 8u);
  EXPECT_EQ(c->config.synthetic.sessions, 7u);
}

TEST(BenchConfig, BadValuesAreRefusedNamingTheFlag) {
  for (const auto& [args, flag] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--synthetic", "--concurrency=-1"}, "concurrency"},
           {{"--synthetic", "--max-requests=-5"}, "max-requests"},
           {{"--synthetic", "--speedup", "0"}, "speedup"},
           {{"--synthetic", "--compare"}, "--offline"},
           {{"--synthetic", "--speedup-ratio", "inf"}, "--speedup-ratio"},
           {{"--synthetic", "--workers", "4", "--worker-speedups", "1,1"}, "--worker-speedups"},
           {{"--synthetic", "--worker-speedups", "1"}, "--worker-speedups"},  // 8 workers by default
           {{"--synthetic", "--workers", "2", "--worker-speedups", "1,0"}, "--worker-speedups"},
           {{"--synthetic", "--workers", "2", "--worker-speedups", "1,-0.5"}, "--worker-speedups"},
           {{"--synthetic", "--workers", "2", "--worker-speedups", "1,nan"}, "--worker-speedups"},
           {{"--synthetic", "--workers", "2", "--worker-speedups", "1,,"}, "--worker-speedups"},
           {{"--synthetic", "--workers", "2", "--worker-speedups", "fast,1"}, "--worker-speedups"},
           {{"--offline", "--synthetic", "--workers", "4", "--prefill-workers", "4"}, "--prefill-workers"},
           {{"--offline", "--synthetic", "--workers", "4", "--prefill-workers", "9"}, "--prefill-workers"},
           {{"--synthetic", "--prefill-workers", "2"}, "--wait-workers"},  // online: the fleet to check
           {{"--synthetic", "--prefill-workers", "2", "--wait-workers", "2"}, "--prefill-workers"},
           {{"--synthetic", "--slo-ttft-ms", "0"}, "--slo-ttft-ms"},
           {{"--synthetic", "--slo-tpot-ms", "-1"}, "--slo-tpot-ms"},
           {{"--synthetic", "--slo-tpot-ms", "inf"}, "--slo-tpot-ms"},
           {{"--offline", "--synthetic", "--prefill-workers", "2", "--compare", "--router-disagg-policy", "never"},
            "--router-disagg-policy"},
           {{"--synthetic", "--abort-fraction", "0.1"}, "--gateway"},  // NATS clients cannot go away
           {{"--synthetic", "--gateway", "http://127.0.0.1:1", "--abort-fraction", "1"}, "--abort-fraction"},
           {{"--synthetic", "--gateway", "http://127.0.0.1:1", "--abort-fraction", "-0.1"}, "--abort-fraction"},
           {{"--offline", "--synthetic", "--gateway", "http://127.0.0.1:1"}, "--gateway"},
           {{"--synthetic", "--gateway", "http://127.0.0.1:1", "--retries", "2"}, "--retries"},
           {{}, "--trace"}}) {
    auto c = Parse(args);
    ASSERT_FALSE(c.ok()) << args.size();
    EXPECT_EQ(c.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(c.status().message().find(flag), std::string::npos) << c.status().message();
  }
}

TEST(BenchConfig, WorkerSpeedupsGiveEachOfflineWorkerItsSpeed) {
  auto c = Parse(
      {"--offline", "--synthetic", "--workers", "4", "--speedup-ratio", "2", "--worker-speedups", "1,1,0.25,0.25"});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->config.offline_base.engine.speedup_ratio, 2.0);
  EXPECT_EQ(c->config.offline_base.worker_speedups, (std::vector<double>{1, 1, 0.25, 0.25}));
  auto env = Parse({"--offline", "--synthetic"}, {{"DYN_WORKERS", "2"}, {"DYN_WORKER_SPEEDUPS", "3,1"}});
  ASSERT_TRUE(env.ok()) << env.status().ToString();
  EXPECT_EQ(env->config.offline_base.worker_speedups, (std::vector<double>{3, 1}));
  auto none = Parse({"--offline", "--synthetic"});
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->config.offline_base.worker_speedups.empty());  // every worker at --speedup-ratio
}

TEST(BenchConfig, ChunkedPrefillReachesTheOfflineEngines) {
  auto on = Parse({"--offline", "--synthetic", "--chunked-prefill"});
  ASSERT_TRUE(on.ok()) << on.status().ToString();
  EXPECT_TRUE(on->config.offline_base.engine.chunked_prefill);
  auto off = Parse({"--offline", "--synthetic"});
  ASSERT_TRUE(off.ok());
  EXPECT_FALSE(off->config.offline_base.engine.chunked_prefill);
}

TEST(BenchConfig, CompareRunsFiveModesWithTheTuningFlags) {
  auto c = Parse({"--offline", "--synthetic", "--compare", "--router-prefill-load-scale", "16"});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  ASSERT_EQ(c->config.runs.size(), 5u);
  EXPECT_EQ(c->config.runs[0].label, "kv (default)");
  EXPECT_EQ(c->config.runs[1].label, "kv, Dynamo's cost");
  EXPECT_EQ(c->config.runs[4].label, "kv-approx");
  for (const BenchRun& r : c->config.runs) {
    EXPECT_EQ(r.prefill_workers, 0u);  // the aggregated fleet
    ASSERT_GE(r.router_flags.size(), 2u);
    EXPECT_EQ(r.router_flags[r.router_flags.size() - 2], "--router-prefill-load-scale");
    EXPECT_EQ(r.router_flags.back(), "16");
  }
}

TEST(BenchConfig, PrefillWorkersMakeAPdFleetOfTheFirstWorkers) {
  auto c = Parse({"--offline", "--synthetic", "--workers", "8", "--prefill-workers", "3", "--router-disagg-policy",
                  "always", "--slo-ttft-ms", "500", "--slo-tpot-ms", "20"});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->config.offline_base.prefill_workers, 3u);
  ASSERT_EQ(c->config.runs.size(), 1u);
  const BenchRun& run = c->config.runs[0];
  EXPECT_EQ(run.prefill_workers, 3u);
  EXPECT_EQ(run.label, "kv always");
  EXPECT_EQ(run.router_flags, (std::vector<std::string>{"--router-mode", "kv", "--router-disagg-policy", "always"}));
  EXPECT_EQ(c->config.offline_base.slo.ttft_ms, 500);
  EXPECT_EQ(c->config.offline_base.slo.tpot_ms, 20);
  EXPECT_EQ(c->config.online.slo.tpot_ms, 20);

  // Online, the count is checked against the fleet kvbench waits for.
  auto online = Parse({"--synthetic", "--wait-workers", "8", "--prefill-workers", "4"});
  ASSERT_TRUE(online.ok()) << online.status().ToString();
  EXPECT_EQ(online->config.online.prefill_workers, 4u);

  // The defaults: an aggregated fleet, and goodput at 1,000 ms TTFT and 50 ms TPOT.
  auto plain = Parse({"--offline", "--synthetic"});
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->config.offline_base.prefill_workers, 0u);
  EXPECT_EQ(plain->config.runs.at(0).prefill_workers, 0u);
  EXPECT_EQ(plain->config.offline_base.slo.ttft_ms, 1000);
  EXPECT_EQ(plain->config.offline_base.slo.tpot_ms, 50);
}

TEST(BenchConfig, CompareWithPrefillWorkersRunsEveryPolicyThenTheAggregatedFleet) {
  auto c = Parse({"--offline", "--synthetic", "--compare", "--workers", "8", "--prefill-workers", "4",
                  "--router-prefill-load-scale", "16"});
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  const auto& runs = c->config.runs;
  ASSERT_EQ(runs.size(), std::size(kDisaggPolicies) + 1);
  for (std::size_t k = 0; k < std::size(kDisaggPolicies); ++k) {
    EXPECT_EQ(runs[k].prefill_workers, 4u) << k;
    EXPECT_NE(runs[k].label.find(kDisaggPolicies[k]), std::string::npos) << runs[k].label;
    const std::vector<std::string> head(runs[k].router_flags.begin(), runs[k].router_flags.begin() + 4);
    EXPECT_EQ(head, (std::vector<std::string>{"--router-mode", "kv", "--router-disagg-policy", kDisaggPolicies[k]}));
  }
  EXPECT_EQ(runs[0].label, "P/D predicted (default)");
  EXPECT_EQ(runs.back().label, "aggregated");
  EXPECT_EQ(runs.back().prefill_workers, 0u);
  EXPECT_EQ(runs.back().router_flags,
            (std::vector<std::string>{"--router-mode", "kv", "--router-prefill-load-scale", "16"}));
  std::set<std::string> policies;
  for (const BenchRun& r : runs) {
    std::map<std::string, std::string> flags;
    for (std::size_t f = 0; f + 1 < r.router_flags.size(); f += 2) flags[r.router_flags[f]] = r.router_flags[f + 1];
    EXPECT_EQ(flags["--router-prefill-load-scale"], "16") << r.label;  // the tuning flags go to every run
    const std::string policy = flags["--router-disagg-policy"];
    if (!policy.empty()) policies.insert(policy);
    // The policies that read a prefill busy threshold get Dynamo's default queue threshold.
    const bool reads_load = policy == "prefill_load" || policy == "isl_or_load";
    EXPECT_EQ(flags["--router-conditional-disagg-prefill-busy-threshold"], reads_load ? "4" : "") << r.label;
  }
  EXPECT_EQ(policies,
            (std::set<std::string>{"predicted", "always", "never", "isl_bounding", "prefill_load", "isl_or_load"}));

  // A threshold given is theirs instead.
  for (const char* flag : {"--router-queue-threshold", "--router-conditional-disagg-prefill-busy-threshold"}) {
    auto given = Parse({"--offline", "--synthetic", "--compare", "--prefill-workers", "4", flag, "2"});
    ASSERT_TRUE(given.ok()) << given.status().ToString();
    for (const BenchRun& r : given->config.runs) {
      EXPECT_EQ(std::count(r.router_flags.begin(), r.router_flags.end(), "2"), 1) << r.label;
      EXPECT_EQ(std::count(r.router_flags.begin(), r.router_flags.end(), "4"), 0) << r.label;
    }
  }
}

TEST(BenchConfig, AWorkloadShapeBringsItsDefaultsAndExplicitFlagsWin) {
  auto agentic = Parse({"--workload", "agentic"});
  ASSERT_TRUE(agentic.ok()) << agentic.status().ToString();
  EXPECT_EQ(agentic->config.synthetic.shape, WorkloadShape::kAgentic);
  EXPECT_EQ(agentic->config.synthetic.sessions, WorkloadDefaults(WorkloadShape::kAgentic).sessions);
  EXPECT_EQ(agentic->config.workload_name, "synthetic agentic");
  auto fewer = Parse({"--workload", "agentic", "--sessions", "3", "--plot", "out.svg"});
  ASSERT_TRUE(fewer.ok());
  EXPECT_EQ(fewer->config.synthetic.sessions, 3u);
  EXPECT_EQ(fewer->config.synthetic.turns, WorkloadDefaults(WorkloadShape::kAgentic).turns);
  EXPECT_EQ(fewer->config.plot_path, "out.svg");
  for (const auto& args :
       std::vector<std::vector<std::string>>{{"--workload", "poisson"}, {"--trace", "t.jsonl", "--workload", "chat"}}) {
    auto bad = Parse(args);
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find("workload"), std::string::npos) << bad.status().message();
  }
}

TEST(BenchConfig, WorkloadIsCutAndTimeCompressed) {
  auto c = Parse({"--synthetic", "--sessions", "10", "--max-requests", "5", "--speedup", "2"});
  ASSERT_TRUE(c.ok());
  auto slow = Parse({"--synthetic", "--sessions", "10", "--max-requests", "5"});
  auto fast = LoadWorkload(c->config);
  auto plain = LoadWorkload(slow->config);
  ASSERT_TRUE(fast.ok() && plain.ok());
  ASSERT_EQ(fast->size(), 5u);
  EXPECT_DOUBLE_EQ(fast->back().timestamp_ms * 2, plain->back().timestamp_ms);
}

}  // namespace
}  // namespace kvrouter::bench
