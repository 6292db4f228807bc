// kvrelay's flags (router/kvrelay/config.cc): what is required, the engine's URL and models, and
// the refusals that name their flag.
#include "router/kvrelay/config.h"

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace kvrouter {
namespace {

// kvrelay with the required flags, then `args`.
Result<ParsedRelayArgs> Parse(std::vector<std::string> args, std::map<std::string, std::string> env = {}) {
  args.insert(args.begin(),
              {"kvrelay", "--zmq-endpoint", "tcp://127.0.0.1:5557", "--worker-id", "7", "--block-size", "16"});
  std::vector<const char*> argv;
  for (auto& a : args) argv.push_back(a.c_str());
  return ParseRelayConfig(static_cast<int>(argv.size()), argv.data(), [&](const char* name) {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

// The refusal's message, or "" when the flags were accepted.
std::string Refusal(std::vector<std::string> args) {
  auto p = Parse(std::move(args));
  if (p.ok()) return "";
  EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
  return p.status().message();
}

TEST(RelayConfigTest, WithoutAnEngineUrlNothingIsAnnounced) {
  auto p = Parse({});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->config.relay.http_url, "");
  EXPECT_TRUE(p->config.relay.models.empty());
  EXPECT_EQ(p->config.relay.worker_id, 7u);
  EXPECT_EQ(p->config.relay.block_size, 16u);
}

TEST(RelayConfigTest, EngineUrlAndRepeatedOrCommaSeparatedModels) {
  auto p = Parse(
      {"--engine-url", "http://10.0.0.5:8001/", "--model", "llama, qwen", "--model", "mistral", "--model", "llama"});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->config.relay.http_url, "http://10.0.0.5:8001");  // the trailing slash dropped
  EXPECT_EQ(p->config.relay.models, (std::vector<std::string>{"llama", "qwen", "mistral"}));  // each once
}

// Section 13's flags, with their defaults and refusals.
TEST(RelayConfigTest, RoleConnectorAndBootstrapPort) {
  auto d = Parse({});
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->config.relay.role, WorkerRole::kBoth);
  EXPECT_EQ(d->config.relay.kv_connector, KvConnector::kNixl);
  EXPECT_EQ(d->config.relay.bootstrap_port, 8998u);
  auto p = Parse({"--role", "decode", "--kv-connector", "sglang", "--bootstrap-port", "9000"});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->config.relay.role, WorkerRole::kDecode);
  EXPECT_EQ(p->config.relay.kv_connector, KvConnector::kSglang);
  EXPECT_EQ(p->config.relay.bootstrap_port, 9000u);
  auto env = Parse({}, {{"DYN_ROLE", "prefill"}});
  ASSERT_TRUE(env.ok());
  EXPECT_EQ(env->config.relay.role, WorkerRole::kPrefill);
  EXPECT_NE(Refusal({"--role", "mixed"}).find("--role must be both | prefill | decode"), std::string::npos)
      << Refusal({"--role", "mixed"});
  EXPECT_NE(Refusal({"--kv-connector", "mooncake"}).find("--kv-connector"), std::string::npos);
  EXPECT_NE(Refusal({"--bootstrap-port", "70000"}).find("--bootstrap-port"), std::string::npos);
}

TEST(RelayConfigTest, EngineUrlAndModelsFromTheEnvironment) {
  auto p = Parse({}, {{"DYN_ENGINE_URL", "http://engine:8000"}, {"DYN_MODEL", "a,b"}});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->config.relay.http_url, "http://engine:8000");
  EXPECT_EQ(p->config.relay.models, (std::vector<std::string>{"a", "b"}));
}

TEST(RelayConfigTest, ABadEngineUrlIsRefusedNamingTheFlag) {
  for (const char* url : {"https://engine:8000", "engine:8000", "http://engine:8000/v1", "http://:8000",
                          "http://engine:99999", "http://engine:port"}) {
    EXPECT_NE(Refusal({"--engine-url", url, "--model", "m"}).find("--engine-url"), std::string::npos) << url;
  }
  EXPECT_NE(Refusal({"--engine-url", "http://" + std::string(2100, 'h') + ":80", "--model", "m"}).find("--engine-url"),
            std::string::npos);
}

TEST(RelayConfigTest, EngineUrlAndModelGoTogether) {
  EXPECT_NE(Refusal({"--engine-url", "http://127.0.0.1:8001"}).find("--model"), std::string::npos);
  EXPECT_NE(Refusal({"--model", "m"}).find("--engine-url"), std::string::npos);
}

TEST(RelayConfigTest, AnEngineUrlWatchesTheEngineWithTheDefaults) {
  auto p = Parse({"--engine-url", "http://127.0.0.1:8001", "--model", "m"});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->config.relay.register_when, RegisterWhen::kEngineUp);
  EXPECT_EQ(p->config.health.interval, std::chrono::milliseconds(1000));
  EXPECT_EQ(p->config.health.timeout, std::chrono::milliseconds(1000));
  EXPECT_EQ(p->config.health.failures, 2u);
  auto plain = Parse({});
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->config.relay.register_when, RegisterWhen::kAtStart);  // nothing changes without it
}

TEST(RelayConfigTest, HealthFlagsAndTheTimeoutFollowingTheInterval) {
  auto p = Parse({"--engine-url", "http://127.0.0.1:8001", "--model", "m", "--health-interval-ms", "250",
                  "--health-failures", "3"});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->config.health.interval, std::chrono::milliseconds(250));
  EXPECT_EQ(p->config.health.timeout, std::chrono::milliseconds(250));  // = the interval unless given
  EXPECT_EQ(p->config.health.failures, 3u);
  auto t = Parse({"--engine-url", "http://127.0.0.1:8001", "--model", "m", "--health-timeout-ms", "5000"},
                 {{"DYN_HEALTH_INTERVAL_MS", "2000"}});
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->config.health.interval, std::chrono::milliseconds(2000));
  EXPECT_EQ(t->config.health.timeout, std::chrono::milliseconds(5000));
}

TEST(RelayConfigTest, BadHealthFlagsAreRefusedNamingTheFlag) {
  const std::vector<std::string> engine = {"--engine-url", "http://127.0.0.1:8001", "--model", "m"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), engine.begin(), engine.end());
    return Refusal(more);
  };
  EXPECT_NE(with({"--health-interval-ms", "9"}).find("--health-interval-ms"), std::string::npos);
  EXPECT_NE(with({"--health-timeout-ms", "0"}).find("--health-timeout-ms"), std::string::npos);
  EXPECT_NE(with({"--health-failures", "0"}).find("--health-failures"), std::string::npos);
  EXPECT_NE(with({"--health-failures", "-1"}).find("--health-failures"), std::string::npos);
  // Without an engine to check they mean nothing: refused, not ignored.
  EXPECT_NE(Refusal({"--health-failures", "3"}).find("needs --engine-url"), std::string::npos);
  EXPECT_NE(Refusal({"--health-timeout-ms", "300"}).find("needs --engine-url"), std::string::npos);
}

TEST(RelayConfigTest, ModelNamesAreBounded) {
  const std::vector<std::string> url = {"--engine-url", "http://127.0.0.1:8001"};
  auto with = [&](std::string models) {
    std::vector<std::string> args = url;
    args.insert(args.end(), {"--model", std::move(models)});
    return Refusal(args);
  };
  EXPECT_NE(with("a,,b").find("--model"), std::string::npos);  // an empty name
  EXPECT_NE(with(" ").find("--model"), std::string::npos);
  EXPECT_NE(with(std::string(257, 'm')).find("--model"), std::string::npos);
  EXPECT_EQ(with(std::string(256, 'm')), "");
  std::string many;
  for (int i = 0; i < 65; ++i) many += (i ? "," : "") + std::to_string(i);
  EXPECT_NE(with(many).find("--model"), std::string::npos);
}

}  // namespace
}  // namespace kvrouter
