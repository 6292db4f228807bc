// kvgateway's test fixture: the real kvgateway process on KvRouterProcessTest's nats-server and
// kvrouter, a real HTTP client, and FakeEngine, a stand-in engine in the test process
// (HttpListener) whose behaviour each test sets (answer, stream, fail with 500, hold a request
// open, notice a client leaving), and whose registrations the test publishes. One test thread
// owns the fixture; the engines' handlers run on its HttpIo threads.
//
//   TEST_F(GatewayTest, X) { AddEngine(1); ASSERT_TRUE(AwaitReady(1)); auto r = Post(Chat("hi")); }
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "events/msgpack_reader.h"
#include "router/kvgateway/gateway.h"
#include "tests/await.h"
#include "tests/integration/kvrouter_fixture.h"
#include "transport/http_client.h"
#include "transport/http_listener.h"

namespace kvrouter::testing {

// A TCP client on 127.0.0.1 that sends what it is told, as slowly or as wrongly as it likes, and
// reads only when told (its receive buffer grows only as it reads: a slow client).
class RawSocket {
 public:
  explicit RawSocket(int port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<std::uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ok_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
    timeval tv{.tv_sec = 10, .tv_usec = 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  }
  RawSocket(RawSocket&& o) noexcept : fd_(std::exchange(o.fd_, -1)), ok_(o.ok_) {}
  ~RawSocket() {
    if (fd_ >= 0) ::close(fd_);
  }
  bool ok() const { return ok_; }
  void Send(std::string_view b) { (void)::send(fd_, b.data(), b.size(), MSG_NOSIGNAL); }
  // False when the connection broke before every byte was taken.
  bool SendAll(std::string_view b) { return ::send(fd_, b.data(), b.size(), MSG_NOSIGNAL) == ssize_t(b.size()); }
  // Reads until the connection ends (or 10 s of silence).
  std::string ReadAll() { return ReadUntil({}); }
  // Reads until what came ends with `end` (empty: never), the connection ends, or 10 s of silence.
  std::string ReadUntil(std::string_view end) {
    std::string out;
    std::vector<char> buf(1 << 16);
    while (end.empty() || !out.ends_with(end)) {
      const ssize_t n = ::recv(fd_, buf.data(), buf.size(), 0);
      if (n <= 0) break;
      out.append(buf.data(), static_cast<std::size_t>(n));
    }
    return out;
  }

 private:
  int fd_ = -1;
  bool ok_ = false;
};

// The body of a chunked HTTP response (head included in `raw`); "" if it is malformed.
inline std::string Dechunk(const std::string& raw) {
  std::size_t pos = raw.find("\r\n\r\n");
  if (pos == std::string::npos) return "";
  pos += 4;
  std::string body;
  while (pos < raw.size()) {
    const std::size_t eol = raw.find("\r\n", pos);
    if (eol == std::string::npos) return "";
    const std::size_t n = std::stoul(raw.substr(pos, eol - pos), nullptr, 16);
    if (n == 0) return body;
    body.append(raw, eol + 2, n);
    pos = eol + 2 + n + 2;
  }
  return "";
}

using json = nlohmann::json;

// An engine's HTTP face, as much as the gateway uses: render, chat completions (plain or
// streamed), registration on NATS with its http_url.
class FakeEngine {
 public:
  // kHoldStream: a stream's head and first event, the rest at FinishStreams. kBusy429: 429 with
  // the answer headers (set_answer_headers).
  enum class Mode { kAnswer, kFail500, kHold, kBig, kCutOff, kCutOff400, kStreamCutOff, kFlood, kHoldStream, kBusy429 };
  static constexpr std::size_t kBigContent = (Gateway::kMaxHeldBody * 3) / 2;
  // kFlood: a stream of this many events of kFloodEvent bytes, written at once, then [DONE].
  static constexpr std::size_t kFloodEvent = 64 << 10, kFloodEvents = 512;

  explicit FakeEngine(HttpIo& io) {
    auto l = HttpListener::Start(io, {.host = "127.0.0.1"}, [this](HttpRequest r, std::shared_ptr<HttpReply> reply) {
      Serve(std::move(r), std::move(reply));
    });
    EXPECT_TRUE(l.ok()) << l.status().ToString();
    listener_ = std::move(l).value();
  }
  ~FakeEngine() { Release(); }
  std::string url() const { return fmt::format("http://127.0.0.1:{}", listener_->port()); }
  void set_mode(Mode m) { mode_ = m; }
  int completions() const { return completions_.load(); }
  int renders() const { return renders_.load(); }
  int gone() const { return gone_.load(); }
  // Connections open on the engine's side (its own idle timeout is a minute).
  std::uint64_t open_connections() const { return listener_->counters().open; }
  // What the latest kFlood answer has not got into its socket yet (the gateway is not reading).
  std::size_t flood_backlog() {
    std::lock_guard g(mu_);
    return flood_ ? flood_->Backlog() : 0;
  }
  int held() {
    std::lock_guard g(mu_);
    return static_cast<int>(held_.size());
  }
  // Ends every stream held by kHoldStream (its remaining events, then [DONE]).
  void FinishStreams() {
    std::vector<std::shared_ptr<HttpReply>> held;
    {
      std::lock_guard g(mu_);
      held.swap(held_streams_);
    }
    for (auto& r : held) {
      r->Write("data: {\"choices\":[{\"delta\":{\"content\":\"t1\"}}]}\n\n");
      r->Write("data: [DONE]\n\n");
      r->End();
    }
  }
  int held_streams() {
    std::lock_guard g(mu_);
    return static_cast<int>(held_streams_.size());
  }
  // Headers added to every completion answer from now on.
  void set_answer_headers(HttpHeaders h) {
    std::lock_guard g(mu_);
    answer_headers_ = std::move(h);
  }
  // Every header of the last completion request, in the order received.
  HttpHeaders last_headers() {
    std::lock_guard g(mu_);
    return last_headers_;
  }
  // Answers every held request.
  void Release() {
    std::vector<std::shared_ptr<HttpReply>> held;
    {
      std::lock_guard g(mu_);
      held.swap(held_);
    }
    for (auto& r : held) r->Send(200, {{"content-type", "application/json"}}, R"({"choices":[]})");
  }
  std::string last_request_id() {
    std::lock_guard g(mu_);
    return last_request_id_;
  }
  std::string last_authorization() {
    std::lock_guard g(mu_);
    return last_authorization_;
  }

 private:
  void Serve(HttpRequest r, std::shared_ptr<HttpReply> reply) {
    const json body = json::parse(r.body, nullptr, false);
    if (r.Path() == "/v1/chat/completions/render") {
      ++renders_;
      // One token per byte of the messages, as kvmocker's tokenizer does.
      json ids = json::array();
      for (unsigned char c : body["messages"].dump()) ids.push_back(c);
      return reply->Send(200, {{"content-type", "application/json"}}, json{{"token_ids", ids}}.dump());
    }
    if (r.Path() != "/v1/chat/completions") return reply->Send(404, {}, "");
    ++completions_;
    HttpHeaders extra;
    {
      std::lock_guard g(mu_);
      last_request_id_ = std::string(r.Header("x-request-id").value_or(""));
      last_authorization_ = std::string(r.Header("authorization").value_or(""));
      last_headers_ = r.headers;
      extra = answer_headers_;
    }
    auto with = [&](HttpHeaders h) {
      h.insert(h.end(), extra.begin(), extra.end());
      return h;
    };
    reply->OnClientGone([this] { ++gone_; });
    switch (mode_.load()) {
      case Mode::kFail500: return reply->Send(500, {{"content-type", "application/json"}}, R"({"error":"boom"})");
      case Mode::kHold: {
        std::lock_guard g(mu_);
        held_.push_back(std::move(reply));
        return;
      }
      case Mode::kBig:  // a plain answer larger than the gateway holds, in pieces
        reply->Begin(200, {{"content-type", "application/json"}});
        reply->Write(R"({"choices":[{"message":{"content":")");
        for (std::size_t i = 0; i < kBigContent; i += 64 << 10) reply->Write(std::string(64 << 10, 'x'));
        reply->Write(R"("}}]})");
        return reply->End();
      case Mode::kStreamCutOff:  // two events, then (once they are sent) the connection ends
        reply->Begin(200, {{"content-type", "text/event-stream"}});
        reply->Write("data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n");
        reply->Write("data: {\"choices\":[{\"delta\":{\"content\":\"b\"}}]}\n\n");
        return reply->OnDrained(0, [reply] { reply->Abort(); });
      case Mode::kFlood: {
        reply->Begin(200, {{"content-type", "text/event-stream"}});
        for (std::size_t i = 0; i < kFloodEvents; ++i) {
          std::string event = fmt::format("data: {} ", i);
          event.resize(kFloodEvent - 2, 'x');
          reply->Write(event + "\n\n");
        }
        reply->Write("data: [DONE]\n\n");
        reply->End();
        std::lock_guard g(mu_);
        flood_ = std::move(reply);
        return;
      }
      case Mode::kCutOff:  // part of an answer, then the connection ends
      case Mode::kCutOff400:
        reply->Begin(mode_.load() == Mode::kCutOff ? 200 : 400, {{"content-type", "application/json"}});
        reply->Write(R"({"choices":[{"message":{"content":"half)");
        return reply->Abort();
      case Mode::kHoldStream: {
        reply->Begin(200, {{"content-type", "text/event-stream"}});
        reply->Write("data: {\"choices\":[{\"delta\":{\"content\":\"t0\"}}]}\n\n");
        std::lock_guard g(mu_);
        held_streams_.push_back(std::move(reply));
        return;
      }
      case Mode::kBusy429: return reply->Send(429, with({{"content-type", "application/json"}}), R"({"error":"busy"})");
      case Mode::kAnswer: break;
    }
    if (body.value("stream", false)) {
      reply->Begin(200, with({{"content-type", "text/event-stream"}}));
      for (int i = 0; i < 3; ++i)
        reply->Write(fmt::format("data: {{\"choices\":[{{\"delta\":{{\"content\":\"t{}\"}}}}]}}\n\n", i));
      reply->Write("data: [DONE]\n\n");
      return reply->End();
    }
    reply->Send(200, with({{"content-type", "application/json"}}),
                json{{"object", "chat.completion"}, {"choices", {{{"message", {{"content", "hi"}}}}}}}.dump());
  }

  std::unique_ptr<HttpListener> listener_;
  std::atomic<Mode> mode_{Mode::kAnswer};
  std::atomic<int> completions_{0}, renders_{0}, gone_{0};
  std::mutex mu_;
  std::vector<std::shared_ptr<HttpReply>> held_;
  std::shared_ptr<HttpReply> flood_;
  std::vector<std::shared_ptr<HttpReply>> held_streams_;
  std::string last_request_id_;
  std::string last_authorization_;
  HttpHeaders last_headers_;
  HttpHeaders answer_headers_;
};

class GatewayTest : public KvRouterProcessTest {
 protected:
  void SetUp() override {
    KvRouterProcessTest::SetUp();
    if (HasFatalFailure()) return;
    auto port = PickFreePort();
    ASSERT_TRUE(port.ok());
    gateway_port_ = *port;
    std::vector<std::string> args = {"--http-port", std::to_string(gateway_port_), "--http-host",
                                     "127.0.0.1",   "--route-timeout-ms",          "3000"};
    for (auto& a : GatewayArgs()) args.push_back(a);
    auto gw = StartOnNats(KVGATEWAY_BIN, nats_->url(), std::move(args), LogPath("kvgateway"), Metrics::kOnFreePort);
    ASSERT_TRUE(gw.ok()) << gw.status().ToString();
    gateway_ = std::move(gw->process);
    ASSERT_TRUE(AwaitTrue([&] { return CanConnect(gateway_port_) && CanConnect(gw->metrics_port); }))
        << ReadFile(LogPath("kvgateway"));
    endpoint_ = {.host = "127.0.0.1", .port = static_cast<std::uint16_t>(gateway_port_)};
    metrics_endpoint_ = {.host = "127.0.0.1", .port = static_cast<std::uint16_t>(gw->metrics_port)};
  }
  void TearDown() override {
    // The engines go after the io threads: until HttpIo::Stop a listener's handlers (an engine's
    // OnClientGone among them) may still run.
    client_.reset();
    io_.Stop();
    engines_.clear();
    gateway_.reset();
    KvRouterProcessTest::TearDown();
  }
  virtual std::vector<std::string> GatewayArgs() const { return {}; }

  // An engine registered as worker `id` serving model "m" (at `url` when given: a dead one).
  FakeEngine& AddEngine(std::uint64_t id) {
    FakeEngine& e = NewEngine();
    Announce(id, e.url());
    return e;
  }
  // An engine not yet announced; it lives until TearDown.
  FakeEngine& NewEngine() { return *engines_.emplace_back(std::make_unique<FakeEngine>(io_)); }
  void Announce(std::uint64_t id, const std::string& url, std::uint32_t max_num_batched_tokens = 8192) {
    announced_.push_back({.worker_id = id,
                          .block_size = kBs,
                          .max_num_batched_tokens = max_num_batched_tokens,
                          .lease_ms = 60000,
                          .http_url = url,
                          .models = {"m"}});
    Heartbeat();
  }
  // Every announced engine registers again, as its heartbeat would.
  void Heartbeat() {
    for (const WorkerRegistration& r : announced_) {
      ASSERT_TRUE(nc_->Publish(kComp + "instances", AsBytes(EncodeWorkerRegistration(r))).ok());
    }
  }
  // The gateway knows `n` engines (and the router has answered it): /ready says so. The engines'
  // heartbeats go on meanwhile (a registration sent before the gateway subscribed is not lost).
  // The gateway knows n engines and is ready, and the router has registered as many ranks: the
  // two read registrations on connections of their own, so either may see them first.
  bool AwaitReady(std::size_t n) {
    return AwaitTrue([&] {
      Heartbeat();
      auto ready = client_->Fetch(endpoint_, {.method = "GET", .target = "/ready"});
      auto metrics = client_->Fetch(metrics_endpoint_, {.method = "GET", .target = "/metrics"});
      auto stats = Stats();
      return ready.ok() && ready->status == 200 && metrics.ok() &&
             metrics->body.find(fmt::format("\nkvgateway_engines {}\n", n)) != std::string::npos &&
             metrics->body.find("\nkvgateway_router_up 1\n") != std::string::npos && stats && stats->workers_total >= n;
    });
  }
  static std::string Chat(const std::string& text, bool stream = false) {
    return json{{"model", "m"}, {"stream", stream}, {"messages", {{{"role", "user"}, {"content", text}}}}}.dump();
  }
  Result<HttpClient::Response> Post(const std::string& body, HttpHeaders headers = {},
                                    std::string target = "/v1/chat/completions") {
    headers.emplace_back("content-type", "application/json");
    return client_->Fetch(endpoint_, {.target = std::move(target), .headers = std::move(headers), .body = body});
  }
  static std::string HeaderOf(const HttpClient::Response& r, std::string_view name) {
    for (const auto& [k, v] : r.headers) {
      if (k == name) return v;
    }
    return "";
  }
  // A series (its name and labels) on the /metrics of `at` (default: the gateway's metrics
  // port), -1 when absent.
  double ScrapeMetric(const std::string& series, std::optional<HttpEndpoint> at = std::nullopt) {
    auto r = client_->Fetch(at.value_or(metrics_endpoint_), {.method = "GET", .target = "/metrics"});
    if (!r.ok()) return -1;
    std::istringstream lines(r->body);
    for (std::string line; std::getline(lines, line);) {
      if (line.starts_with(series + " ")) return std::stod(line.substr(series.size() + 1));
    }
    return -1;
  }
  std::uint64_t ActiveRequests() {
    auto s = Stats();
    return s ? s->counters["active_requests"] : ~0ull;
  }

  HttpIo io_{2};
  std::unique_ptr<HttpClient> client_ = std::make_unique<HttpClient>(io_, HttpClient::Options{});
  std::vector<std::unique_ptr<FakeEngine>> engines_;
  std::vector<WorkerRegistration> announced_;
  std::unique_ptr<ChildProcess> gateway_;
  int gateway_port_ = 0;
  HttpEndpoint endpoint_;          // the API port: /v1/..., /health, /ready
  HttpEndpoint metrics_endpoint_;  // --metrics-port: /metrics, /health, /ready
};

}  // namespace kvrouter::testing
