// kvgateway's flags (router/kvgateway/config.cc): defaults, the environment, and the refusals
// that name their flag.
#include "router/kvgateway/config.h"

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace kvrouter {
namespace {

Result<ParsedGatewayArgs> Parse(std::vector<std::string> args, std::map<std::string, std::string> env = {}) {
  args.insert(args.begin(), "kvgateway");
  std::vector<const char*> argv;
  for (auto& a : args) argv.push_back(a.c_str());
  return ParseGatewayConfig(static_cast<int>(argv.size()), argv.data(), [&](const char* name) {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

TEST(GatewayConfig, DefaultsAndTheEnvironment) {
  auto p = Parse({}, {{"DYN_HTTP_PORT", "8123"}, {"NATS_SERVER", "nats://n:4222"}});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->config.http_port, 8123u);
  EXPECT_EQ(p->config.nats_server, "nats://n:4222");
  EXPECT_EQ(p->config.retries, GatewayConfig{}.retries);
  EXPECT_TRUE(p->config.render_url.empty());
  EXPECT_EQ(p->config.engine_connect_timeout_ms, 2000u);
  EXPECT_EQ(p->config.render_timeout_ms, 10000u);
  EXPECT_EQ(p->config.engine_idle_timeout_ms, 4000u);
  auto set = Parse({"--engine-connect-timeout-ms", "250", "--render-timeout-ms", "900"},
                   {{"DYN_ENGINE_IDLE_TIMEOUT_MS", "1500"}});
  ASSERT_TRUE(set.ok()) << set.status().ToString();
  EXPECT_EQ(set->config.engine_connect_timeout_ms, 250u);
  EXPECT_EQ(set->config.render_timeout_ms, 900u);
  EXPECT_EQ(set->config.engine_idle_timeout_ms, 1500u);
  EXPECT_EQ(p->config.drain_timeout_secs, 30u);
  auto drain = Parse({}, {{"DYN_DRAIN_TIMEOUT_SECS", "0"}});  // 0: close at once
  ASSERT_TRUE(drain.ok()) << drain.status().ToString();
  EXPECT_EQ(drain->config.drain_timeout_secs, 0u);
  EXPECT_EQ(p->config.router_fallback, RouterFallback::kLeastLoaded);
  auto none = Parse({}, {{"DYN_ROUTER_FALLBACK", "none"}});
  ASSERT_TRUE(none.ok()) << none.status().ToString();
  EXPECT_EQ(none->config.router_fallback, RouterFallback::kNone);
}

TEST(GatewayConfig, TheRenderUrlIsABaseUrlItsSlashTrimmed) {
  auto p = Parse({"--render-url", "http://renderer:8000/"});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->config.render_url, "http://renderer:8000");
  for (const char* bad : {"https://renderer:8000", "http://renderer:8000/v1", "http://renderer:99999", "renderer"}) {
    auto r = Parse({"--render-url", bad});
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(r.status().message().find("render-url"), std::string::npos) << r.status().message();
  }
}

TEST(GatewayConfig, OutOfRangeValuesNameTheirFlag) {
  for (auto [flag, value] : std::vector<std::pair<std::string, std::string>>{{"retries", "17"},
                                                                             {"io-threads", "0"},
                                                                             {"max-body-bytes", "0"},
                                                                             {"route-timeout-ms", "0"},
                                                                             {"engine-timeout-ms", "0"},
                                                                             {"engine-connect-timeout-ms", "0"},
                                                                             {"render-timeout-ms", "0"},
                                                                             {"engine-idle-timeout-ms", "0"},
                                                                             {"max-connections", "0"},
                                                                             {"drain-timeout-secs", "3601"},
                                                                             {"router-fallback", "random"},
                                                                             {"http-port", "70000"}}) {
    auto r = Parse({"--" + flag, value});
    ASSERT_FALSE(r.ok()) << flag;
    EXPECT_NE(r.status().message().find(flag), std::string::npos) << r.status().message();
  }
}

}  // namespace
}  // namespace kvrouter
