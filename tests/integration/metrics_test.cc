// /metrics, /health and /ready of the real kvrouter (docs/protocol.md section 10), scraped over HTTP
// while a real nats-server comes and goes.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <fmt/format.h>

#include <sstream>

#include "events/message_codec.h"
#include "events/msgpack_reader.h"
#include "tests/integration/kvrouter_fixture.h"

namespace kvrouter::testing {
namespace {

// The value of the series `series` (name and labels exactly as exposed), or nullopt.
std::optional<double> Value(const std::string& text, const std::string& series) {
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.size() > series.size() && line.compare(0, series.size(), series) == 0 && line[series.size()] == ' ') {
      return std::stod(line.substr(series.size() + 1));
    }
  }
  return std::nullopt;
}

class MetricsTest : public KvRouterProcessTest {
 protected:
  Metrics RouterMetrics() const override { return Metrics::kOnFreePort; }

  std::string Scrape() {
    // The HTTP server's first answer can lag the router's NATS side on a loaded machine: wait
    // for one (a scrape that never answers still fails below).
    auto r = HttpGet(metrics_port_, "/metrics");
    WaitFor([&] { return (r = HttpGet(metrics_port_, "/metrics")).ok(); }, 10s);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    if (!r.ok()) return "";
    EXPECT_EQ(r->status, 200);
    return r->body;
  }
  int StatusOf(const std::string& path) {
    auto r = HttpGet(metrics_port_, path, 1s);
    return r.ok() ? r->status : 0;
  }
};

TEST_F(MetricsTest, ServesHealthReadinessAndMetricsThatFollowTheRouter) {
  // The HTTP server's first answer can lag the router's NATS side on a loaded machine.
  EXPECT_TRUE(WaitFor([&] { return StatusOf("/health") == 200; }, 10s));
  ASSERT_TRUE(WaitFor([&] { return StatusOf("/ready") == 200; }, 5s));
  EXPECT_EQ(StatusOf("/nowhere"), 404);
  std::string m = Scrape();
  EXPECT_EQ(Value(m, R"(kvrouter_info{mode="kv",kv_events="true",recovery="true",replica_sync="false"})"), 1);
  EXPECT_EQ(Value(m, "kvrouter_approximate_mode"), 0);
  EXPECT_EQ(Value(m, R"(dynamo_component_kv_cache_events_applied{status="ok"})"), 0);

  Register(1);
  ASSERT_TRUE(AwaitWorkers(1));
  StoreDynamo(1, 1, Tokens(100, 8));
  ASSERT_TRUE(AwaitEventsApplied(1));
  auto r = Route(Tokens(100, 12), "req-1");
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  auto bad = nc_->Request(kRouter + "route", AsBytes(std::string_view("\xc1")), 2s);  // not msgpack
  ASSERT_TRUE(bad.ok());
  EXPECT_EQ(DecodeRouteReply(*bad).status().code(), StatusCode::kInvalidArgument);

  // A request's duration is observed just after its reply leaves.
  ASSERT_TRUE(
      WaitFor([&] { return Value(Scrape(), R"(kvrouter_route_duration_seconds_count{endpoint="route"})") == 2; }, 5s));
  m = Scrape();
  EXPECT_EQ(Value(m, R"(dynamo_component_kv_cache_events_applied{status="ok"})"), 1);
  EXPECT_EQ(Value(m, R"(kvrouter_worker_cached_blocks{worker_id="1",dp_rank="0"})"), 2);
  EXPECT_EQ(Value(m, R"(kvrouter_worker_active_requests{worker_id="1",dp_rank="0"})"), 1);
  EXPECT_EQ(Value(m, R"(kvrouter_worker_active_blocks{worker_id="1",dp_rank="0"})"), 3);
  EXPECT_EQ(Value(m, R"(dynamo_component_router_requests_started_total{endpoint="route"})"), 2);
  EXPECT_EQ(Value(m, R"(kvrouter_requests_total{endpoint="route",result="ok"})"), 1);
  EXPECT_EQ(Value(m, R"(kvrouter_requests_total{endpoint="route",result="invalid_argument"})"), 1);
  // One decision, 2 of its 3 blocks cached: its hit rate falls in the (0.6, 0.7] bucket.
  EXPECT_EQ(Value(m, "dynamo_component_router_kv_hit_rate_count"), 1);
  EXPECT_EQ(Value(m, R"(dynamo_component_router_kv_hit_rate_bucket{le="0.6"})"), 0);
  EXPECT_EQ(Value(m, R"(dynamo_component_router_kv_hit_rate_bucket{le="0.7"})"), 1);
  EXPECT_EQ(Value(m, "dynamo_frontend_router_queue_pending_requests"), 0);
  EXPECT_EQ(Value(m, "kvrouter_worker_ranks"), 1);
}

// Section 13: the decisions of requests with a prefill and a decode pool, by path.
TEST_F(MetricsTest, CountsDisaggregatedDecisionsByPath) {
  for (auto [id, role] : {std::pair{1, WorkerRole::kPrefill}, {2, WorkerRole::kDecode}}) {
    WorkerRegistration r{.worker_id = static_cast<std::uint64_t>(id), .block_size = kBs, .lease_ms = 60000, .role = role};
    ASSERT_TRUE(nc_->Publish(kComp + "instances", AsBytes(EncodeWorkerRegistration(r))).ok());
  }
  ASSERT_TRUE(AwaitWorkers(2));
  ASSERT_TRUE(Route(Tokens(100, 12), "short").ok());  // an idle decode worker prefills it itself
  std::vector<std::uint32_t> excluded_prefill = Tokens(200, 12);
  RouteRequest req{.request_id = "fallback", .token_ids = excluded_prefill, .has_token_ids = true};
  req.isl = static_cast<std::uint32_t>(req.token_ids.size());
  req.excluded_worker_ids = std::vector<std::uint64_t>{1};
  auto fallback = RequestRoute("route", EncodeRouteRequest(req));
  ASSERT_TRUE(fallback.ok()) << fallback.status().ToString();
  EXPECT_EQ(fallback->worker_id, 2u);
  ASSERT_TRUE(WaitFor(
      [&] { return Value(Scrape(), R"(kvrouter_disagg_decisions_total{path="fallback"})").value_or(0) == 1; }, 5s));
  EXPECT_EQ(Value(Scrape(), R"(kvrouter_disagg_decisions_total{path="local"})"), 1);
}

TEST_F(MetricsTest, ReadinessFollowsTheNatsConnection) {
  ASSERT_TRUE(WaitFor([&] { return StatusOf("/ready") == 200; }, 5s));
  nats_->Stop();
  EXPECT_TRUE(WaitFor([&] { return StatusOf("/ready") == 503; }, 10s));
  EXPECT_EQ(StatusOf("/health"), 200);  // alive all the same
  ASSERT_TRUE(nats_->Restart().ok());
  EXPECT_TRUE(WaitFor([&] { return StatusOf("/ready") == 200; }, 15s));
  // Each connection comes back on its own.
  for (const char* c : {"events", "requests"}) {
    const std::string series = fmt::format(R"(kvrouter_nats_reconnects_total{{connection="{}"}})", c);
    EXPECT_TRUE(WaitFor([&] { return Value(Scrape(), series).value_or(0) >= 1; }, 10s)) << series;
  }
}

TEST_F(MetricsTest, AMetricsPortInUseStopsASecondRouterNamingTheFlag) {
  const std::string log = LogPath("kvrouter-port-in-use");
  auto second = ChildProcess::Start({KVROUTER_BIN, "--nats-server", nats_->url(), "--metrics-port",
                                     std::to_string(metrics_port_), "--metrics-host", "127.0.0.1"},
                                    log);
  ASSERT_TRUE(second.ok());
  ASSERT_TRUE(WaitFor([&] { return !(*second)->Running(); }, 10s));
  EXPECT_TRUE(WIFEXITED((*second)->exit_status()));
  EXPECT_EQ(WEXITSTATUS((*second)->exit_status()), 2);
  const std::string text = ReadFile(log);
  EXPECT_NE(text.find("--metrics-port"), std::string::npos) << text;
  EXPECT_EQ(StatusOf("/health"), 200);  // the first router is untouched
}

class ApproximateMetricsTest : public MetricsTest {
 protected:
  std::vector<std::string> ExtraArgs() const override { return {"--no-router-kv-events"}; }
};

TEST_F(ApproximateMetricsTest, ApproximateModeIsPlainInTheMetrics) {
  std::string m = Scrape();
  EXPECT_EQ(Value(m, "kvrouter_approximate_mode"), 1);
  EXPECT_EQ(Value(m, R"(kvrouter_info{mode="kv",kv_events="false",recovery="false",replica_sync="false"})"), 1);
  Register(1);
  ASSERT_TRUE(AwaitWorkers(1));
  ASSERT_TRUE(Route(Tokens(100, 12), "req-1").ok());
  m = Scrape();
  EXPECT_EQ(Value(m, "kvrouter_approx_predicted_blocks"), 3);
}

}  // namespace
}  // namespace kvrouter::testing
