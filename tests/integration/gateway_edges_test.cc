// kvgateway's engine side at the edges a fleet meets (issue 50): an engine host that drops
// packets (connect timeout), a long generation whose head is late (no second run elsewhere),
// idle engine connections (reaped below the engines' keep-alive, dropped with their worker), a
// slow client (the engine read paused, not the client cut off), a stream a dying engine cut
// (no timing reported) and a router that is gone (--router-fallback). The real kvgateway
// process, nats-server and kvrouter; engines are gateway_fixture.h's FakeEngine, and a local
// socket that never accepts stands in for a host that drops packets.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <string>

#include "events/registration_codec.h"
#include "tests/await.h"
#include "tests/black_hole.h"
#include "tests/sanitized.h"
#include "tests/integration/gateway_fixture.h"

namespace kvrouter::testing {
namespace {

using std::chrono::milliseconds;

class GatewayConnectTimeoutTest : public GatewayTest {
 protected:
  // The engine timeout stays at its default (which once bounded the connect too); the idle
  // timeout is long, so that only a worker leaving closes a pooled connection in these tests.
  std::vector<std::string> GatewayArgs() const override {
    return {"--engine-connect-timeout-ms", "300", "--engine-idle-timeout-ms", "600000"};
  }
};

TEST_F(GatewayConnectTimeoutTest, AnEngineHostThatDropsPacketsIsRetriedElsewhereWithinTheConnectTimeout) {
  BlackHole hole;
  ASSERT_TRUE(hole.ok());
  Announce(1, hole.url());
  FakeEngine& live = AddEngine(2);
  ASSERT_TRUE(AwaitReady(2));
  // Until the router has sent one to the black hole (the render may meet it too).
  int sent = 0;
  while (ScrapeMetric("kvgateway_retries_total") < 1 && sent < 12) {
    const auto start = std::chrono::steady_clock::now();
    auto r = client_->Fetch(endpoint_, {.target = "/v1/chat/completions",
                                        .headers = {{"content-type", "application/json"}},
                                        .body = Chat(fmt::format("request {}", sent++)),
                                        .head_timeout = std::chrono::seconds(15)});
    const auto took = std::chrono::steady_clock::now() - start;
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->status, 200) << r->body;
    EXPECT_EQ(HeaderOf(*r, "x-kvrouter-worker-id"), "2");
    // At most a render and a completion connect to the black hole, 300 ms each, not the
    // kernel's SYN retries (over two minutes).
    EXPECT_LT(took, milliseconds(3'000));
  }
  EXPECT_GE(ScrapeMetric("kvgateway_retries_total"), 1) << "no request went to the black hole in " << sent;
  EXPECT_EQ(live.completions(), sent);
  EXPECT_TRUE(AwaitStats([](StatsReply& s) { return s.counters["active_requests"] == 0; }, 5s));
}

TEST_F(GatewayConnectTimeoutTest, TheConnectionsOfAnEngineThatLeftAreClosed) {
  FakeEngine& e = AddEngine(1);
  ASSERT_TRUE(AwaitReady(1));
  ASSERT_EQ(Post(Chat("one"))->status, 200);
  ASSERT_GE(e.open_connections(), 1u);  // pooled for the next request
  WorkerRegistration leaving = announced_.back();
  leaving.leaving = true;
  announced_.clear();
  ASSERT_TRUE(nc_->Publish(kComp + "instances", AsBytes(EncodeWorkerRegistration(leaving))).ok());
  // Neither the engine (a minute) nor the gateway's idle timeout (ten minutes) closes them.
  EXPECT_TRUE(AwaitTrue([&] { return e.open_connections() == 0; }));
}

class GatewayEngineTimeoutTest : public GatewayTest {
 protected:
  std::vector<std::string> GatewayArgs() const override { return {"--engine-timeout-ms", "500"}; }
};

// vLLM sends a plain answer's head only when the generation is over: a late head is of a
// request the engine is running. It is not run a second time elsewhere: 504.
TEST_F(GatewayEngineTimeoutTest, ALateHeadOfARequestTheEngineHasIs504AndNotRunElsewhere) {
  FakeEngine& a = AddEngine(1);
  FakeEngine& b = AddEngine(2);
  a.set_mode(FakeEngine::Mode::kHold);
  b.set_mode(FakeEngine::Mode::kHold);
  ASSERT_TRUE(AwaitReady(2));
  auto r = Post(Chat("a long generation"), {{"x-request-id", "long-1"}});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->status, 504) << r->body;
  const json error = json::parse(r->body, nullptr, false);
  ASSERT_FALSE(error.is_discarded()) << r->body;
  EXPECT_EQ(error["error"]["code"], "engine_timeout");
  EXPECT_EQ(error["error"]["type"], "server_error");
  EXPECT_TRUE(error["error"]["message"].is_string());
  EXPECT_EQ(HeaderOf(*r, "x-request-id"), "long-1");
  EXPECT_EQ(a.completions() + b.completions(), 1);  // one engine ran it, once
  EXPECT_EQ(ScrapeMetric("kvgateway_retries_total"), 0);
  EXPECT_EQ(ScrapeMetric(R"(kvgateway_requests_total{code="504",endpoint="chat"})"), 1);
  EXPECT_TRUE(AwaitStats([](StatsReply& s) { return s.counters["active_requests"] == 0; }, 5s));
  a.Release();
  b.Release();
}

class GatewayIdlePoolTest : public GatewayTest {
 protected:
  std::vector<std::string> GatewayArgs() const override { return {"--engine-idle-timeout-ms", "300"}; }
};

TEST_F(GatewayIdlePoolTest, AfterABurstTheIdleEngineConnectionsCloseWithinTheIdleTimeout) {
  FakeEngine& e = AddEngine(1);
  e.set_mode(FakeEngine::Mode::kHold);
  ASSERT_TRUE(AwaitReady(1));
  // A burst of eight at once: eight engine connections.
  constexpr int kBurst = 8;
  std::vector<std::shared_ptr<HttpCall>> calls;
  auto done = std::make_shared<std::atomic<int>>(0);
  for (int i = 0; i < kBurst; ++i) {
    calls.push_back(client_->Start(endpoint_,
                                   {.target = "/v1/chat/completions",
                                    .headers = {{"content-type", "application/json"}},
                                    .body = Chat(fmt::format("burst {}", i))},
                                   {.on_done = [done](const Status&) { ++*done; }}));
  }
  ASSERT_TRUE(AwaitTrue([&] { return e.held() == kBurst; }));
  EXPECT_GE(e.open_connections(), std::uint64_t{kBurst});
  e.Release();
  ASSERT_TRUE(AwaitTrue([&] { return done->load() == kBurst; }));
  // Nobody takes them again and the engine keeps them a minute: the gateway's timer closes them.
  EXPECT_TRUE(AwaitTrue([&] { return e.open_connections() == 0; })) << e.open_connections() << " still open";
  // A request after that connects afresh and is answered.
  e.set_mode(FakeEngine::Mode::kAnswer);
  auto r = Post(Chat("after the burst"));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->status, 200);
}

// A client that reads slowly gets the whole stream; meanwhile the engine's answer waits on the
// engine's side (the gateway stopped reading it) and the gateway's memory stays bounded.
TEST_F(GatewayTest, ASlowClientSlowsTheEngineReadAndGetsTheWholeStream) {
  FakeEngine& e = AddEngine(1);
  e.set_mode(FakeEngine::Mode::kFlood);
  ASSERT_TRUE(AwaitReady(1));
  const long peak_before = ProcStatusKb(gateway_->pid(), "VmHWM");
  ASSERT_GT(peak_before, 0);
  constexpr std::size_t kStream = FakeEngine::kFloodEvent * FakeEngine::kFloodEvents;
  RawSocket client(gateway_port_);
  ASSERT_TRUE(client.ok());
  const std::string request = Chat("flood me", true);
  ASSERT_TRUE(
      client.SendAll(fmt::format("POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: "
                                 "application/json\r\nContent-Length: {}\r\n\r\n{}",
                                 request.size(), request)));
  // The client reads nothing yet: the gateway pauses the engine read, and most of the stream
  // stays queued on the engine's side.
  ASSERT_TRUE(AwaitTrue([&] { return ScrapeMetric("kvgateway_slow_clients_total") == 1; }));
  // (The kernel's buffers on the way hold some megabytes.)
  ASSERT_TRUE(AwaitTrue([&] { return e.flood_backlog() > kStream / 2; })) << e.flood_backlog();
  const std::string body = Dechunk(client.ReadUntil("\r\n0\r\n\r\n"));
  EXPECT_EQ(body.size(), kStream + std::string("data: [DONE]\n\n").size());
  EXPECT_TRUE(body.starts_with("data: 0 x"));
  EXPECT_NE(body.find(fmt::format("\n\ndata: {} x", FakeEngine::kFloodEvents - 1)), std::string::npos);
  EXPECT_TRUE(body.ends_with("x\n\ndata: [DONE]\n\n"));
  EXPECT_EQ(e.flood_backlog(), 0u);
  // The stream passed through without the gateway holding it: its peak memory grew by far less
  // than the stream.
  const long peak_after = ProcStatusKb(gateway_->pid(), "VmHWM");
  RecordProperty("gateway_peak_rss_growth_kb", std::to_string(peak_after - peak_before));
  if (!kSanitized) {  // a sanitizer's quarantine keeps what the gateway freed
    EXPECT_LT(peak_after - peak_before, static_cast<long>(kStream / 1024 / 4))
        << "peak RSS " << peak_before << " kB -> " << peak_after << " kB for a " << kStream / 1024 << " kB stream";
  }
  EXPECT_TRUE(AwaitStats([](StatsReply& s) { return s.counters["active_requests"] == 0; }, 5s));
}

// The learned rates learn from the engines' timings: a stream a dying engine cut off (a stall,
// then the end) says nothing of its speed and is freed without one.
TEST_F(GatewayTest, AStreamTheEngineCutOffIsFreedWithoutATiming) {
  FakeEngine& e = AddEngine(1);
  e.set_mode(FakeEngine::Mode::kStreamCutOff);
  ASSERT_TRUE(AwaitReady(1));
  auto r = Post(Chat("cut me", true));
  EXPECT_FALSE(r.ok());  // the client sees its stream end without its last chunk
  EXPECT_TRUE(AwaitStats(
      [](StatsReply& s) { return s.counters["active_requests"] == 0 && s.counters["timing_reports"] == 0; }, 5s));
  // A whole stream afterwards is reported: the timings do reach the router.
  e.set_mode(FakeEngine::Mode::kAnswer);
  auto whole = Post(Chat("whole", true));
  ASSERT_TRUE(whole.ok()) << whole.status().ToString();
  std::uint64_t reports = 0;
  EXPECT_TRUE(AwaitStats(
      [&](StatsReply& s) {
        reports = s.counters["timing_reports"];
        return s.counters["active_requests"] == 0 && reports == 1;
      },
      5s))
      << reports << " timing reports";
  EXPECT_EQ(e.completions(), 2);
}

// The router killed: /ready stays 200, each request goes unrendered to the engine with the
// fewest of the gateway's calls in flight, and says so; the router back, requests are routed
// (and rendered) again.
TEST_F(GatewayTest, WithoutARouterRequestsGoToTheLeastLoadedEngineUnrendered) {
  FakeEngine& a = AddEngine(1);
  FakeEngine& b = AddEngine(2);
  ASSERT_TRUE(AwaitReady(2));
  EXPECT_EQ(ScrapeMetric("kvgateway_router_up"), 1);
  router_->Kill();
  // At once (before the gateway's next probe finds no router, as a rule) a request is rendered,
  // its route finds no router, and it falls back.
  auto first = Post(Chat("the router just went"));
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(first->status, 200) << first->body;
  EXPECT_EQ(HeaderOf(*first, "x-kvrouter-fallback"), "least-loaded");
  ASSERT_TRUE(AwaitTrue([&] { return ScrapeMetric("kvgateway_router_up") == 0; }));
  // Ready (once Gateway::kRouterGrace has passed since the gateway started).
  EXPECT_TRUE(AwaitTrue([&] {
    auto ready = client_->Fetch(endpoint_, {.method = "GET", .target = "/ready"});
    return ready.ok() && ready->status == 200;
  }));
  a.set_mode(FakeEngine::Mode::kHold);
  b.set_mode(FakeEngine::Mode::kHold);
  const int renders = a.renders() + b.renders();
  // Two requests held at once: the second goes to the engine the first left idle.
  std::vector<std::shared_ptr<HttpCall>> held;
  auto statuses = std::make_shared<std::vector<std::atomic<int>>>(2);
  for (int i = 0; i < 2; ++i) {
    held.push_back(
        client_->Start(endpoint_, {.target = "/v1/chat/completions", .body = Chat(fmt::format("no router {}", i))},
                       {.on_head = [statuses, i](int status, const HttpHeaders&) { (*statuses)[i] = status; }}));
    ASSERT_TRUE(AwaitTrue([&] { return a.held() + b.held() == i + 1; })) << ReadFile(LogPath("kvgateway"));
  }
  EXPECT_EQ(a.held(), 1);
  EXPECT_EQ(b.held(), 1);
  a.Release();
  b.Release();
  ASSERT_TRUE(AwaitTrue([&] { return (*statuses)[0] == 200 && (*statuses)[1] == 200; }));
  a.set_mode(FakeEngine::Mode::kAnswer);
  b.set_mode(FakeEngine::Mode::kAnswer);
  auto r = Post(Chat("and one more"));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(HeaderOf(*r, "x-kvrouter-fallback"), "least-loaded");
  EXPECT_EQ(HeaderOf(*r, "x-kvrouter-cached-tokens"), "");
  EXPECT_EQ(a.renders() + b.renders(), renders);  // no render call while falling back
  EXPECT_EQ(ScrapeMetric("kvgateway_router_fallbacks_total"), 4);

  StartRouter();
  ASSERT_TRUE(AwaitReady(2));  // the router knows both engines and answers the gateway
  auto routed = Post(Chat("routed again"));
  ASSERT_TRUE(routed.ok());
  EXPECT_EQ(routed->status, 200) << routed->body;
  EXPECT_EQ(HeaderOf(*routed, "x-kvrouter-fallback"), "");
  EXPECT_NE(HeaderOf(*routed, "x-kvrouter-cached-tokens"), "");
  EXPECT_GT(a.renders() + b.renders(), renders);
}

class GatewayNoFallbackTest : public GatewayTest {
 protected:
  std::vector<std::string> GatewayArgs() const override { return {"--router-fallback", "none"}; }
};

// --router-fallback none: without a router the gateway is not ready and answers 503 (NATS says
// no router subscribes), without waiting for the route timeout.
TEST_F(GatewayNoFallbackTest, WithoutARouterTheGatewayIsNotReadyAndAnswers503) {
  AddEngine(1);
  ASSERT_TRUE(AwaitReady(1));
  router_->Kill();
  // nats-server has dropped the router's subscriptions once the gateway's probe finds none.
  ASSERT_TRUE(AwaitTrue([&] { return ScrapeMetric("kvgateway_router_up") == 0; }));
  auto r = Post(Chat("no router"));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status, 503) << r->body;
  EXPECT_EQ(json::parse(r->body)["error"]["code"], "no_workers");
  EXPECT_EQ(client_->Fetch(endpoint_, {.method = "GET", .target = "/ready"})->status, 503);
  EXPECT_EQ(ScrapeMetric("kvgateway_router_fallbacks_total"), 0);
}

}  // namespace
}  // namespace kvrouter::testing
