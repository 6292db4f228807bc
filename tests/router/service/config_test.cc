#include "router/service/config.h"

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

namespace kvrouter {
namespace {

struct Args {
  std::vector<std::string> argv;
  std::map<std::string, std::string> env;

  Result<ParsedArgs> Parse() const {
    std::vector<const char*> a = {"kvrouter"};
    for (auto& s : argv) a.push_back(s.c_str());
    return ParseRouterConfig(static_cast<int>(a.size()), a.data(), [this](const char* name) -> const char* {
      auto it = env.find(name);
      return it == env.end() ? nullptr : it->second.c_str();
    });
  }
};

TEST(RouterConfig, DefaultsMatchDynamo) {
  auto r = Args{}.Parse();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const RouterConfig& c = r->config;
  EXPECT_EQ(c.nats_server, "nats://127.0.0.1:4222");
  EXPECT_EQ(c.ns, "dynamo");
  EXPECT_EQ(c.component, "backend");
  EXPECT_EQ(c.block_size, 64u);
  EXPECT_EQ(c.mode, RouterMode::kRoundRobin);
  EXPECT_EQ(c.overlap_score_credit, 1.0);
  EXPECT_EQ(c.prefill_load_scale, 1.0);
  EXPECT_TRUE(c.use_kv_events);
  EXPECT_TRUE(c.track_prefill_tokens);
  EXPECT_EQ(c.temperature, 0.0);
  EXPECT_FALSE(c.queue_threshold.has_value());
  EXPECT_EQ(c.queue_policy, QueuePolicy::kFcfs);
  EXPECT_EQ(c.queue_max, 10000u);
  EXPECT_EQ(c.ttl_secs, 120.0);
  EXPECT_EQ(c.max_tree_size, 1048576u);
  EXPECT_EQ(c.prune_target_ratio, 0.8);
  EXPECT_EQ(c.device_ratio, 8.0);
  EXPECT_EQ(c.host_cache_hit_weight, 0.75);
  EXPECT_EQ(c.disk_cache_hit_weight, 0.25);
  EXPECT_EQ(SchedulerOptionsOf(c).cost.host_weight, 0.75);
  EXPECT_EQ(SchedulerOptionsOf(c).cost.disk_weight, 0.25);
}

TEST(RouterConfig, FlagsAreParsed) {
  auto r =
      Args{{"--router-mode", "kv", "--block-size=16", "--router-temperature", "0.5", "--no-router-kv-events",
            "--router-queue-threshold", "1.5", "--router-queue-policy", "wspt", "--no-router-track-prefill-tokens"}}
          .Parse();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->config.mode, RouterMode::kKv);
  EXPECT_EQ(r->config.block_size, 16u);
  EXPECT_EQ(r->config.temperature, 0.5);
  EXPECT_FALSE(r->config.use_kv_events);
  EXPECT_EQ(r->config.queue_threshold, 1.5);
  EXPECT_EQ(r->config.queue_policy, QueuePolicy::kWspt);
  EXPECT_FALSE(r->config.track_prefill_tokens);
}

// Section 13's flags: our policy, Dynamo's conditional switch and thresholds (the prefill busy
// threshold inherits the queue threshold), the fallback and the transfer's prior.
TEST(RouterConfig, DisaggregationFlagsAreParsedWithDynamosDefaults) {
  auto d = Args{}.Parse();
  ASSERT_TRUE(d.ok());
  const DisaggOptions& o = d->config.disagg;
  EXPECT_EQ(o.policy, DisaggPolicy::kPredicted);
  EXPECT_TRUE(o.decode_fallback);
  EXPECT_EQ(o.eff_isl_threshold, 2048);
  EXPECT_EQ(o.eff_isl_ratio_threshold, 0.7);
  EXPECT_FALSE(o.prefill_busy_threshold.has_value());
  EXPECT_EQ(o.kv_bytes_per_token, 131072);
  EXPECT_EQ(o.kv_transfer_gbps, 400);
  auto r = Args{{"--router-disagg-policy", "isl_or_load", "--router-queue-threshold", "2",
                 "--router-decode-fallback", "false", "--router-kv-transfer-gbps", "100",
                 "--router-conditional-disagg-eff-isl-threshold", "512"}}
               .Parse();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->config.disagg.policy, DisaggPolicy::kIslOrLoad);
  EXPECT_EQ(r->config.disagg.prefill_busy_threshold, 2.0);
  EXPECT_FALSE(r->config.disagg.decode_fallback);
  EXPECT_EQ(r->config.disagg.kv_transfer_gbps, 100);
  EXPECT_EQ(r->config.disagg.eff_isl_threshold, 512);
  auto dynamo = Args{{"--router-conditional-disagg"}}.Parse();
  ASSERT_TRUE(dynamo.ok());
  EXPECT_EQ(dynamo->config.disagg.policy, DisaggPolicy::kIslBounding);
  for (std::vector<std::string> bad : {std::vector<std::string>{"--router-disagg-policy", "sometimes"},
                                       {"--router-disagg-policy", "prefill_load"},  // no threshold at all
                                       {"--router-conditional-disagg", "--router-conditional-disagg-policy", "always"},
                                       {"--router-conditional-disagg-eff-isl-ratio-threshold", "1.5"},
                                       {"--router-decode-fallback", "maybe"},
                                       {"--router-kv-bytes-per-token", "0"}}) {
    auto refused = Args{bad}.Parse();
    ASSERT_FALSE(refused.ok()) << bad[0];
    EXPECT_NE(refused.status().message().find("router-"), std::string::npos) << refused.status().message();
  }
}

TEST(RouterConfig, EnvironmentFillsFlagsNotGivenOnTheCommandLine) {
  auto r = Args{{"--namespace", "cli"},
                {{"DYN_ROUTER_MODE", "least-loaded"},
                 {"NATS_SERVER", "nats://10.0.0.1:4222"},
                 {"DYN_NAMESPACE", "env"},
                 {"DYN_ROUTER_QUEUE_THRESHOLD", "2"},
                 {"DYN_ROUTER_USE_KV_EVENTS", "false"},
                 {"DYN_ROUTER_TRACK_PREFILL_TOKENS", "false"}}}
               .Parse();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->config.mode, RouterMode::kLeastLoaded);
  EXPECT_EQ(r->config.nats_server, "nats://10.0.0.1:4222");
  EXPECT_EQ(r->config.ns, "cli");  // the command line wins
  EXPECT_EQ(r->config.queue_threshold, 2.0);
  EXPECT_FALSE(r->config.use_kv_events);
  EXPECT_FALSE(r->config.track_prefill_tokens);
}

TEST(RouterConfig, LoadAwareMeansKvCostWithoutCreditOrEvents) {
  auto r = Args{{"--load-aware"}}.Parse();
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->config.mode, RouterMode::kKv);
  EXPECT_EQ(r->config.cost_model, CostModel::kKvBlocks);
  EXPECT_EQ(r->config.overlap_score_credit, 0.0);
  EXPECT_FALSE(r->config.use_kv_events);
}

// The predicted cost is the default; either of Dynamo's weights, given by flag or environment
// (even at its default value), selects Dynamo's formula with exactly that value.
TEST(RouterConfig, DynamosWeightsSetExplicitlySelectDynamosFormula) {
  struct Case {
    const char* name;
    Args args;
    CostModel want;
    double credit, scale;
  };
  const std::vector<Case> cases = {
      {"nothing set", Args{{"--router-mode", "kv"}}, CostModel::kPredicted, 1.0, 1.0},
      {"scale flag at its default", Args{{"--router-prefill-load-scale", "1"}}, CostModel::kKvBlocks, 1.0, 1.0},
      {"credit flag", Args{{"--router-kv-overlap-score-credit=0.5"}}, CostModel::kKvBlocks, 0.5, 1.0},
      {"scale from the environment", Args{{}, {{"DYN_ROUTER_PREFILL_LOAD_SCALE", "16"}}}, CostModel::kKvBlocks, 1.0,
       16.0},
      {"credit from the environment", Args{{}, {{"DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT", "2"}}}, CostModel::kKvBlocks,
       2.0, 1.0},
      {"an unrelated flag", Args{{"--router-temperature", "0.5"}}, CostModel::kPredicted, 1.0, 1.0},
  };
  for (const Case& k : cases) {
    auto r = k.args.Parse();
    ASSERT_TRUE(r.ok()) << k.name << ": " << r.status().ToString();
    EXPECT_EQ(r->config.cost_model, k.want) << k.name;
    EXPECT_EQ(r->config.overlap_score_credit, k.credit) << k.name;
    EXPECT_EQ(r->config.prefill_load_scale, k.scale) << k.name;
  }
}

TEST(RouterConfig, BadValuesAreRefusedNamingTheFlag) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--router-mode", "fastest"}, "--router-mode"},
      {{"--block-size", "0"}, "--block-size"},
      {{"--router-temperature", "-1"}, "--router-temperature"},
      {{"--router-kv-overlap-score-credit", "-0.5"}, "--router-kv-overlap-score-credit"},
      {{"--router-queue-threshold", "0"}, "--router-queue-threshold"},
      {{"--router-queue-policy", "sjf"}, "--router-queue-policy"},
      {{"--router-prune-target-ratio", "1.5"}, "--router-prune-target-ratio"},
      {{"--router-ttl-secs", "0"}, "--router-ttl-secs"},
      {{"--device-ratio", "0"}, "--device-ratio"},
      {{"--router-host-cache-hit-weight", "1.5"}, "--router-host-cache-hit-weight"},
      {{"--router-disk-cache-hit-weight", "-0.1"}, "--router-disk-cache-hit-weight"},
      {{"--router-index-shards", "0"}, "--router-index-shards"},
      {{"--block-size", "abc"}, "block-size"},
      {{"--no-such-flag"}, "no-such-flag"},
  };
  for (const auto& [argv, flag] : cases) {
    auto r = Args{argv}.Parse();
    ASSERT_FALSE(r.ok()) << argv[0];
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(flag), std::string::npos) << r.status().message();
  }
  auto env = Args{{}, {{"DYN_ROUTER_MODE", "fastest"}}}.Parse();
  EXPECT_FALSE(env.ok());
  auto bad_bool = Args{{}, {{"DYN_ROUTER_USE_KV_EVENTS", "maybe"}}}.Parse();
  ASSERT_FALSE(bad_bool.ok());
  EXPECT_NE(bad_bool.status().message().find("DYN_ROUTER_USE_KV_EVENTS"), std::string::npos);
}

TEST(RouterConfig, NegativeValuesOfUnsignedFlagsAreRefused) {
  // Boost alone would wrap -1 to 4294967295.
  for (const auto& argv : std::vector<std::vector<std::string>>{{"--router-queue-max=-1"},
                                                                {"--router-queue-max", "-1"},
                                                                {"--router-max-active-blocks=-5"},
                                                                {"--block-size=-64"}}) {
    auto r = Args{argv}.Parse();
    ASSERT_FALSE(r.ok()) << argv[0];
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find("non-negative"), std::string::npos) << r.status().message();
  }
  auto env = Args{{}, {{"DYN_ROUTER_QUEUE_MAX", "-1"}}}.Parse();
  ASSERT_FALSE(env.ok());
  EXPECT_NE(env.status().message().find("DYN_ROUTER_QUEUE_MAX"), std::string::npos) << env.status().message();
  auto fine = Args{{"--router-queue-max=7"}}.Parse();
  ASSERT_TRUE(fine.ok());
  EXPECT_EQ(fine->config.queue_max, 7u);
}

TEST(RouterConfig, HelpListsEveryFlagWithDefaults) {
  auto r = Args{{"--help"}}.Parse();
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->help);
  for (const char* flag : {"--nats-server", "--router-mode", "--router-queue-threshold", "--no-router-kv-events",
                           "--router-ttl-secs", "--device-ratio"}) {
    EXPECT_NE(r->help_text.find(flag), std::string::npos) << flag;
  }
  EXPECT_NE(r->help_text.find("round-robin"), std::string::npos);
}

}  // namespace
}  // namespace kvrouter
