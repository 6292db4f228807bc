#include "router/kvbench/config.h"

#include <gtest/gtest.h>

#include <map>

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
    ASSERT_GE(r.router_flags.size(), 2u);
    EXPECT_EQ(r.router_flags[r.router_flags.size() - 2], "--router-prefill-load-scale");
    EXPECT_EQ(r.router_flags.back(), "16");
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
