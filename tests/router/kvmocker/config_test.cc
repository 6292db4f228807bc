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
  EXPECT_FALSE(c.chunked_prefill);
  EXPECT_FALSE(WorkerEngineConfig(c, 0).chunked_prefill);
  EXPECT_EQ(c.speedup_ratio, std::vector<double>{1.0});
  EXPECT_EQ(WorkerEngineConfig(c, 0).speedup_ratio, 1.0);
  EXPECT_EQ(c.event_format, MockEventFormat::kDynamo);
  EXPECT_EQ(c.heartbeat_ms, 1000u);
  EXPECT_EQ(c.lease_ms, 3000u);
  EXPECT_EQ(c.device, "gpu");
  EXPECT_EQ(c.http_port, 0u);
  EXPECT_EQ(c.http_host, "0.0.0.0");
  EXPECT_EQ(c.http_advertise_host, "127.0.0.1");
  EXPECT_EQ(c.model, "mock");
  EXPECT_EQ(c.http_max_body_bytes, 16u << 20);
  EXPECT_EQ(WorkerHttpUrl(c, 0), "");  // the HTTP face is off
  EXPECT_EQ(c.role, WorkerRole::kBoth);
  EXPECT_EQ(c.kv_connector, KvConnector::kNixl);
  EXPECT_EQ(c.bootstrap_port, 8998u);
  const MockEngineConfig e = WorkerEngineConfig(c, 0);
  EXPECT_EQ(e.kv_bytes_per_token, 131072u);
  EXPECT_EQ(e.kv_transfer_gbps, 400.0);
  EXPECT_EQ(e.kv_lease_ms, 30000u);
}

TEST(MockerConfigTest, DisaggFlagsSetTheRoleTheConnectorAndEveryEnginesTransfer) {
  auto p = Parse({"--num-workers", "2", "--role", "prefill", "--kv-connector", "sglang", "--kv-bytes-per-token",
                  "65536", "--kv-transfer-gbps", "12.5", "--kv-lease-ms", "0", "--bootstrap-port", "9100"});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->config.role, WorkerRole::kPrefill);
  EXPECT_EQ(p->config.bootstrap_port, 9100u);
  EXPECT_EQ(p->config.kv_connector, KvConnector::kSglang);
  for (std::uint32_t w = 0; w < 2; ++w) {
    const MockEngineConfig e = WorkerEngineConfig(p->config, w);
    EXPECT_EQ(e.kv_bytes_per_token, 65536u) << w;
    EXPECT_EQ(e.kv_transfer_gbps, 12.5) << w;
    EXPECT_EQ(e.kv_lease_ms, 0u) << w;
  }
  auto env = Parse({}, {{"DYN_ROLE", "decode"}, {"DYN_KV_TRANSFER_GBPS", "100"}});
  ASSERT_TRUE(env.ok()) << env.status().ToString();
  EXPECT_EQ(env->config.role, WorkerRole::kDecode);
  EXPECT_EQ(env->config.kv_transfer_gbps, 100.0);
}

TEST(MockerConfigTest, WorkerIListensOnHttpPortPlusIAndAnnouncesTheAdvertisedHost) {
  auto p = Parse({"--http-port", "8100", "--num-workers", "3", "--model", "llama"});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->config.model, "llama");
  EXPECT_EQ(WorkerHttpUrl(p->config, 0), "http://127.0.0.1:8100");
  EXPECT_EQ(WorkerHttpUrl(p->config, 2), "http://127.0.0.1:8102");

  auto compose = Parse({"--http-port", "8000"}, {{"DYN_HTTP_ADVERTISE_HOST", "mocker-1"}});
  ASSERT_TRUE(compose.ok()) << compose.status().ToString();
  EXPECT_EQ(WorkerHttpUrl(compose->config, 0), "http://mocker-1:8000");

  auto host = Parse({"--http-port", "8000", "--http-host", "10.1.2.3"});
  ASSERT_TRUE(host.ok());
  EXPECT_EQ(host->config.http_advertise_host, "10.1.2.3");  // not a wildcard: itself
  EXPECT_EQ(WorkerHttpUrl(host->config, 0), "http://10.1.2.3:8000");

  auto loopback = Parse({"--http-port", "8000", "--http-host", "127.0.0.1"});
  ASSERT_TRUE(loopback.ok());
  EXPECT_EQ(loopback->config.http_advertise_host, "127.0.0.1");
  auto any6 = Parse({"--http-port", "8000", "--http-host", "::"});
  ASSERT_TRUE(any6.ok());
  EXPECT_EQ(any6->config.http_advertise_host, "127.0.0.1");
  auto v6 = Parse({"--http-port", "8000", "--http-host", "::1"});
  ASSERT_TRUE(v6.ok());
  EXPECT_EQ(WorkerHttpUrl(v6->config, 0), "http://[::1]:8000");

  // The last worker's port is at most 65535.
  auto top = Parse({"--http-port", "65534", "--num-workers", "2"});
  ASSERT_TRUE(top.ok()) << top.status().ToString();
  EXPECT_EQ(WorkerHttpUrl(top->config, 1), "http://127.0.0.1:65535");
}

TEST(MockerConfigTest, ASpeedupRatioListGivesEachWorkerItsOwnEngineSpeed) {
  auto p = Parse({"--num-workers", "4", "--speedup-ratio", "8,8,2,0.5", "--num-gpu-blocks", "512"});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->config.speedup_ratio, (std::vector<double>{8, 8, 2, 0.5}));
  const std::vector<double> expected = {8, 8, 2, 0.5};
  for (std::uint32_t w = 0; w < 4; ++w) {
    const MockEngineConfig e = WorkerEngineConfig(p->config, w);
    EXPECT_EQ(e.speedup_ratio, expected[w]) << w;
    EXPECT_EQ(e.num_gpu_blocks, 512u);  // the other engine flags stay shared
  }
  // The engines' durations follow: worker 3 (0.5) prefills 16 times slower than worker 0 (8).
  EXPECT_DOUBLE_EQ(MockPrefillMs(1000, WorkerEngineConfig(p->config, 3).speedup_ratio),
                   16 * MockPrefillMs(1000, WorkerEngineConfig(p->config, 0).speedup_ratio));

  // Spaces around the items are fine; so is the environment.
  auto spaced = Parse({"--num-workers", "2", "--speedup-ratio", "1, 3"});
  ASSERT_TRUE(spaced.ok()) << spaced.status().ToString();
  EXPECT_EQ(spaced->config.speedup_ratio, (std::vector<double>{1, 3}));
  auto env = Parse({}, {{"DYN_NUM_WORKERS", "3"}, {"DYN_SPEEDUP_RATIO", "1,2,3"}});
  ASSERT_TRUE(env.ok()) << env.status().ToString();
  EXPECT_EQ(WorkerEngineConfig(env->config, 2).speedup_ratio, 3.0);
}

TEST(MockerConfigTest, OneSpeedupRatioAppliesToEveryWorker) {
  auto p = Parse({"--num-workers", "3", "--speedup-ratio", "10"});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->config.speedup_ratio, std::vector<double>{10});
  for (std::uint32_t w = 0; w < 3; ++w) EXPECT_EQ(WorkerEngineConfig(p->config, w).speedup_ratio, 10.0) << w;
}

TEST(MockerConfigTest, EngineReportsEveryTokenOnlyForTheHttpFace) {
  auto nats = Parse({});
  auto http = Parse({"--http-port", "8100"});
  ASSERT_TRUE(nats.ok() && http.ok());
  EXPECT_EQ(WorkerEngineConfig(nats->config, 0).outputs, EngineOutputs::kFirstAndFinish);
  EXPECT_EQ(WorkerEngineConfig(http->config, 0).outputs, EngineOutputs::kEveryToken);
}

TEST(MockerConfigTest, ChunkedPrefillReachesEveryWorkersEngineFromTheFlagOrTheEnvironment) {
  auto p = Parse({"--num-workers", "2", "--chunked-prefill", "--max-num-batched-tokens", "2048"});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  for (std::uint32_t w = 0; w < 2; ++w) {
    const MockEngineConfig e = WorkerEngineConfig(p->config, w);
    EXPECT_TRUE(e.chunked_prefill) << w;
    EXPECT_EQ(e.max_num_batched_tokens, 2048u) << w;
  }
  auto env = Parse({}, {{"DYN_CHUNKED_PREFILL", "true"}});
  ASSERT_TRUE(env.ok()) << env.status().ToString();
  EXPECT_TRUE(WorkerEngineConfig(env->config, 0).chunked_prefill);
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
      {{"--speedup-ratio", "inf"}, "--speedup-ratio"},
      {{"--speedup-ratio", "nan"}, "--speedup-ratio"},
      {{"--num-workers", "3", "--speedup-ratio", "1,2"}, "--speedup-ratio"},
      {{"--num-workers", "2", "--speedup-ratio", "1,2,3"}, "--speedup-ratio"},
      {{"--num-workers", "2", "--speedup-ratio", "1,-2"}, "--speedup-ratio"},
      {{"--num-workers", "2", "--speedup-ratio", "1,0"}, "--speedup-ratio"},
      {{"--num-workers", "2", "--speedup-ratio", "1,"}, "--speedup-ratio"},
      {{"--num-workers", "3", "--speedup-ratio", "1,,2"}, "--speedup-ratio"},
      {{"--num-workers", "2", "--speedup-ratio", "1;2"}, "--speedup-ratio"},
      {{"--num-workers", "2", "--speedup-ratio", "2x,1"}, "--speedup-ratio"},
      {{"--event-format", "kafka"}, "--event-format"},
      {{"--heartbeat-ms", "1000", "--lease-ms", "1000"}, "--lease-ms"},
      {{"--num-workers", "64", "--dp-size", "32"}, "--dp-size"},
      {{"--num-workers", "2", "--worker-id-base", "18446744073709551615"}, "--worker-id-base"},
      {{"--worker-id-base", "12x"}, "--worker-id-base"},
      {{"--max-num-seqs", "many"}, "--max-num-seqs"},
      {{"--no-such-flag"}, "--no-such-flag"},
      {{"--http-port", "65536"}, "--http-port"},
      {{"--http-port", "65535", "--num-workers", "2"}, "--http-port"},
      {{"--http-port", "-1"}, "--http-port"},
      {{"--http-host", ""}, "--http-host"},
      {{"--http-advertise-host", "http://x"}, "--http-advertise-host"},
      {{"--http-advertise-host", "x:80"}, "--http-advertise-host"},
      {{"--http-advertise-host", ""}, "--http-advertise-host"},
      {{"--http-max-body-bytes", "0"}, "--http-max-body-bytes"},
      {{"--model", ""}, "--model"},
      {{"--model", std::string(257, 'm')}, "--model"},
      {{"--role", "router"}, "--role"},
      {{"--role", "Prefill"}, "--role"},
      {{"--kv-connector", "mooncake"}, "--kv-connector"},
      {{"--kv-bytes-per-token", "0"}, "--kv-bytes-per-token"},
      {{"--kv-transfer-gbps", "0"}, "--kv-transfer-gbps"},
      {{"--kv-transfer-gbps", "-5"}, "--kv-transfer-gbps"},
      {{"--kv-transfer-gbps", "inf"}, "--kv-transfer-gbps"},
      {{"--kv-transfer-gbps", "nan"}, "--kv-transfer-gbps"},
      {{"--kv-lease-ms", "-1"}, "--kv-lease-ms"},
      {{"--kv-lease-ms", "4294967296"}, "--kv-lease-ms"},
      {{"--bootstrap-port", "0"}, "--bootstrap-port"},
      {{"--bootstrap-port", "65536"}, "--bootstrap-port"},
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
