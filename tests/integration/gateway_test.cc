// kvgateway as a process between a real HTTP client and engines, with a real nats-server and
// kvrouter: engines here are stand-ins in the test process (gateway_fixture.h's FakeEngine) whose
// behaviour each test sets, and whose registrations the test publishes. Disaggregated fleets are
// gateway_disagg_test.cc's. The same paths against kvmocker's HTTP face are in
// gateway_kvmocker_test.cc.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <condition_variable>
#include <future>
#include <mutex>
#include <set>

#include "events/msgpack_reader.h"
#include "tests/await.h"
#include "router/kvgateway/gateway.h"
#include "router/kvmocker/openai_face.h"
#include "tests/integration/gateway_fixture.h"
#include "tests/integration/kvrouter_fixture.h"
#include "transport/http_client.h"
#include "transport/http_listener.h"

namespace kvrouter::testing {
namespace {

TEST_F(GatewayTest, APlainChatCompletionGoesThroughWithTheRoutersHeadersAndFreesItsBooking) {
  FakeEngine& e = AddEngine(1);
  ASSERT_TRUE(AwaitReady(1));
  auto r = Post(Chat("hello there"), {{"x-request-id", "client-7"}});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(json::parse(r->body)["choices"][0]["message"]["content"], "hi");
  // Sent whole, with its length (one write), not chunked.
  EXPECT_EQ(HeaderOf(*r, "content-length"), std::to_string(r->body.size()));
  EXPECT_EQ(HeaderOf(*r, "transfer-encoding"), "");
  EXPECT_EQ(HeaderOf(*r, "x-request-id"), "client-7");
  EXPECT_EQ(HeaderOf(*r, "x-kvrouter-worker-id"), "1");
  EXPECT_FALSE(HeaderOf(*r, "x-kvrouter-cached-tokens").empty());
  EXPECT_EQ(e.renders(), 1);
  EXPECT_EQ(e.last_request_id(), "client-7");
  // Freed; a plain response's first byte came after its whole generation: no timing to learn from.
  EXPECT_TRUE(AwaitStats(
      [](StatsReply& s) {
        return s.breakdowns["requests"]["route.ok"] == 1 && s.counters["active_requests"] == 0 &&
               s.counters["timing_reports"] == 0;
      },
      5s));
}

TEST_F(GatewayTest, AStreamIsPassedThroughEventByEvent) {
  AddEngine(1);
  ASSERT_TRUE(AwaitReady(1));
  auto r = Post(Chat("stream me", true));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(HeaderOf(*r, "content-type"), "text/event-stream");
  EXPECT_EQ(HeaderOf(*r, "transfer-encoding"), "chunked");
  EXPECT_NE(r->body.find("t0"), std::string::npos);
  EXPECT_TRUE(r->body.ends_with("data: [DONE]\n\n")) << r->body;
  // Freed with the engine's timing, which teaches worker 1's rates.
  EXPECT_TRUE(AwaitStats(
      [](StatsReply& s) {
        return s.counters["active_requests"] == 0 && s.counters["timing_reports"] == 1 &&
               s.counters["rate_observations"] == 1 && s.workers.at(0).rate_observations == 1;
      },
      5s));
}

// A plain answer past what the gateway holds goes out chunked as it comes, whole and unchanged.
TEST_F(GatewayTest, APlainAnswerLargerThanTheGatewayHoldsIsPassedThroughChunked) {
  AddEngine(1).set_mode(FakeEngine::Mode::kBig);
  ASSERT_TRUE(AwaitReady(1));
  auto r = Post(Chat("a long answer"));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(HeaderOf(*r, "transfer-encoding"), "chunked");
  const json body = json::parse(r->body, nullptr, false);
  ASSERT_FALSE(body.is_discarded());
  const std::string content = body["choices"][0]["message"]["content"];
  EXPECT_GT(content.size(), Gateway::kMaxHeldBody);
  EXPECT_EQ(content, std::string(FakeEngine::kBigContent, 'x'));
  EXPECT_TRUE(AwaitStats([](StatsReply& s) { return s.counters["active_requests"] == 0; }, 5s));
}

TEST_F(GatewayTest, ModelsListsWhatTheEnginesServeAndAnUnknownModelIs404) {
  AddEngine(1);
  ASSERT_TRUE(AwaitReady(1));
  auto models = client_->Fetch(endpoint_, {.method = "GET", .target = "/v1/models"});
  ASSERT_TRUE(models.ok());
  EXPECT_EQ(json::parse(models->body)["data"][0]["id"], "m");
  auto r = Post(R"({"model":"other","messages":[{"role":"user","content":"x"}]})");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status, 404);
  EXPECT_EQ(json::parse(r->body)["error"]["code"], "model_not_found");
}

TEST_F(GatewayTest, EveryErrorIsOpenAiShapedWithItsStatus) {
  AddEngine(1);
  ASSERT_TRUE(AwaitReady(1));
  auto bad_json = Post("{not json");
  ASSERT_TRUE(bad_json.ok());
  EXPECT_EQ(bad_json->status, 400);
  EXPECT_TRUE(json::parse(bad_json->body)["error"]["message"].is_string());
  EXPECT_EQ(Post(R"({"messages":[]})")->status, 400);                       // no model
  EXPECT_EQ(Post(R"({"model":"m"})")->status, 400);                         // no messages
  EXPECT_EQ(Post(R"({"model":"m"})", {}, "/v1/completions")->status, 400);  // no prompt
  EXPECT_EQ(client_->Fetch(endpoint_, {.method = "GET", .target = "/v1/nothing"})->status, 404);
  EXPECT_EQ(client_->Fetch(endpoint_, {.method = "GET", .target = "/v1/chat/completions"})->status, 405);
  // Refused before routing, still with the client's request id.
  auto named = Post("{not json", {{"x-request-id", "early-1"}});
  ASSERT_TRUE(named.ok());
  EXPECT_EQ(HeaderOf(*named, "x-request-id"), "early-1");
}

TEST_F(GatewayTest, TwoRequestsWithOneClientRequestIdAreBookedApartAndCarryTheApiKey) {
  FakeEngine& e = AddEngine(1);
  e.set_mode(FakeEngine::Mode::kHold);
  ASSERT_TRUE(AwaitReady(1));
  const HttpHeaders headers = {
      {"x-request-id", "same"}, {"authorization", "Bearer sk-test"}, {"content-type", "application/json"}};
  auto a = client_->Start(endpoint_, {.target = "/v1/chat/completions", .headers = headers, .body = Chat("first")}, {});
  auto b =
      client_->Start(endpoint_, {.target = "/v1/chat/completions", .headers = headers, .body = Chat("second")}, {});
  ASSERT_TRUE(AwaitTrue([&] { return e.held() == 2; }));
  EXPECT_EQ(ActiveRequests(), 2u);  // two bookings, not one overwritten
  EXPECT_EQ(e.last_request_id(), "same");
  EXPECT_EQ(e.last_authorization(), "Bearer sk-test");
  e.Release();
  EXPECT_TRUE(AwaitStats([](StatsReply& s) { return s.counters["active_requests"] == 0; }, 5s));
}

// /metrics is on --metrics-port only; /health and /ready on both ports (a load balancer probes
// the port it sends to).
TEST_F(GatewayTest, MetricsAreServedOnTheMetricsPortOnlyAndHealthAndReadyOnBoth) {
  AddEngine(1);
  ASSERT_TRUE(AwaitReady(1));
  auto api = client_->Fetch(endpoint_, {.method = "GET", .target = "/metrics"});
  ASSERT_TRUE(api.ok()) << api.status().ToString();
  EXPECT_EQ(api->status, 404);
  EXPECT_EQ(api->body.find("kvgateway_"), std::string::npos);
  auto admin = client_->Fetch(metrics_endpoint_, {.method = "GET", .target = "/metrics"});
  ASSERT_TRUE(admin.ok()) << admin.status().ToString();
  EXPECT_EQ(admin->status, 200);
  EXPECT_NE(admin->body.find("kvgateway_engines 1"), std::string::npos);
  for (const HttpEndpoint& at : {endpoint_, metrics_endpoint_}) {
    for (const char* path : {"/health", "/ready"}) {
      auto r = client_->Fetch(at, {.method = "GET", .target = path});
      ASSERT_TRUE(r.ok()) << path;
      EXPECT_EQ(r->status, 200) << path << " on port " << at.port;
    }
  }
}

// The engine's end-to-end response headers reach the client (a 429's Retry-After among them),
// without a second copy of the gateway's own.
TEST_F(GatewayTest, TheEnginesResponseHeadersComeBackButNotOverTheGatewaysOwn) {
  FakeEngine& e = AddEngine(1);
  ASSERT_TRUE(AwaitReady(1));
  e.set_answer_headers({{"x-engine-note", "n"},
                        {"cache-control", "no-cache"},
                        {"x-request-id", "the-engines"},
                        {"x-kvrouter-worker-id", "999"},
                        {"server", "uvicorn"}});
  auto count = [](const HttpClient::Response& r, std::string_view name) {
    return std::count_if(r.headers.begin(), r.headers.end(), [&](const auto& h) { return h.first == name; });
  };
  for (const bool stream : {false, true}) {
    SCOPED_TRACE(stream ? "streamed" : "plain");
    auto r = Post(Chat("headers back", stream), {{"x-request-id", "mine"}});
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_EQ(r->status, 200) << r->body;
    EXPECT_EQ(HeaderOf(*r, "x-engine-note"), "n");
    EXPECT_EQ(HeaderOf(*r, "cache-control"), "no-cache");
    EXPECT_EQ(HeaderOf(*r, "x-request-id"), "mine");
    EXPECT_EQ(count(*r, "x-request-id"), 1);
    EXPECT_EQ(HeaderOf(*r, "x-kvrouter-worker-id"), "1");
    EXPECT_EQ(count(*r, "x-kvrouter-worker-id"), 1);
    EXPECT_EQ(count(*r, "content-type"), 1);
    EXPECT_EQ(HeaderOf(*r, "server"), "kvgateway");
  }
  e.set_answer_headers({{"retry-after", "7"}});
  e.set_mode(FakeEngine::Mode::kBusy429);
  auto busy = Post(Chat("busy"));
  ASSERT_TRUE(busy.ok()) << busy.status().ToString();
  EXPECT_EQ(busy->status, 429);
  EXPECT_EQ(HeaderOf(*busy, "retry-after"), "7");
  EXPECT_TRUE(AwaitStats([](StatsReply& s) { return s.counters["active_requests"] == 0; }, 5s));
}

TEST_F(GatewayTest, AnEngineThatRefusesConnectionsIsRetriedAwayFrom) {
  // Worker 1 is registered at a port where nothing listens; worker 2 works.
  auto dead = PickFreePort();
  ASSERT_TRUE(dead.ok());
  Announce(1, fmt::format("http://127.0.0.1:{}", *dead));
  FakeEngine& live = AddEngine(2);
  ASSERT_TRUE(AwaitReady(2));
  for (int i = 0; i < 4; ++i) {
    auto r = Post(Chat(fmt::format("request {}", i)));
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->status, 200) << r->body;
    EXPECT_EQ(HeaderOf(*r, "x-kvrouter-worker-id"), "2");
  }
  EXPECT_EQ(live.completions(), 4);
  EXPECT_TRUE(AwaitStats([](StatsReply& s) { return s.counters["active_requests"] == 0; }, 5s));
}

TEST_F(GatewayTest, AnEngineAnswering500BeforeItsFirstByteIsRetriedAndAllFailingIs502) {
  FakeEngine& bad = AddEngine(1);
  bad.set_mode(FakeEngine::Mode::kFail500);
  FakeEngine& good = AddEngine(2);
  ASSERT_TRUE(AwaitReady(2));
  auto r = Post(Chat("retry me"));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(HeaderOf(*r, "x-kvrouter-worker-id"), "2");
  good.set_mode(FakeEngine::Mode::kFail500);
  r = Post(Chat("nobody can"));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status, 502);
  EXPECT_EQ(json::parse(r->body)["error"]["type"], "server_error");
  EXPECT_TRUE(AwaitStats([](StatsReply& s) { return s.counters["active_requests"] == 0; }, 5s));
}

// A plain answer the engine breaks off before it ended reached the client not at all: it is routed
// again (alone, the engine was the last to try: 502); a 4xx broken off so is the engine's failure
// to answer, 502 at once.
TEST_F(GatewayTest, APlainAnswerBrokenOffBeforeItEndedIsRetriedUnlessAClientError) {
  FakeEngine& bad = AddEngine(1);
  bad.set_mode(FakeEngine::Mode::kCutOff);
  ASSERT_TRUE(AwaitReady(1));
  auto r = Post(Chat("cut me off"));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->status, 502) << r->body;
  EXPECT_NE(r->body.find("every engine tried failed"), std::string::npos) << r->body;
  EXPECT_EQ(bad.completions(), 1);
  bad.set_mode(FakeEngine::Mode::kCutOff400);
  r = Post(Chat("cut me off again"));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->status, 502) << r->body;
  EXPECT_NE(r->body.find("broke off"), std::string::npos) << r->body;
  EXPECT_EQ(bad.completions(), 2);
  // With a working engine beside it, the client gets that one's whole answer, once.
  bad.set_mode(FakeEngine::Mode::kCutOff);
  AddEngine(2);
  ASSERT_TRUE(AwaitReady(2));
  for (int i = 0; i < 4; ++i) {
    r = Post(Chat(fmt::format("request {}", i)));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->status, 200) << r->body;
    EXPECT_EQ(HeaderOf(*r, "x-kvrouter-worker-id"), "2");
    EXPECT_EQ(json::parse(r->body)["choices"][0]["message"]["content"], "hi");
  }
  EXPECT_TRUE(AwaitStats([](StatsReply& s) { return s.counters["active_requests"] == 0; }, 5s));
}

TEST_F(GatewayTest, AClientThatGoesAwayClosesTheEngineConnectionAndFreesTheBooking) {
  FakeEngine& e = AddEngine(1);
  e.set_mode(FakeEngine::Mode::kHold);
  ASSERT_TRUE(AwaitReady(1));
  auto call = client_->Start(endpoint_, {.target = "/v1/chat/completions", .body = Chat("long one", true)}, {});
  ASSERT_TRUE(AwaitTrue([&] { return e.held() == 1; }))
      << "renders " << e.renders() << ", completions " << e.completions() << ", booked " << ActiveRequests();
  EXPECT_EQ(ActiveRequests(), 1u);
  call->Cancel();
  ASSERT_TRUE(AwaitTrue([&] { return e.gone() == 1; }));  // the engine saw its client go
  EXPECT_TRUE(AwaitStats([](StatsReply& s) { return s.counters["active_requests"] == 0; }, 5s));
}

TEST_F(GatewayTest, WithoutEnginesTheGatewayIsNotReadyAndAnswers404OrThe503OfNoWorkers) {
  auto ready = client_->Fetch(endpoint_, {.method = "GET", .target = "/ready"});
  ASSERT_TRUE(ready.ok());
  EXPECT_EQ(ready->status, 503);
  EXPECT_EQ(client_->Fetch(endpoint_, {.method = "GET", .target = "/health"})->status, 200);
  EXPECT_EQ(Post(Chat("x"))->status, 404);  // no worker serves "m"
  // An engine the gateway knows but the router refuses (another block size): no_workers.
  FakeEngine& e = NewEngine();
  WorkerRegistration r{.worker_id = 9, .block_size = kBs * 2, .lease_ms = 60000, .http_url = e.url(), .models = {"m"}};
  ASSERT_TRUE(nc_->Publish(kComp + "instances", AsBytes(EncodeWorkerRegistration(r))).ok());
  ASSERT_TRUE(AwaitTrue([&] {
    auto m = client_->Fetch(endpoint_, {.method = "GET", .target = "/v1/models"});
    return m.ok() && m->body.find("\"m\"") != std::string::npos;
  }));
  auto answer = Post(Chat("x"));
  ASSERT_TRUE(answer.ok());
  EXPECT_EQ(answer->status, 503) << answer->body;
}

TEST_F(GatewayTest, ANatsOutageLongerThanALeaseForgetsNoEngine) {
  FakeEngine& e = NewEngine();
  announced_.push_back({.worker_id = 1, .block_size = kBs, .lease_ms = 5000, .http_url = e.url(), .models = {"m"}});
  ASSERT_TRUE(AwaitReady(1));
  nats_->Stop();
  std::this_thread::sleep_for(5500ms);  // the outage itself is the scenario, not a wait
  auto ready = [&] {
    auto r = client_->Fetch(endpoint_, {.method = "GET", .target = "/ready"});
    return r.ok() ? r->status : 0;
  };
  // Ready all through (the fallback serves): a NATS restart takes no gateway out of a load
  // balancer, neither while it is down nor while the router has not answered since.
  EXPECT_EQ(ready(), 200);
  ASSERT_TRUE(nats_->Restart().ok());
  EXPECT_EQ(ready(), 200);
  // Within a lease of the reconnect, and with no heartbeat since the outage, the gateway and the
  // router still know the engine: the router answers again and the request is routed (not
  // served by the fallback, nor answered 404 model_not_found).
  ASSERT_TRUE(AwaitTrue([&] { return ScrapeMetric("kvgateway_router_up") == 1; }));
  auto r = Post(Chat("back"));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(HeaderOf(*r, "x-kvrouter-fallback"), "");
  EXPECT_NE(HeaderOf(*r, "x-kvrouter-cached-tokens"), "");
  EXPECT_EQ(e.completions(), 1);
}

class GatewayOverloadTest : public GatewayTest {
 protected:
  // What waits for a router lost with NATS is answered, not served by the gateway's own choice.
  std::vector<std::string> GatewayArgs() const override { return {"--router-fallback", "none"}; }
  std::vector<std::string> ExtraArgs() const override {
    return {"--router-queue-threshold", "1", "--router-queue-max", "1"};
  }
  // The only engine holds what it is sent, and one prompt fills it: a first request is held
  // there. Its call, or null if that did not happen.
  std::shared_ptr<HttpCall> FillTheOnlyWorker(FakeEngine& e) {
    e.set_mode(FakeEngine::Mode::kHold);
    Announce(1, e.url(), /*max_num_batched_tokens=*/8);
    if (!AwaitReady(1)) return nullptr;
    auto first = client_->Start(endpoint_, {.target = "/v1/chat/completions", .body = Chat("fills the worker")}, {});
    if (!AwaitTrue([&] { return e.held() == 1; })) return nullptr;
    return first;
  }
};

TEST_F(GatewayOverloadTest, OverloadIs429WithRetryAfter) {
  FakeEngine& e = NewEngine();
  auto first = FillTheOnlyWorker(e);
  ASSERT_NE(first, nullptr);
  // The next waits in the router's queue (its one place), the one after is refused.
  auto queued = client_->Start(endpoint_, {.target = "/v1/chat/completions", .body = Chat("waits")}, {});
  ASSERT_TRUE(AwaitStats([](StatsReply& s) { return s.counters["queue_length"] == 1; }, 5s));
  auto r = Post(Chat("refused"));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status, 429) << r->body;
  EXPECT_EQ(HeaderOf(*r, "retry-after"), "1");
  e.Release();
  first->Cancel();
  queued->Cancel();
}

TEST_F(GatewayOverloadTest, LosingNatsAnswersWhatWaitsForTheRouter503AtOnceAndLeaksNoBooking) {
  FakeEngine& e = NewEngine();
  auto first = FillTheOnlyWorker(e);
  ASSERT_NE(first, nullptr);
  // The next waits for its route answer, in the router's queue.
  // Shared with the call, which may outlive this test body if an assertion ends it early.
  auto queued_status = std::make_shared<std::atomic<int>>(0);
  auto queued =
      client_->Start(endpoint_, {.target = "/v1/chat/completions", .body = Chat("waits")},
                     {.on_head = [queued_status](int status, const HttpHeaders&) { *queued_status = status; }});
  ASSERT_TRUE(AwaitStats([](StatsReply& s) { return s.counters["queue_length"] == 1; }, 5s));
  nats_->Stop();
  // Its answer would come over the connection that is gone: 503 now, not 429 at the route timeout.
  ASSERT_TRUE(AwaitTrue([&] { return queued_status->load() != 0; }));
  EXPECT_EQ(queued_status->load(), 503);
  // A request while NATS is down: 503 at once, not 404 for the engines it no longer hears of.
  auto down = Post(Chat("while NATS is down"));
  ASSERT_TRUE(down.ok());
  EXPECT_EQ(down->status, 503) << down->body;
  EXPECT_EQ(json::parse(down->body)["error"]["code"], "no_workers");
  EXPECT_EQ(HeaderOf(*down, "retry-after"), "1");

  ASSERT_TRUE(nats_->Restart().ok());
  e.Release();  // the first one ends, and is freed over the new connection
  e.set_mode(FakeEngine::Mode::kAnswer);
  // Nothing stays booked: the first one's free, and the queued one's booking if the router made
  // it after all, reach the router even if it subscribed again after the gateway sent them.
  std::uint64_t active = 0, queue = 0;
  EXPECT_TRUE(AwaitStats(
      [&](StatsReply& s) {
        active = s.counters["active_requests"];
        queue = s.counters["queue_length"];
        return active == 0 && queue == 0;
      },
      10s))
      << active << " booked, " << queue << " queued";
  ASSERT_TRUE(AwaitReady(1));
  auto after = Post(Chat("NATS is back"));
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(after->status, 200) << after->body;
  first->Cancel();
  queued->Cancel();
}

class GatewaySessionTest : public GatewayTest {
 protected:
  std::vector<std::string> ExtraArgs() const override { return {"--router-session-affinity-ttl-secs", "30"}; }
};

TEST_F(GatewaySessionTest, ASessionHeaderKeepsAConversationOnOneEngine) {
  AddEngine(1);
  AddEngine(2);
  ASSERT_TRUE(AwaitReady(2));
  std::set<std::string> workers;
  for (int turn = 0; turn < 6; ++turn) {
    // Different prompts each turn: only the session can keep them together.
    auto r = Post(Chat(fmt::format("turn {} of a conversation", turn)), {{"x-session-id", "conv-1"}});
    ASSERT_TRUE(r.ok());
    ASSERT_EQ(r->status, 200);
    workers.insert(HeaderOf(*r, "x-kvrouter-worker-id"));
  }
  EXPECT_EQ(workers.size(), 1u);
  auto s = Stats();
  ASSERT_TRUE(s);
  EXPECT_GE(s->counters["session_hits"], 5u);  // every turn after the first followed the binding
}

}  // namespace
}  // namespace kvrouter::testing

namespace kvrouter::testing {
namespace {

// The client's end-to-end headers (the trace context among them) reach the engine; hop-by-hop
// ones (and those the client's Connection names) do not, nor second copies of the gateway's own.
TEST_F(GatewayTest, TheClientsEndToEndHeadersReachTheEngine) {
  FakeEngine& e = AddEngine(1);
  ASSERT_TRUE(AwaitReady(1));
  const std::string body = Chat("trace me");
  RawSocket s(gateway_port_);
  ASSERT_TRUE(s.ok());
  s.Send(fmt::format(
      "POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
      "Content-Length: {}\r\nX-Request-Id: r-7\r\n"
      "traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\n"
      "tracestate: congo=t61rcWkgMzE\r\nbaggage: userId=alice\r\nAuthorization: Bearer k\r\n"
      "X-Custom: c\r\nConnection: close, X-Hop\r\nX-Hop: 1\r\nTE: trailers\r\nUpgrade: h2c\r\n"
      "Proxy-Authorization: Basic x\r\nKeep-Alive: timeout=5\r\n\r\n{}",
      body.size(), body));
  const std::string answer = s.ReadAll();
  ASSERT_TRUE(answer.starts_with("HTTP/1.1 200")) << answer;
  const HttpHeaders seen = e.last_headers();
  auto all = [&](std::string_view name) {
    std::vector<std::string> v;
    for (const auto& [k, val] : seen) {
      if (k == name) v.push_back(val);
    }
    return v;
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(all("traceparent"), V{"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"});
  EXPECT_EQ(all("tracestate"), V{"congo=t61rcWkgMzE"});
  EXPECT_EQ(all("baggage"), V{"userId=alice"});
  EXPECT_EQ(all("authorization"), V{"Bearer k"});
  EXPECT_EQ(all("x-custom"), V{"c"});
  EXPECT_EQ(all("x-request-id"), V{"r-7"});
  EXPECT_EQ(all("content-type"), V{"application/json"});
  EXPECT_EQ(all("host").size(), 1u);
  EXPECT_NE(all("host"), V{"gw"});  // the engine's own address
  EXPECT_EQ(all("content-length").size(), 1u);
  for (const char* hop : {"x-hop", "te", "upgrade", "proxy-authorization", "keep-alive"}) {
    EXPECT_TRUE(all(hop).empty()) << hop;
  }
  for (const std::string& c : all("connection")) EXPECT_EQ(c.find("X-Hop"), std::string::npos) << c;
}

class GatewayHostileTest : public GatewayTest {
 protected:
  std::vector<std::string> GatewayArgs() const override { return {"--max-body-bytes", "4096"}; }
  bool StillServes() {
    auto r = Post(Chat("are you still there?"));
    return r.ok() && r->status == 200;
  }
};

TEST_F(GatewayHostileTest, OversizedHeadersBigBodiesAndBadChunksAreRefusedAndNothingLeaks) {
  FakeEngine& e = AddEngine(1);
  ASSERT_TRUE(AwaitReady(1));
  {
    RawSocket s(gateway_port_);
    s.Send("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(64 * 1024, 'a') + "\r\n\r\n");
    EXPECT_TRUE(s.ReadAll().starts_with("HTTP/1.1 431")) << "oversized headers";
  }
  {
    RawSocket s(gateway_port_);  // announced past --max-body-bytes, and never sent
    s.Send(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
        "100000\r\n\r\n");
    const std::string a = s.ReadAll();
    EXPECT_TRUE(a.starts_with("HTTP/1.1 413")) << a;
    EXPECT_NE(a.find("\"error\""), std::string::npos);  // OpenAI-shaped
  }
  {
    RawSocket s(gateway_port_);
    s.Send("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nnothex\r\n{}\r\n");
    EXPECT_TRUE(s.ReadAll().starts_with("HTTP/1.1 400")) << "malformed chunks";
  }
  {
    RawSocket s(gateway_port_);  // a slow client: half a request, then silence
    s.Send("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{\"model\":");
    EXPECT_TRUE(StillServes());  // others are served meanwhile
  }
  EXPECT_EQ(e.completions(), 1);  // only the real request reached an engine
  EXPECT_TRUE(AwaitStats([](StatsReply& s) { return s.counters["active_requests"] == 0; }, 5s));
}

// A client that writes its whole body before it reads (many do) reads the 413 whole: the
// gateway drops what it still sends instead of resetting the connection under its writes.
TEST_F(GatewayHostileTest, AClientStillUploadingABodyFarOverTheLimitReadsTheWhole413) {
  AddEngine(1);
  ASSERT_TRUE(AwaitReady(1));
  constexpr std::size_t kBody = 32 << 20;  // --max-body-bytes 4096, and past both socket buffers
  RawSocket s(gateway_port_);
  ASSERT_TRUE(s.ok());
  s.Send(fmt::format(
      "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
      "{}\r\n\r\n",
      kBody));
  const std::string piece(1 << 20, ' ');
  for (std::size_t sent = 0; sent < kBody; sent += piece.size()) ASSERT_TRUE(s.SendAll(piece)) << "cut at " << sent;
  const std::string a = s.ReadAll();
  ASSERT_TRUE(a.starts_with("HTTP/1.1 413")) << a;
  const std::size_t body_at = a.find("\r\n\r\n");
  ASSERT_NE(body_at, std::string::npos);
  const json error = json::parse(a.substr(body_at + 4), nullptr, false);
  EXPECT_EQ(error["error"]["code"], "body_too_large") << a;
  EXPECT_TRUE(StillServes());
}

TEST_F(GatewayHostileTest, AnHttp10ClientGetsAStreamWithoutChunksEndedByTheClose) {
  AddEngine(1);
  ASSERT_TRUE(AwaitReady(1));
  RawSocket old(gateway_port_);
  const std::string body = Chat("old client", true);
  old.Send(fmt::format(
      "POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{}",
      body.size(), body));
  const std::string answer = old.ReadAll();  // returns at the close
  ASSERT_TRUE(answer.starts_with("HTTP/1.0 200")) << answer;
  EXPECT_EQ(answer.find("chunked"), std::string::npos) << answer;
  EXPECT_TRUE(answer.ends_with("data: [DONE]\n\n")) << answer;
  EXPECT_TRUE(AwaitStats([](StatsReply& s) { return s.counters["active_requests"] == 0; }, 5s));
}

TEST_F(GatewayHostileTest, TenThousandIdleConnectionsDoNotStopIt) {
  // This process and the gateway each hold 10,000 descriptors (the gateway keeps an eighth of its
  // limit, at least 256, for engines and NATS).
  rlimit r{};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &r), 0);
  r.rlim_cur = r.rlim_max;
  (void)setrlimit(RLIMIT_NOFILE, &r);
  if (r.rlim_max != RLIM_INFINITY && r.rlim_max < 12000) {
    GTEST_SKIP() << "the descriptor limit (" << r.rlim_max << ") is below what 10,000 connections need";
  }
  AddEngine(1);
  ASSERT_TRUE(AwaitReady(1));
  std::vector<RawSocket> idle;
  idle.reserve(10000);
  for (int i = 0; i < 10000; ++i) {
    idle.emplace_back(gateway_port_);
    ASSERT_TRUE(idle.back().ok()) << "connection " << i;
  }
  ASSERT_TRUE(AwaitTrue([&] { return ScrapeMetric("kvgateway_connections_open") >= 10000; }));
  EXPECT_TRUE(StillServes());
  idle.clear();
  EXPECT_TRUE(StillServes());
  EXPECT_TRUE(AwaitStats([](StatsReply& s) { return s.counters["active_requests"] == 0; }, 5s));
}

// SIGTERM drains: /ready turns 503, no connection is accepted, the requests under way finish
// (streams included) for up to --drain-timeout-secs, then the process closes the rest and exits 0.
class GatewayDrainTest : public GatewayTest {
 protected:
  // A streamed chat held by the engine after its first event; its events and end are recorded.
  struct Stream {
    std::mutex mu;
    std::string got;
    std::atomic<bool> done{false};
    Status end;
    std::shared_ptr<HttpCall> call;
  };
  std::unique_ptr<Stream> StartHeldStream(FakeEngine& e) {
    auto s = std::make_unique<Stream>();
    Stream* raw = s.get();
    s->call = client_->Start(endpoint_,
                             {.target = "/v1/chat/completions",
                              .headers = {{"content-type", "application/json"}},
                              .body = Chat("a long story", true)},
                             {.on_data =
                                  [raw](std::string_view d) {
                                    std::lock_guard g(raw->mu);
                                    raw->got.append(d);
                                  },
                              .on_done =
                                  [raw](const Status& st) {
                                    {
                                      std::lock_guard g(raw->mu);
                                      raw->end = st;
                                    }
                                    raw->done = true;
                                  }});
    EXPECT_TRUE(AwaitTrue([&] {
      std::lock_guard g(raw->mu);
      return e.held_streams() == 1 && raw->got.find("t0") != std::string::npos;
    }));
    return s;
  }
  // Engine 1 holds a stream begun through the gateway, and the gateway is sent SIGTERM.
  std::unique_ptr<Stream> HeldStreamThenSigterm(FakeEngine& e) {
    e.set_mode(FakeEngine::Mode::kHoldStream);
    EXPECT_TRUE(AwaitReady(1));
    auto stream = StartHeldStream(e);
    EXPECT_EQ(::kill(gateway_->pid(), SIGTERM), 0);
    return stream;
  }
  int ReadyStatus(const HttpEndpoint& at) {
    auto r = client_->Fetch(at, {.method = "GET", .target = "/ready"});
    return r.ok() ? r->status : 0;
  }
  bool ExitedCleanly() {
    return WaitFor([&] { return !gateway_->Running(); }, 15s) && WIFEXITED(gateway_->exit_status()) &&
           WEXITSTATUS(gateway_->exit_status()) == 0;
  }
};

TEST_F(GatewayDrainTest, SigtermLetsAStreamUnderWayFinishRefusesNewConnectionsAndExitsZero) {
  FakeEngine& e = AddEngine(1);
  auto stream = HeldStreamThenSigterm(e);
  ASSERT_FALSE(HasFailure());
  EXPECT_TRUE(AwaitTrue([&] { return ReadyStatus(metrics_endpoint_) == 503; }));
  EXPECT_TRUE(AwaitTrue([&] { return !CanConnect(gateway_port_); }));
  EXPECT_FALSE(stream->done.load());  // still under way
  EXPECT_TRUE(gateway_->Running());
  e.FinishStreams();
  ASSERT_TRUE(AwaitTrue([&] { return stream->done.load(); }));
  {
    std::lock_guard g(stream->mu);
    EXPECT_TRUE(stream->end.ok()) << stream->end.ToString();
    EXPECT_TRUE(stream->got.ends_with("data: [DONE]\n\n")) << stream->got;
  }
  EXPECT_TRUE(ExitedCleanly()) << ReadFile(LogPath("kvgateway"));
  EXPECT_TRUE(AwaitStats([](StatsReply& s) { return s.counters["active_requests"] == 0; }, 5s));
}

TEST_F(GatewayDrainTest, ASecondSigtermEndsTheDrainAtOnce) {
  FakeEngine& e = AddEngine(1);
  auto stream = HeldStreamThenSigterm(e);
  ASSERT_FALSE(HasFailure());
  ASSERT_TRUE(AwaitTrue([&] { return ReadyStatus(metrics_endpoint_) == 503; }));
  EXPECT_FALSE(stream->done.load());  // draining: the stream goes on
  ASSERT_EQ(::kill(gateway_->pid(), SIGTERM), 0);
  ASSERT_TRUE(AwaitTrue([&] { return stream->done.load(); }));  // long before the 30 s drain timeout
  {
    std::lock_guard g(stream->mu);
    EXPECT_FALSE(stream->end.ok());
  }
  EXPECT_TRUE(ExitedCleanly()) << ReadFile(LogPath("kvgateway"));
  EXPECT_TRUE(AwaitTrue([&] { return e.gone() == 1; }));
}

class GatewayShortDrainTest : public GatewayDrainTest {
 protected:
  std::vector<std::string> GatewayArgs() const override { return {"--drain-timeout-secs", "1"}; }
};

TEST_F(GatewayShortDrainTest, AStreamOutlastingTheDrainTimeoutIsCutThenAndItsBookingFreed) {
  FakeEngine& e = AddEngine(1);
  auto stream = HeldStreamThenSigterm(e);
  const auto signalled = std::chrono::steady_clock::now();  // just after the signal
  ASSERT_FALSE(HasFailure());
  ASSERT_TRUE(AwaitTrue([&] { return stream->done.load(); }));
  const auto cut_after = std::chrono::steady_clock::now() - signalled;
  EXPECT_GE(cut_after, 900ms);  // not before the drain timeout
  {
    std::lock_guard g(stream->mu);
    EXPECT_FALSE(stream->end.ok());
    EXPECT_FALSE(stream->got.ends_with("data: [DONE]\n\n")) << stream->got;
  }
  EXPECT_TRUE(ExitedCleanly()) << ReadFile(LogPath("kvgateway"));
  EXPECT_TRUE(AwaitTrue([&] { return e.gone() == 1; }));  // the engine saw its client go
  EXPECT_TRUE(AwaitStats([](StatsReply& s) { return s.counters["active_requests"] == 0; }, 5s));
}

}  // namespace
}  // namespace kvrouter::testing

namespace kvrouter::testing {
namespace {

// The whole system with real processes: kvrouter, kvmocker's HTTP faces (2 workers, the router's
// block size), kvgateway, and an HTTP client.
class GatewayKvmockerTest : public GatewayTest {
 protected:
  void SetUp() override {
    GatewayTest::SetUp();
    if (HasFatalFailure()) return;
    auto base = PickFreePortRun(2);
    ASSERT_TRUE(base.ok());
    auto m = StartOnNats(
        KVMOCKER_BIN, nats_->url(),
        {"--num-workers", "2", "--worker-id-base", "1", "--block-size", std::to_string(kBs), "--num-gpu-blocks", "4096",
         "--speedup-ratio", "100", "--http-port", std::to_string(*base), "--http-host", "127.0.0.1", "--model", "mock"},
        LogPath("kvmocker"));
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    mocker_ = std::move(m->process);
    ASSERT_TRUE(AwaitReady(2)) << ReadFile(LogPath("kvmocker"));
  }
  void TearDown() override {
    mocker_.reset();
    GatewayTest::TearDown();
  }
  static std::string MockChat(const std::string& text, bool stream, int max_tokens = 8) {
    return json{{"model", "mock"},
                {"stream", stream},
                {"max_tokens", max_tokens},
                {"messages", {{{"role", "user"}, {"content", text}}}}}
        .dump();
  }
  std::unique_ptr<ChildProcess> mocker_;
};

TEST_F(GatewayKvmockerTest, APlainChatCompletionComesWithItsUsage) {
  auto r = Post(MockChat("Hello, engine!", false));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->status, 200) << r->body;
  const json body = json::parse(r->body);
  EXPECT_EQ(body["object"], "chat.completion");
  EXPECT_EQ(body["usage"]["completion_tokens"], 8);
  EXPECT_GT(body["usage"]["prompt_tokens"].get<int>(), 10);
  EXPECT_TRUE(AwaitStats(
      [](StatsReply& s) { return s.counters["active_requests"] == 0 && s.counters["timing_reports"] == 0; }, 5s));
}

TEST_F(GatewayKvmockerTest, AStreamedCompletionArrivesAsEventsEndingInDone) {
  std::mutex mu;
  std::vector<std::string> reads;
  std::promise<Status> done;
  client_->Start(endpoint_,
                 {.target = "/v1/chat/completions",
                  .headers = {{"content-type", "application/json"}},
                  .body = MockChat("Stream to me", true, 32)},
                 {.on_data =
                      [&](std::string_view d) {
                        std::lock_guard g(mu);
                        reads.emplace_back(d);
                      },
                  .on_done = [&](const Status& s) { done.set_value(s); }});
  ASSERT_TRUE(done.get_future().get().ok());
  std::lock_guard g(mu);
  std::string all;
  for (const auto& r : reads) all += r;
  EXPECT_GT(reads.size(), 4u);  // passed through as the engine produced it, not as one piece
  EXPECT_TRUE(all.ends_with("data: [DONE]\n\n")) << all.substr(all.size() > 200 ? all.size() - 200 : 0);
  EXPECT_EQ(reads.front().find("[DONE]"), std::string::npos);
  // The stream's timing went to the router with its free, and taught the engine's rank.
  EXPECT_TRUE(AwaitStats(
      [](StatsReply& st) {
        std::uint64_t taught = 0;
        for (const WorkerStats& w : st.workers) taught += w.rate_observations;
        return st.counters["timing_reports"] == 1 && taught == 1;
      },
      5s));
}

TEST_F(GatewayKvmockerTest, TheEnginesCachedTokensRiseOnARepeatedLongPrefix) {
  const std::string prefix(2000, 'p');
  auto first = Post(MockChat(prefix + " first question", false));
  ASSERT_TRUE(first.ok());
  ASSERT_EQ(first->status, 200) << first->body;
  EXPECT_EQ(json::parse(first->body)["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  // The router learns the engine's blocks from its KV events (read under the index's lock: the
  // whole chain is in) and the first request is freed; the same prefix goes back there.
  ASSERT_TRUE(AwaitStats(
      [&](StatsReply& s) {
        return s.counters["active_requests"] == 0 &&
               std::any_of(s.workers.begin(), s.workers.end(),
                           [&](const WorkerStats& w) { return w.blocks >= prefix.size() / kBs; });
      },
      5s));
  auto second = Post(MockChat(prefix + " second question", false));
  ASSERT_TRUE(second.ok());
  ASSERT_EQ(second->status, 200);
  EXPECT_EQ(HeaderOf(*second, "x-kvrouter-worker-id"), HeaderOf(*first, "x-kvrouter-worker-id"));
  EXPECT_GT(std::stoi(HeaderOf(*second, "x-kvrouter-cached-tokens")), 1900);
  EXPECT_GT(json::parse(second->body)["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(), 1900);
}

// Multimodal items end to end (protocol.md section 12): kvmocker renders an image as placeholder
// tokens and an item, the gateway routes with the render answer's features, the engine keys its
// blocks with the item. The same text with the same image shares the prefix past the image; with
// another image it stops before it, at the router and at the engine.
TEST_F(GatewayKvmockerTest, AnImageIsPartOfThePrefixThroughTheGateway) {
  const std::string prefix(200, 'p');
  auto chat = [&](const std::string& url, const std::string& question) {
    return json{{"model", "mock"},
                {"max_tokens", 4},
                {"messages",
                 {{{"role", "user"},
                   {"content",
                    {{{"type", "text"}, {"text", prefix}},
                     {{"type", "image_url"}, {"image_url", {{"url", url}}}},
                     {{"type", "text"}, {"text", question}}}}}}}}
        .dump();
  };
  auto first = Post(chat("data:image/png;base64,AAAA", "what is it?"));
  ASSERT_TRUE(first.ok());
  ASSERT_EQ(first->status, 200) << first->body;
  // Indexed, and freed: the next request is routed by the cache alone.
  ASSERT_TRUE(AwaitStats(
      [&](StatsReply& s) {
        return s.counters["active_requests"] == 0 &&
               std::any_of(s.workers.begin(), s.workers.end(),
                           [&](const WorkerStats& w) { return w.blocks >= prefix.size() / kBs; });
      },
      5s));
  // "<|user|>\n" + 200 bytes + "\n": the image takes tokens 210 to 225, so the blocks of 4 up to
  // token 224 hold only the prompts' shared text and image; the block of 208 to 211 holds both.
  const int image_start = 210, image_end = 210 + static_cast<int>(kImageTokens);
  static_assert(kBs == 4);
  const int shared_with_image = image_end / 4 * 4, shared_text = image_start / 4 * 4;
  auto same = Post(chat("data:image/png;base64,AAAA", "and now?"));
  ASSERT_TRUE(same.ok());
  ASSERT_EQ(same->status, 200) << same->body;
  EXPECT_EQ(HeaderOf(*same, "x-kvrouter-worker-id"), HeaderOf(*first, "x-kvrouter-worker-id"));
  EXPECT_EQ(std::stoi(HeaderOf(*same, "x-kvrouter-cached-tokens")), shared_with_image);
  EXPECT_EQ(json::parse(same->body)["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(), shared_with_image);
  auto other = Post(chat("data:image/png;base64,BBBB", "and now?"));
  ASSERT_TRUE(other.ok());
  ASSERT_EQ(other->status, 200) << other->body;
  const int routed = std::stoi(HeaderOf(*other, "x-kvrouter-cached-tokens"));
  EXPECT_LE(routed, shared_text);
  if (HeaderOf(*other, "x-kvrouter-worker-id") == HeaderOf(*first, "x-kvrouter-worker-id")) {
    EXPECT_EQ(routed, shared_text);  // the text before the image is shared
    EXPECT_EQ(json::parse(other->body)["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(), shared_text);
  }
}

}  // namespace
}  // namespace kvrouter::testing
