#include "router/kvmocker/config.h"

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace kvrouter {
namespace {

Result<ParsedMockerArgs> Parse(std::vector<std::string> args, std::map<std::string, std::string> env = {}) {
  args.insert(args.begin(), "kvmocker");
  std::vector<const char*> argv;
  for (auto& a : args) argv.push_back(a.c_str());
  return ParseMockerConfig(static_cast<int>(argv.size()), argv.data(), [&](const char* name) {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

TEST(MockerConfigTest, DefaultsMatchTheDesign) {
  auto p = Parse({});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  const MockerConfig& c = p->config;
  EXPECT_EQ(c.nats_server, "nats://127.0.0.1:4222");
  EXPECT_EQ(c.ns, "dynamo");
  EXPECT_EQ(c.component, "backend");
  EXPECT_EQ(c.num_workers, 1u);
  EXPECT_FALSE(c.worker_id_base.has_value());
  EXPECT_EQ(c.dp_size, 1u);
  EXPECT_EQ(c.num_gpu_blocks, 16384u);
  EXPECT_EQ(c.block_size, 64u);
  EXPECT_EQ(c.max_num_seqs, 256u);
  EXPECT_EQ(c.max_num_batched_tokens, 8192u);
  EXPECT_EQ(c.speedup_ratio, 1.0);
  EXPECT_EQ(c.event_format, MockEventFormat::kDynamo);
  EXPECT_EQ(c.heartbeat_ms, 1000u);
  EXPECT_EQ(c.lease_ms, 3000u);
  EXPECT_EQ(c.device, "gpu");
}

TEST(MockerConfigTest, EnvironmentFillsFlagsAndTheCommandLineWins) {
  auto p = Parse({"--num-workers", "3"}, {{"DYN_NUM_WORKERS", "5"},
                                          {"DYN_EVENT_FORMAT", "vllm"},
                                          {"DYN_WORKER_ID_BASE", "18446744073709551613"},
                                          {"NATS_SERVER", "nats://h:1"}});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->config.num_workers, 3u);
  EXPECT_EQ(p->config.event_format, MockEventFormat::kVllm);
  EXPECT_EQ(p->config.worker_id_base, 18446744073709551613ull);  // + 2 workers = u64 max
  EXPECT_EQ(p->config.nats_server, "nats://h:1");
}

TEST(MockerConfigTest, BadValuesAreRefusedNamingTheFlag) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--num-workers", "0"}, "--num-workers"},
      {{"--num-gpu-blocks", "-1"}, "--num-gpu-blocks"},
      {{"--block-size", "65537"}, "--block-size"},
      {{"--speedup-ratio", "0"}, "--speedup-ratio"},
      {{"--event-format", "kafka"}, "--event-format"},
      {{"--heartbeat-ms", "1000", "--lease-ms", "1000"}, "--lease-ms"},
      {{"--num-workers", "64", "--dp-size", "32"}, "--dp-size"},
      {{"--num-workers", "2", "--worker-id-base", "18446744073709551615"}, "--worker-id-base"},
      {{"--worker-id-base", "12x"}, "--worker-id-base"},
      {{"--max-num-seqs", "many"}, "--max-num-seqs"},
      {{"--no-such-flag"}, "--no-such-flag"},
  };
  for (const auto& [args, flag] : cases) {
    auto p = Parse(args);
    ASSERT_FALSE(p.ok()) << args[0];
    EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(p.status().message().find(flag), std::string::npos) << p.status().message();
  }
  auto env = Parse({}, {{"DYN_SPEEDUP_RATIO", "fast"}});
  ASSERT_FALSE(env.ok());
  EXPECT_NE(env.status().message().find("DYN_SPEEDUP_RATIO"), std::string::npos);
}

}  // namespace
}  // namespace kvrouter
