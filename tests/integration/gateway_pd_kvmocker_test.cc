// kvmocker's prefill and decode faces (docs/protocol.md section 13, "kvmocker's roles") through
// real processes: nats-server, kvrouter (--router-disagg-policy always), kvgateway, and a kvmocker
// process per role (a process has one role), for vLLM's connector (nixl) and SGLang's; a prefill
// process killed mid-run; a decode leg with bad kv_transfer_params; an SGLang room that never
// comes; both nixl legs inside one kvmocker process (the pull's end told directly); and a
// thousand kvbench clients, some aborting, through a fleet losing a prefill process (PdSoakTest).
// (The fields alone: tests/router/kvmocker/kv_transfer_test.cc.)
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <fstream>
#include <functional>
#include <future>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "tests/integration/gateway_fixture.h"

namespace kvrouter::testing {
namespace {

constexpr std::uint64_t kPrefillId = 1;  // the prefill process's worker
constexpr std::uint64_t kDecodeId = 2;   // the decode process's worker

// A chat body for kvmocker's model.
std::string MockChat(const std::string& text, bool stream, int max_tokens = 8) {
  return json{{"model", "mock"},
              {"stream", stream},
              {"max_tokens", max_tokens},
              {"messages", {{{"role", "user"}, {"content", text}}}}}
      .dump();
}

// A kvmocker process: its HTTP face (one worker) and its /metrics.
struct Mocker {
  std::unique_ptr<ChildProcess> process;
  int http_port = 0;
  int metrics_port = 0;
  HttpEndpoint Http() const { return {.host = "127.0.0.1", .port = static_cast<std::uint16_t>(http_port)}; }
};

class GatewayPdKvmockerTest : public GatewayTest {
 protected:
  std::vector<std::string> ExtraArgs() const override { return {"--router-disagg-policy", "always"}; }
  void TearDown() override {
    mockers_.clear();
    GatewayTest::TearDown();
  }
  virtual std::string Connector() const { return "nixl"; }

  // One kvmocker process of `role` whose worker is `id` (block size kBs, fast engines).
  Mocker& StartMocker(const std::string& name, std::uint64_t id, const std::string& role,
                      std::vector<std::string> extra = {}, std::uint32_t workers = 1) {
    Mocker& m = mockers_.emplace_back();
    auto port = PickFreePortRun(static_cast<int>(workers));
    EXPECT_TRUE(port.ok());
    m.http_port = *port;
    std::vector<std::string> args = {"--num-workers",    std::to_string(workers),
                                     "--worker-id-base", std::to_string(id),
                                     "--block-size",     std::to_string(kBs),
                                     "--num-gpu-blocks", "4096",
                                     "--speedup-ratio",  speedup_,
                                     "--http-port",      std::to_string(m.http_port),
                                     "--http-host",      "127.0.0.1",
                                     "--model",          "mock",
                                     "--role",           role,
                                     "--kv-connector",   Connector(),
                                     "--heartbeat-ms",   "100",
                                     "--lease-ms",       "1000"};
    for (auto& a : extra) args.push_back(std::move(a));
    auto p = StartOnNats(KVMOCKER_BIN, nats_->url(), std::move(args), LogPath(name), Metrics::kOnFreePort);
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    if (p.ok()) {
      m.process = std::move(p->process);
      m.metrics_port = p->metrics_port;
    }
    return m;
  }
  // The prefill and the decode process, and the gateway and router knowing both. The prefill
  // engine's lease outlasts the test (600 s over the speedup): only the pull's end unpins.
  void StartPair(std::vector<std::string> prefill_extra = {}) {
    prefill_extra.insert(prefill_extra.end(), {"--kv-lease-ms", "60000000"});
    prefill_ = &StartMocker("kvmocker-prefill", kPrefillId, "prefill", std::move(prefill_extra));
    decode_ = &StartMocker("kvmocker-decode", kDecodeId, "decode");
    ASSERT_TRUE(AwaitReady(2)) << ReadFile(LogPath("kvmocker-prefill")) << ReadFile(LogPath("kvmocker-decode"));
  }
  // A series on a kvmocker's /metrics (its name and labels), -1 when absent.
  double MockerMetric(const Mocker& m, const std::string& series) {
    return ScrapeMetric(series, HttpEndpoint{.host = "127.0.0.1", .port = static_cast<std::uint16_t>(m.metrics_port)});
  }
  double GatewayMetric(const std::string& series) { return ScrapeMetric(series); }
  static std::string Pinned(std::uint64_t worker) {
    return fmt::format("kvmocker_pinned_blocks{{worker_id=\"{}\",dp_rank=\"0\"}}", worker);
  }
  // A streamed chat through the gateway: its body, or "" when it failed.
  std::string StreamThroughGateway(const std::string& text) {
    std::mutex mu;
    std::string all;
    int status = 0;
    std::promise<Status> done;
    client_->Start(endpoint_,
                   {.target = "/v1/chat/completions",
                    .headers = {{"content-type", "application/json"}},
                    .body = MockChat(text, true, 12)},
                   {.on_head =
                        [&](int s, const HttpHeaders&) {
                          std::lock_guard g(mu);
                          status = s;
                        },
                    .on_data =
                        [&](std::string_view d) {
                          std::lock_guard g(mu);
                          all.append(d);
                        },
                    .on_done = [&](const Status& s) { done.set_value(s); }});
    const Status s = done.get_future().get();
    std::lock_guard g(mu);
    EXPECT_TRUE(s.ok()) << s.ToString();
    EXPECT_EQ(status, 200) << all;
    return s.ok() && status == 200 ? all : "";
  }
  // The decode worker's cache holds the prompt's blocks (its stored events reached the router),
  // nothing is booked, and the prefill worker pins nothing.
  void ExpectPulledAndFreed(std::size_t prompt_bytes) {
    EXPECT_TRUE(AwaitStats(
        [&](StatsReply& s) {
          bool cached = false;
          for (const WorkerStats& w : s.workers) cached |= w.worker_id == kDecodeId && w.blocks >= prompt_bytes / kBs;
          return cached && s.counters["active_requests"] == 0 && s.counters["active_prefill_legs"] == 0;
        },
        5s));
    EXPECT_TRUE(AwaitTrue([&] { return MockerMetric(*prefill_, Pinned(kPrefillId)) == 0; }))
        << MockerMetric(*prefill_, Pinned(kPrefillId));
    EXPECT_EQ(MockerMetric(*decode_, "kvmocker_invalid_kv_transfers_total"), 0);
    EXPECT_EQ(MockerMetric(*decode_, "kvmocker_bootstrap_failures_total"), 0);
  }

  std::string speedup_ = "100";  // every kvmocker's --speedup-ratio
  std::deque<Mocker> mockers_;
  Mocker* prefill_ = nullptr;
  Mocker* decode_ = nullptr;
};

TEST_F(GatewayPdKvmockerTest, AStreamedChatIsPrefilledThereDecodedHereAndLeavesNothingPinnedOrBooked) {
  StartPair();
  const std::string prompt(400, 'q');
  const std::string all = StreamThroughGateway(prompt);
  EXPECT_TRUE(all.ends_with("data: [DONE]\n\n")) << all;
  EXPECT_NE(all.find("\"content\":\"l\""), std::string::npos) << all;  // the 12th token: decoded in full
  EXPECT_EQ(GatewayMetric("kvgateway_disagg_requests_total{path=\"disaggregated\"}"), 1);
  ExpectPulledAndFreed(prompt.size());
  // The decode engine pulled instead of prefilling: a local prefill would count here.
  EXPECT_EQ(MockerMetric(*decode_, "kvmocker_local_prefills_on_invalid_transfer_total{worker_id=\"2\",dp_rank=\"0\"}"),
            0);
}

TEST_F(GatewayPdKvmockerTest, APlainChatGetsThePrefillEnginesCachedTokensAndItsWorkerHeader) {
  StartPair();
  const std::string prompt(300, 'r');
  for (int i = 0; i < 2; ++i) {
    auto r = Post(MockChat(prompt + std::to_string(i), false));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_EQ(r->status, 200) << r->body;
    EXPECT_EQ(HeaderOf(*r, "x-kvrouter-prefill-worker-id"), std::to_string(kPrefillId));
    EXPECT_EQ(HeaderOf(*r, "x-kvrouter-worker-id"), std::to_string(kDecodeId));
    const json body = json::parse(r->body);
    EXPECT_EQ(body["usage"]["completion_tokens"], 8);
    EXPECT_FALSE(body.contains("kv_transfer_params")) << r->body;  // the prefill answer is not the client's
    // The second request shares the first one's prefix on the prefill engine.
    if (i == 1) {
      EXPECT_GT(body["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(), 250) << r->body;
    }
  }
  ExpectPulledAndFreed(prompt.size());
}

TEST_F(GatewayPdKvmockerTest, AKilledPrefillProcessIsRetriedAwayAndEveryRequestAnswered) {
  StartPair();
  for (int i = 0; i < 30; ++i) {
    // Killed with requests before and after: the router still lists it for its lease (1 s), so
    // the next prefill leg fails to connect and the gateway routes the request again without it.
    if (i == 10) prefill_->process->Kill();
    auto r = Post(MockChat(fmt::format("request {} {}", i, std::string(100, 'k')), i % 2 == 0));
    ASSERT_TRUE(r.ok()) << i << ": " << r.status().ToString();
    EXPECT_EQ(r->status, 200) << i << ": " << r->body;
    EXPECT_NE(r->body.find(i % 2 == 0 ? "data: [DONE]" : "chat.completion"), std::string::npos) << r->body;
  }
  EXPECT_GE(GatewayMetric("kvgateway_retries_total"), 1);
  EXPECT_GE(GatewayMetric("kvgateway_disagg_requests_total{path=\"fallback\"}"), 1);  // prefilled on the decode worker
  EXPECT_TRUE(AwaitStats(
      [](StatsReply& s) { return s.counters["active_requests"] == 0 && s.counters["active_prefill_legs"] == 0; }, 5s));
}

TEST_F(GatewayPdKvmockerTest, BadKvTransferParamsMakeTheDecodeWorkerPrefillLocally) {
  StartPair();
  const json body = {{"model", "mock"},
                     {"max_tokens", 4},
                     {"prompt", std::string(64, 'z')},
                     {"kv_transfer_params",
                      {{"do_remote_prefill", true},
                       {"remote_engine_id", "not-a-kvmocker-engine"},
                       {"remote_block_ids", json::array({1, 2})},
                       {"remote_host", "127.0.0.1"},
                       {"remote_port", prefill_->http_port},
                       {"remote_request_id", "x"}}}};
  auto r = client_->Fetch(
      decode_->Http(),
      {.target = "/v1/completions", .headers = {{"content-type", "application/json"}}, .body = body.dump()});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(json::parse(r->body)["usage"]["completion_tokens"], 4);
  EXPECT_EQ(MockerMetric(*decode_, "kvmocker_invalid_kv_transfers_total"), 1);
  EXPECT_EQ(MockerMetric(*decode_, "kvmocker_local_prefills_on_invalid_transfer_total{worker_id=\"2\",dp_rank=\"0\"}"),
            1);
  // Valid fields naming blocks that are not the prompt's: a local prefill too (vLLM's check).
  json mismatched = body;
  mismatched["kv_transfer_params"]["remote_engine_id"] = "1_dp0";
  auto m = client_->Fetch(
      decode_->Http(),
      {.target = "/v1/completions", .headers = {{"content-type", "application/json"}}, .body = mismatched.dump()});
  ASSERT_TRUE(m.ok());
  ASSERT_EQ(m->status, 200) << m->body;
  EXPECT_EQ(MockerMetric(*decode_, "kvmocker_local_prefills_on_invalid_transfer_total{worker_id=\"2\",dp_rank=\"0\"}"),
            2);
}

TEST_F(GatewayPdKvmockerTest, BothLegsInOneProcessReleaseThePinDirectly) {
  // A kv_both-like process of two workers: worker 10 prefills, worker 11 pulls from it.
  Mocker& m = StartMocker("kvmocker-both", 10, "both", {"--kv-lease-ms", "60000000"}, 2);
  const std::string prompt(200, 'b');
  // The gateway's prefill leg keeps the null fields too (kv_transfer_test.cc parses that body).
  const json prefill_body = {{"model", "mock"},
                             {"prompt", prompt},
                             {"max_tokens", 1},
                             {"stream", false},
                             {"kv_transfer_params", {{"do_remote_decode", true}, {"do_remote_prefill", false}}}};
  ASSERT_TRUE(AwaitTrue([&] { return CanConnect(m.http_port + 1); }));
  auto p = client_->Fetch(
      m.Http(),
      {.target = "/v1/completions", .headers = {{"content-type", "application/json"}}, .body = prefill_body.dump()});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  ASSERT_EQ(p->status, 200) << p->body;
  const json params = json::parse(p->body)["kv_transfer_params"];
  EXPECT_EQ(params["do_remote_prefill"], true);
  EXPECT_EQ(params["remote_engine_id"], "10_dp0");
  EXPECT_EQ(params["remote_block_ids"].size(), prompt.size() / kBs);
  EXPECT_EQ(params["remote_port"], m.http_port);
  EXPECT_TRUE(AwaitTrue([&] { return MockerMetric(m, Pinned(10)) == static_cast<double>(prompt.size() / kBs); }))
      << MockerMetric(m, Pinned(10));

  json decode_body = {{"model", "mock"}, {"prompt", prompt}, {"max_tokens", 5}, {"kv_transfer_params", params}};
  auto d = client_->Fetch(
      {.host = "127.0.0.1", .port = static_cast<std::uint16_t>(m.http_port + 1)},
      {.target = "/v1/completions", .headers = {{"content-type", "application/json"}}, .body = decode_body.dump()});
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  ASSERT_EQ(d->status, 200) << d->body;
  EXPECT_EQ(json::parse(d->body)["usage"]["completion_tokens"], 5);
  EXPECT_TRUE(AwaitTrue([&] { return MockerMetric(m, Pinned(10)) == 0; }));
  EXPECT_EQ(MockerMetric(m, "kvmocker_cached_blocks{worker_id=\"11\",dp_rank=\"0\"}"),
            static_cast<double>(prompt.size() / kBs));
  EXPECT_EQ(MockerMetric(m, "kvmocker_local_prefills_on_invalid_transfer_total{worker_id=\"11\",dp_rank=\"0\"}"), 0);
  // kv_pulled again (as a late notice over HTTP would come): nothing left to release.
  auto again = client_->Fetch(
      m.Http(),
      {.target = "/kvmocker/kv_pulled",
       .headers = {{"content-type", "application/json"}},
       .body = json{{"remote_engine_id", "10_dp0"}, {"remote_request_id", params["remote_request_id"]}}.dump()});
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->status, 200);
  EXPECT_EQ(json::parse(again->body)["released"], false);
}

TEST_F(GatewayPdKvmockerTest, ADecodeLegCancelledDuringItsPullUnpinsThePrefillBlocks) {
  // A pull of 50 blocks at 1 Mbit/s: seconds long even at speedup 100.
  Mocker& m = StartMocker("kvmocker-both", 10, "both", {"--kv-lease-ms", "60000000", "--kv-transfer-gbps", "0.001"}, 2);
  ASSERT_TRUE(AwaitTrue([&] { return CanConnect(m.http_port + 1); }));
  const std::string prompt(200, 'c');
  const json prefill_body = {
      {"model", "mock"}, {"prompt", prompt}, {"max_tokens", 1}, {"kv_transfer_params", {{"do_remote_decode", true}}}};
  auto p = client_->Fetch(
      m.Http(),
      {.target = "/v1/completions", .headers = {{"content-type", "application/json"}}, .body = prefill_body.dump()});
  ASSERT_TRUE(p.ok());
  ASSERT_EQ(p->status, 200) << p->body;
  // The engine's metrics follow its answer (another thread): awaited.
  ASSERT_TRUE(AwaitTrue([&] { return MockerMetric(m, Pinned(10)) == static_cast<double>(prompt.size() / kBs); }))
      << MockerMetric(m, Pinned(10));
  const json decode_body = {{"model", "mock"},
                            {"prompt", prompt},
                            {"max_tokens", 5},
                            {"kv_transfer_params", json::parse(p->body)["kv_transfer_params"]}};
  auto done = std::make_shared<std::promise<Status>>();  // outlives an early end of the test
  auto call = client_->Start(
      {.host = "127.0.0.1", .port = static_cast<std::uint16_t>(m.http_port + 1)},
      {.target = "/v1/completions", .headers = {{"content-type", "application/json"}}, .body = decode_body.dump()},
      {.on_done = [done](const Status& s) { done->set_value(s); }});
  // In its pull: the decode engine references the blocks it receives.
  ASSERT_TRUE(AwaitTrue([&] { return MockerMetric(m, "kvmocker_active_blocks{worker_id=\"11\",dp_rank=\"0\"}") > 0; }));
  call->Cancel();
  EXPECT_FALSE(done->get_future().get().ok());
  EXPECT_TRUE(AwaitTrue([&] { return MockerMetric(m, Pinned(10)) == 0; })) << MockerMetric(m, Pinned(10));
}

class GatewayPdKvmockerSglangTest : public GatewayPdKvmockerTest {
 protected:
  std::string Connector() const override { return "sglang"; }
  void StartSglangPair() {
    auto port = PickFreePort();
    ASSERT_TRUE(port.ok());
    bootstrap_port_ = *port;
    StartPair({"--bootstrap-port", std::to_string(bootstrap_port_)});
  }
  int bootstrap_port_ = 0;
};

TEST_F(GatewayPdKvmockerSglangTest, AStreamedChatMeetsByRoomAndLeavesNothingPinnedOrBooked) {
  StartSglangPair();
  if (HasFatalFailure()) return;
  const std::string prompt(400, 's');
  const std::string all = StreamThroughGateway(prompt);
  EXPECT_TRUE(all.ends_with("data: [DONE]\n\n")) << all;
  EXPECT_NE(all.find("\"content\":\"l\""), std::string::npos) << all;
  EXPECT_EQ(GatewayMetric("kvgateway_disagg_requests_total{path=\"disaggregated\"}"), 1);
  ExpectPulledAndFreed(prompt.size());
  auto r = Post(MockChat(prompt + "again", false));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->status, 200) << r->body;
  ExpectPulledAndFreed(prompt.size());
}

TEST_F(GatewayPdKvmockerSglangTest, ADecodeLegWhoseRoomNeverComesFailsWithAClearError) {
  StartSglangPair();
  if (HasFatalFailure()) return;
  const json body = {{"model", "mock"},
                     {"prompt", "nobody prefills this"},
                     {"bootstrap_host", "127.0.0.1"},
                     {"bootstrap_port", bootstrap_port_},
                     {"bootstrap_room", 12345}};
  const auto start = std::chrono::steady_clock::now();
  auto r = client_->Fetch(
      decode_->Http(),
      {.target = "/v1/completions", .headers = {{"content-type", "application/json"}}, .body = body.dump()});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->status, 502) << r->body;
  EXPECT_EQ(json::parse(r->body)["error"]["code"], "kv_bootstrap_failed") << r->body;
  EXPECT_NE(r->body.find("12345"), std::string::npos) << r->body;
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);  // kv_lease_ms 30000 over speedup 100: bounded
  EXPECT_EQ(MockerMetric(*decode_, "kvmocker_bootstrap_failures_total"), 1);
}

TEST_F(GatewayPdKvmockerSglangTest, APrefillLegCancelledFailsItsWaitingDecodeLegAtOnce) {
  speedup_ = "0.01";  // a prefill of seconds; the decode leg would wait its room for 3,000 s
  StartSglangPair();
  if (HasFatalFailure()) return;
  const json body = {{"model", "mock"},
                     {"prompt", std::string(2000, 'w')},
                     {"bootstrap_host", "127.0.0.1"},
                     {"bootstrap_port", bootstrap_port_},
                     {"bootstrap_room", 777}};
  const HttpCallSpec spec = {
      .target = "/v1/completions", .headers = {{"content-type", "application/json"}}, .body = body.dump()};
  // Shared with the calls: an assertion that ends the test early leaves them nothing dangling.
  auto decoded = std::make_shared<std::promise<std::pair<int, std::string>>>();
  auto status = std::make_shared<int>(0);
  auto text = std::make_shared<std::string>();
  client_->Start(decode_->Http(), spec,
                 {.on_head = [status](int s, const HttpHeaders&) { *status = s; },
                  .on_data = [text](std::string_view d) { text->append(d); },
                  .on_done =
                      [decoded, status, text](const Status&) {
                        decoded->set_value({*status, *text});
                      }});
  auto prefilled = std::make_shared<std::promise<Status>>();
  auto prefill_call =
      client_->Start(prefill_->Http(), spec, {.on_done = [prefilled](const Status& s) { prefilled->set_value(s); }});
  // In its prefill (the engine's step has run; its end, in real time, is seconds away), pinned.
  ASSERT_TRUE(AwaitTrue([&] { return MockerMetric(*prefill_, "kvmocker_outstanding_requests") == 1; }));
  prefill_call->Cancel();
  EXPECT_FALSE(prefilled->get_future().get().ok());
  auto future = decoded->get_future();
  ASSERT_EQ(future.wait_for(10s), std::future_status::ready) << "the decode leg still waits for a cancelled prefill";
  const auto [code, answer] = future.get();
  EXPECT_EQ(code, 502) << answer;
  EXPECT_NE(answer.find("kv_bootstrap_failed"), std::string::npos) << answer;
  EXPECT_NE(answer.find("cancelled"), std::string::npos) << answer;
  EXPECT_EQ(MockerMetric(*prefill_, Pinned(kPrefillId)), 0);  // nobody will pull it
}

// Issue 49's "nothing lost": kvbench's HTTP clients through the gateway, some of them going away
// at random points (during the prefill leg, between the legs, mid-stream).
class GatewayPdClientsTest : public GatewayPdKvmockerTest {
 protected:
  // Runs kvbench --gateway on the synthetic chat (`sessions` x 4 turns at `rate` per second, a
  // tenth of clients aborting, or `abort_fraction`); `mid_run` is called once the gateway
  // disaggregated `mid_run_after` requests. Returns kvbench's JSON report.
  json RunClients(int sessions, int rate, const std::string& abort_fraction, int prefill_workers,
                  double mid_run_after = -1, const std::function<void()>& mid_run = {}) {
    const std::string report_path = LogPath("kvbench") + ".json";
    auto bench = ChildProcess::Start(
        {KVBENCH_BIN, "--nats-server", nats_->url(), "--gateway", fmt::format("http://127.0.0.1:{}", gateway_port_),
         "--model", "mock", "--synthetic", "--sessions", std::to_string(sessions), "--turns", "4", "--rate",
         std::to_string(rate), "--concurrency", "256", "--abort-fraction", abort_fraction, "--seed", "7", "--timeout",
         "120", "--wait-workers", std::to_string(prefill_workers + 1), "--prefill-workers",
         std::to_string(prefill_workers), "--label", "clients", "--json", report_path},
        LogPath("kvbench"));
    EXPECT_TRUE(bench.ok()) << bench.status().ToString();
    if (!bench.ok()) return {};
    if (mid_run) {
      EXPECT_TRUE(WaitFor(
          [&] {
            return GatewayMetric("kvgateway_disagg_requests_total{path=\"disaggregated\"}") >= mid_run_after ||
                   !(*bench)->Running();
          },
          60s, 50ms));
      mid_run();
    }
    EXPECT_TRUE(WaitFor([&] { return !(*bench)->Running(); }, 150s, 50ms)) << "kvbench did not finish";
    EXPECT_EQ((*bench)->exit_status(), 0) << ReadFile(LogPath("kvbench"));
    std::ifstream in(report_path);
    EXPECT_TRUE(in) << report_path;
    return in ? json::parse(in) : json{};
  }
  // No request errs, none stays booked, and `prefill`'s pinned blocks are released (at the
  // lease at the latest).
  void ExpectNothingLost(const json& report, const Mocker& prefill, std::uint64_t prefill_id) {
    EXPECT_EQ(report.value("errors", -1), 0) << "every request not aborted is answered: "
                                             << ReadFile(LogPath("kvbench"));
    EXPECT_EQ(report.value("bookings_left", json()), json({{"requests", 0}, {"prefill_tokens", 0}, {"blocks", 0}}));
    EXPECT_TRUE(AwaitStats(
        [](StatsReply& s) { return s.counters["active_requests"] == 0 && s.counters["active_prefill_legs"] == 0; },
        5s));
    EXPECT_TRUE(WaitFor([&] { return MockerMetric(prefill, Pinned(prefill_id)) == 0; }, 10s, 50ms))
        << MockerMetric(prefill, Pinned(prefill_id));
  }
  // Leases of 2 s at the fixture's speedup: long enough for any pull here, short enough to await.
  const std::vector<std::string> lease_ = {"--kv-lease-ms", std::to_string(2000 * std::stoi(speedup_))};
};

// A short run that TSan's filter includes (kvbench's replay and the gateway's client-gone paths
// race there): a third of 80 clients abort.
TEST_F(GatewayPdClientsTest, ClientsAbortingAtRandomPointsLeaveNothingBookedOrPinned) {
  Mocker& prefill = StartMocker("kvmocker-prefill", kPrefillId, "prefill", lease_);
  StartMocker("kvmocker-decode", kDecodeId, "decode");
  ASSERT_TRUE(AwaitReady(2));
  const json report = RunClients(20, 40, "0.3", 1);
  EXPECT_EQ(report.value("requests", 0), 80);
  const int aborted = report.value("aborted", 0);
  EXPECT_GT(aborted, 10);  // a third planned, by the seed's draw
  // Their clients really went away: the gateway saw them go.
  EXPECT_GE(GatewayMetric("kvgateway_clients_gone_total"), aborted / 2);
  ExpectNothingLost(report, prefill, kPrefillId);
}

// The load: a thousand clients, a tenth aborting, one of two prefill processes killed
// mid-run. Outside TSan's filter (PdSoak, not Gateway...Test): a load run.
class PdSoakTest : public GatewayPdClientsTest {};

TEST_F(PdSoakTest, AThousandRequestsWithAbortsAndAKilledPrefillProcessLoseNothing) {
  constexpr std::uint64_t kSecondPrefillId = 3;
  Mocker& killed = StartMocker("kvmocker-prefill", kPrefillId, "prefill", lease_);
  Mocker& survivor = StartMocker("kvmocker-prefill2", kSecondPrefillId, "prefill", lease_);
  StartMocker("kvmocker-decode", kDecodeId, "decode");
  ASSERT_TRUE(AwaitReady(3));
  const json report = RunClients(250, 100, "0.1", 2, 300, [&] { killed.process->Kill(); });
  EXPECT_FALSE(killed.process->Running());
  EXPECT_EQ(report.value("requests", 0), 1000);
  const int aborted = report.value("aborted", 0);
  EXPECT_GT(aborted, 50);  // a tenth, by the seed's draw
  EXPECT_LT(aborted, 150);
  ExpectNothingLost(report, survivor, kSecondPrefillId);
  // The kill cost requests their prefill leg: the gateway routed them again or prefilled locally.
  EXPECT_GE(GatewayMetric("kvgateway_retries_total") +
                GatewayMetric("kvgateway_disagg_requests_total{path=\"fallback\"}"),
            1);
}

}  // namespace
}  // namespace kvrouter::testing
