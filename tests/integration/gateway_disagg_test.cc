// kvgateway's legs for a disaggregated fleet (docs/protocol.md section 13, "Gateway legs"), with
// the real kvgateway, nats-server and kvrouter (--router-disagg-policy always) and stand-in vLLM
// and SGLang engines in the test process that record every leg whole: the fields of each leg's
// body, the request id on both legs, the EOS-at-prefill answer in the client's form, SGLang's legs
// sent at once, prefill_done, retries away from a failing prefill engine, a client gone between
// the legs, the headers (the client's end-to-end ones on both legs, the decode engine's back),
// the prefill engine's cached_tokens, and the metrics.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <cstdio>
#include <future>
#include <mutex>
#include <sstream>

#include "tests/await.h"
#include "tests/integration/gateway_fixture.h"
#include "transport/http_client.h"
#include "transport/http_listener.h"

namespace kvrouter::testing {
namespace {

using ordered_json = nlohmann::ordered_json;

// What a vLLM prefill engine with NixlConnector answers in kv_transfer_params (its order, a
// float and an array kept, to see it reach the decode leg verbatim).
const ordered_json kTransferParams = {{"do_remote_prefill", true}, {"do_remote_decode", false},
                                      {"remote_engine_id", "engine-p"}, {"remote_block_ids", {3, 1, 2}},
                                      {"remote_host", "127.0.0.9"},     {"remote_port", 5600},
                                      {"remote_request_id", "r-1"},     {"tp_size", 1},
                                      {"ratio", 0.25}};

// A client's trace context (W3C traceparent), which every leg must carry.
const std::string kTraceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

// A prefill or decode engine of a disaggregated fleet, as much as the gateway uses: render (chat
// and completions) and completions, each completion request recorded whole (path, x-request-id,
// body as sent) and answered as its role and mode say: a prefill engine with one token "P" and
// its cached_tokens (and, for vLLM's connector, kv_transfer_params), a decode engine with
// "decoded" (or events d0 d1 d2) and its cached_tokens, with an `x-engine-role` header naming its
// role. It can hold requests until Release, and notices the gateway closing one.
class PdEngine {
 public:
  enum class Mode {
    kAnswer,
    kEos,      // a prefill engine stopped at its token: no kv_transfer_params
    kEosNull,  // the same, as "kv_transfer_params": null
    kNoConnector,  // an engine without the NixlConnector: its one token, "length", no kv_transfer_params
    kFail500,
    kBusy429,  // 429 with Retry-After: 3
  };
  struct Seen {
    std::string path;
    std::string request_id;
    std::string raw;  // the body as it came
    HttpHeaders headers;  // every header, as they came
    std::string Header(std::string_view name) const {
      for (const auto& [k, v] : headers) {
        if (k == name) return v;
      }
      return "";
    }
    std::shared_ptr<std::atomic<bool>> gone = std::make_shared<std::atomic<bool>>(false);
  };

  PdEngine(HttpIo& io, WorkerRole role, KvConnector connector, std::uint32_t cached_tokens)
      : role_(role), connector_(connector), cached_tokens_(cached_tokens) {
    auto l = HttpListener::Start(io, {.host = "127.0.0.1"}, [this](HttpRequest r, std::shared_ptr<HttpReply> reply) {
      Serve(std::move(r), std::move(reply));
    });
    EXPECT_TRUE(l.ok()) << l.status().ToString();
    listener_ = std::move(l).value();
  }
  std::string url() const { return fmt::format("http://127.0.0.1:{}", listener_->port()); }
  void set_mode(Mode m) { mode_ = m; }
  // The next n completion requests are held until Release.
  void HoldNext(int n) { hold_ = n; }
  std::size_t requests() {
    std::lock_guard g(mu_);
    return seen_.size();
  }
  Seen seen(std::size_t i) {
    std::lock_guard g(mu_);
    return seen_.at(i);
  }
  std::size_t held() {
    std::lock_guard g(mu_);
    return held_.size();
  }
  // Answers every held request (as the mode says).
  void Release() {
    std::vector<std::pair<Seen, std::shared_ptr<HttpReply>>> held;
    {
      std::lock_guard g(mu_);
      held.swap(held_);
    }
    for (auto& [seen, reply] : held) Answer(seen, *reply);
  }
  // The answer this engine gives to a plain request on `path`.
  ordered_json PlainAnswer(const std::string& path) const {
    const bool chat = path == "/v1/chat/completions";
    const bool prefill = role_ == WorkerRole::kPrefill;
    const std::string text = prefill ? "P" : "decoded";
    ordered_json choice = {{"index", 0}};
    if (chat) {
      choice["message"] = {{"role", "assistant"}, {"content", text}};
    } else {
      choice["text"] = text;
    }
    const bool at_length = (mode_.load() == Mode::kAnswer || mode_.load() == Mode::kNoConnector) && prefill;
    choice["finish_reason"] = at_length ? "length" : "stop";
    ordered_json a = {{"id", prefill ? "cmpl-p" : "cmpl-d"},
                      {"object", chat ? "chat.completion" : "text_completion"},
                      {"created", 1700000000},
                      {"model", "m"},
                      {"choices", {choice}},
                      {"usage",
                       {{"prompt_tokens", 10},
                        {"completion_tokens", 1},
                        {"total_tokens", 11},
                        {"prompt_tokens_details", {{"cached_tokens", cached_tokens_}}}}}};
    if (prefill && connector_ == KvConnector::kNixl) {
      if (mode_.load() == Mode::kAnswer) a["kv_transfer_params"] = kTransferParams;
      if (mode_.load() == Mode::kEosNull) a["kv_transfer_params"] = nullptr;
    }
    return a;
  }

 private:
  void Serve(HttpRequest r, std::shared_ptr<HttpReply> reply) {
    const json body = json::parse(r.body, nullptr, false);
    const std::string_view path = r.Path();
    if (path == "/v1/chat/completions/render" || path == "/v1/completions/render") {
      json ids = json::array();  // one token per byte of the prompt
      const std::string prompt = path.starts_with("/v1/chat") ? body["messages"].dump() : body["prompt"].dump();
      for (unsigned char c : prompt) ids.push_back(c);
      const json answer = path.starts_with("/v1/chat") ? json{{"token_ids", ids}} : json::array({{{"token_ids", ids}}});
      return reply->Send(200, {{"content-type", "application/json"}}, answer.dump());
    }
    if (path != "/v1/chat/completions" && path != "/v1/completions") return reply->Send(404, {}, "");
    Seen seen{.path = std::string(path),
              .request_id = std::string(r.Header("x-request-id").value_or("")),
              .raw = r.body,
              .headers = r.headers};
    reply->OnClientGone([gone = seen.gone] { *gone = true; });
    {
      std::lock_guard g(mu_);
      seen_.push_back(seen);
      if (hold_.load() > 0) {
        --hold_;
        held_.emplace_back(seen, std::move(reply));
        return;
      }
    }
    Answer(seen, *reply);
  }

  void Answer(const Seen& seen, HttpReply& reply) {
    if (mode_.load() == Mode::kFail500) {
      return reply.Send(500, {{"content-type", "application/json"}}, R"({"error":"boom"})");
    }
    if (mode_.load() == Mode::kBusy429) {
      return reply.Send(429, {{"content-type", "application/json"}, {"retry-after", "3"}}, R"({"error":"busy"})");
    }
    const json body = json::parse(seen.raw, nullptr, false);
    const std::string role = role_ == WorkerRole::kPrefill ? "prefill" : "decode";
    if (!body.value("stream", false)) {
      return reply.Send(200, {{"content-type", "application/json"}, {"x-engine-role", role}},
                        PlainAnswer(seen.path).dump());
    }
    const bool chat = seen.path == "/v1/chat/completions";
    reply.Begin(200, {{"content-type", "text/event-stream"}, {"x-engine-role", role}});
    for (int i = 0; i < 3; ++i) {
      const std::string piece = fmt::format("d{}", i);
      const json choice = chat ? json{{"index", 0}, {"delta", {{"content", piece}}}} : json{{"index", 0}, {"text", piece}};
      reply.Write("data: " + json{{"choices", {choice}}}.dump() + "\n\n");
    }
    reply.Write("data: [DONE]\n\n");
    reply.End();
  }

  const WorkerRole role_;
  const KvConnector connector_;
  const std::uint32_t cached_tokens_;
  std::unique_ptr<HttpListener> listener_;
  std::atomic<Mode> mode_{Mode::kAnswer};
  std::atomic<int> hold_{0};
  std::mutex mu_;
  std::vector<Seen> seen_;
  std::vector<std::pair<Seen, std::shared_ptr<HttpReply>>> held_;
};

class GatewayDisaggTest : public GatewayTest {
 protected:
  // Every request through the prefill pool while one is usable: the legs are what is tested.
  std::vector<std::string> ExtraArgs() const override { return {"--router-disagg-policy", "always"}; }
  void TearDown() override {
    GatewayTest::TearDown();  // HttpIo stops there: no engine handler runs after it
    pd_.clear();
  }

  PdEngine& AddPd(std::uint64_t id, WorkerRole role, std::uint32_t cached_tokens,
                  KvConnector connector = KvConnector::kNixl, std::uint32_t bootstrap_port = kDefaultBootstrapPort) {
    PdEngine& e = *pd_.emplace_back(std::make_unique<PdEngine>(io_, role, connector, cached_tokens));
    AnnouncePd(id, e.url(), role, connector, bootstrap_port);
    return e;
  }
  // vLLM's pair: prefill worker 1 (7 cached tokens) and decode worker 2 (99).
  struct Pair {
    PdEngine& prefill;
    PdEngine& decode;
  };
  Pair AddNixlPair() { return {AddPd(1, WorkerRole::kPrefill, 7), AddPd(2, WorkerRole::kDecode, 99)}; }
  void AnnouncePd(std::uint64_t id, const std::string& url, WorkerRole role, KvConnector connector = KvConnector::kNixl,
                  std::uint32_t bootstrap_port = kDefaultBootstrapPort) {
    announced_.push_back({.worker_id = id,
                          .block_size = kBs,
                          .max_num_batched_tokens = 8192,
                          .lease_ms = 60000,
                          .http_url = url,
                          .models = {"m"},
                          .role = role,
                          .kv_connector = connector,
                          .bootstrap_port = bootstrap_port});
    Heartbeat();
  }
  // A metric's value on the gateway's /metrics (`series` with its labels), -1 when absent.
  double Metric(const std::string& series) { return ScrapeMetric(series); }
  bool AwaitFreed() {
    return AwaitStats(
        [](StatsReply& s) { return s.counters["active_requests"] == 0 && s.counters["active_prefill_legs"] == 0; },
        5s);
  }
  // The body a client sends: every field a leg keeps, changes or drops.
  static ordered_json ClientBody(bool chat, bool stream) {
    ordered_json b = {{"model", "m"}};
    if (chat) {
      b["messages"] = {{{"role", "user"}, {"content", "tell me a story"}}};
    } else {
      b["prompt"] = "once upon a time";
    }
    b["temperature"] = 0.5;
    b["max_tokens"] = 50;
    if (chat) b["max_completion_tokens"] = 50;
    b["min_tokens"] = 3;
    b["min_completion_tokens"] = 2;
    b["stream"] = stream;
    if (stream) b["stream_options"] = {{"include_usage", true}};
    b["logit_bias"] = {{"5", 1.5}};
    b["user"] = "u-1";
    return b;
  }
  // vLLM's prefill leg: the client's body changed exactly as protocol.md section 13 lists.
  static ordered_json NixlPrefillBody(ordered_json b) {
    b["kv_transfer_params"] = {{"do_remote_decode", true}, {"do_remote_prefill", false}, {"remote_engine_id", nullptr},
                               {"remote_block_ids", nullptr}, {"remote_host", nullptr},  {"remote_port", nullptr}};
    b["stream"] = false;
    b["max_tokens"] = 1;
    if (b.contains("max_completion_tokens")) b["max_completion_tokens"] = 1;
    b.erase("stream_options");
    b.erase("min_tokens");
    b.erase("min_completion_tokens");
    return b;
  }
  // The client's bytes unchanged, then the fields a leg adds.
  static std::string Appended(const std::string& client, const std::string& fields) {
    return client.substr(0, client.size() - 1) + "," + fields + "}";
  }
  static std::string Path(bool chat) { return chat ? "/v1/chat/completions" : "/v1/completions"; }
  // Posts a chat request that is answered 200 by `decode` (worker `id`) alone, its last request
  // being the client's body unchanged; returns the answer's body.
  std::string PostWholeToDecode(const std::string& client, PdEngine& decode, const std::string& id) {
    auto r = Post(client);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    if (!r.ok()) return "";
    EXPECT_EQ(r->status, 200) << r->body;
    EXPECT_EQ(HeaderOf(*r, "x-kvrouter-worker-id"), id);
    EXPECT_EQ(HeaderOf(*r, "x-kvrouter-prefill-worker-id"), "");
    EXPECT_GE(decode.requests(), 1u);
    if (decode.requests() > 0) {
      EXPECT_EQ(decode.seen(decode.requests() - 1).raw, client);
    }
    return r->body;
  }
  // Server-sent events' data lines.
  static std::vector<std::string> Events(const std::string& body) {
    std::vector<std::string> out;
    std::istringstream lines(body);
    for (std::string line; std::getline(lines, line);) {
      if (line.starts_with("data: ")) out.push_back(line.substr(6));
    }
    return out;
  }

  std::vector<std::unique_ptr<PdEngine>> pd_;
};

// The prefill leg's body as section 13 lists it, the decode leg's the client's plus the prefill
// answer's kv_transfer_params verbatim, one request id on both, and the client's answer the
// decode engine's with the prefill engine's cached_tokens and both workers in the headers.
TEST_F(GatewayDisaggTest, NixlLegsCarryEveryFieldAndThePlainAnswerHasThePrefillEnginesCachedTokens) {
  const Pair pair = AddNixlPair();  // named references: clang 14 captures no structured binding
  PdEngine &prefill = pair.prefill, &decode = pair.decode;
  ASSERT_TRUE(AwaitReady(2));
  for (const bool chat : {true, false}) {
    SCOPED_TRACE(chat ? "chat" : "completions");
    const std::size_t k = chat ? 0 : 1;
    const std::string client = ClientBody(chat, false).dump();
    auto r = Post(client, {{"x-request-id", "pd-1"}, {"traceparent", kTraceparent}, {"baggage", "tenant=a"}},
                  Path(chat));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_EQ(r->status, 200) << r->body;
    ASSERT_EQ(prefill.requests(), k + 1);
    ASSERT_EQ(decode.requests(), k + 1);
    const PdEngine::Seen p = prefill.seen(k), d = decode.seen(k);
    for (const PdEngine::Seen* leg : {&p, &d}) {  // the client's end-to-end headers on both legs
      EXPECT_EQ(leg->Header("traceparent"), kTraceparent);
      EXPECT_EQ(leg->Header("baggage"), "tenant=a");
    }
    EXPECT_EQ(HeaderOf(*r, "x-engine-role"), "decode");  // the answer's engine's headers come back
    EXPECT_EQ(p.path, Path(chat));
    EXPECT_EQ(d.path, Path(chat));
    EXPECT_EQ(ordered_json::parse(p.raw).dump(), NixlPrefillBody(ClientBody(chat, false)).dump());
    EXPECT_EQ(d.raw, Appended(client, "\"kv_transfer_params\":" + kTransferParams.dump()));
    EXPECT_EQ(p.request_id, "pd-1");
    EXPECT_EQ(d.request_id, "pd-1");
    // The decode engine's answer, but the prompt cache of the engine that prefilled it.
    ordered_json expected = decode.PlainAnswer(Path(chat));
    expected["usage"]["prompt_tokens_details"]["cached_tokens"] = 7;
    EXPECT_EQ(ordered_json::parse(r->body).dump(), expected.dump());
    EXPECT_EQ(HeaderOf(*r, "x-kvrouter-worker-id"), "2");
    EXPECT_EQ(HeaderOf(*r, "x-kvrouter-prefill-worker-id"), "1");
    EXPECT_EQ(HeaderOf(*r, "x-kvrouter-cached-tokens"), "0");  // the router saw no KV events
    EXPECT_EQ(HeaderOf(*r, "x-request-id"), "pd-1");
    EXPECT_TRUE(AwaitFreed());
  }
  EXPECT_EQ(Metric("kvgateway_disagg_requests_total{path=\"disaggregated\"}"), 2);
  EXPECT_EQ(Metric("kvgateway_prefill_leg_seconds_count"), 2);
  EXPECT_EQ(Metric("kvgateway_decode_wait_seconds_count"), 2);
  // A plain answer's first byte is its end: no mark_prefill (free says it all), so the router
  // learns no KV transfer time that is really the whole decode.
  auto stats = Stats();
  ASSERT_TRUE(stats);
  EXPECT_EQ(stats->counters["kv_transfers_observed"], 0u);
}

// A prefill engine's refusal is the client's answer, with that engine's headers (its
// Retry-After among them); no decode leg starts.
TEST_F(GatewayDisaggTest, APrefillEnginesRefusalComesBackWithItsRetryAfter) {
  const Pair pair = AddNixlPair();
  PdEngine &prefill = pair.prefill, &decode = pair.decode;
  prefill.set_mode(PdEngine::Mode::kBusy429);
  ASSERT_TRUE(AwaitReady(2));
  auto r = Post(ClientBody(true, false).dump(), {{"x-request-id", "pd-busy"}});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->status, 429) << r->body;
  EXPECT_EQ(HeaderOf(*r, "retry-after"), "3");
  EXPECT_EQ(HeaderOf(*r, "x-request-id"), "pd-busy");
  EXPECT_EQ(decode.requests(), 0u);
  EXPECT_TRUE(AwaitFreed());
}

// A streamed request: the prefill leg plain and without stream_options, the decode leg the
// client's (streamed) plus kv_transfer_params; prefill_done releases the prefill rank while the
// decode leg has not answered yet; the client gets the decode engine's events.
TEST_F(GatewayDisaggTest, NixlStreamedRequestSendsPrefillDoneBeforeTheDecodeLegAnswers) {
  const Pair pair = AddNixlPair();  // named references: clang 14 captures no structured binding
  PdEngine &prefill = pair.prefill, &decode = pair.decode;
  ASSERT_TRUE(AwaitReady(2));
  for (const bool chat : {true, false}) {
    SCOPED_TRACE(chat ? "chat" : "completions");
    const std::size_t k = chat ? 0 : 1;
    decode.HoldNext(1);
    const std::string client = ClientBody(chat, true).dump();
    auto answer = std::async(std::launch::async, [&] { return Post(client, {{"x-request-id", "pd-s"}}, Path(chat)); });
    ASSERT_TRUE(AwaitTrue([&] { return decode.held() == 1; }));
    // Booked on the decode rank only: the prefill part went with prefill_done (no decode byte yet).
    EXPECT_TRUE(AwaitStats(
        [](StatsReply& s) { return s.counters["active_requests"] == 1 && s.counters["active_prefill_legs"] == 0; },
        5s));
    decode.Release();
    auto r = answer.get();
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_EQ(r->status, 200) << r->body;
    EXPECT_EQ(HeaderOf(*r, "content-type"), "text/event-stream");
    EXPECT_EQ(HeaderOf(*r, "x-kvrouter-prefill-worker-id"), "1");
    const auto events = Events(r->body);
    ASSERT_EQ(events.size(), 4u) << r->body;
    EXPECT_NE(events[0].find("d0"), std::string::npos);
    EXPECT_EQ(events[3], "[DONE]");
    EXPECT_EQ(ordered_json::parse(prefill.seen(k).raw).dump(), NixlPrefillBody(ClientBody(chat, true)).dump());
    EXPECT_EQ(decode.seen(k).raw, Appended(client, "\"kv_transfer_params\":" + kTransferParams.dump()));
    EXPECT_EQ(prefill.seen(k).request_id, "pd-s");
    EXPECT_EQ(decode.seen(k).request_id, "pd-s");
    EXPECT_TRUE(AwaitFreed());
  }
  // The decode leg's first event is mark_prefill: the router learns each transfer's time.
  EXPECT_TRUE(AwaitStats([](StatsReply& s) { return s.counters["kv_transfers_observed"] == 2; }, 5s));
}

// The prefill engine stopped at its one token (no kv_transfer_params, absent or null): its answer
// is the client's, as it is for a plain request, and no decode leg starts.
TEST_F(GatewayDisaggTest, EosAtPrefillAnswersAPlainRequestWithThePrefillAnswer) {
  const Pair pair = AddNixlPair();  // named references: clang 14 captures no structured binding
  PdEngine &prefill = pair.prefill, &decode = pair.decode;
  ASSERT_TRUE(AwaitReady(2));
  for (const auto mode : {PdEngine::Mode::kEos, PdEngine::Mode::kEosNull}) {
    prefill.set_mode(mode);
    for (const bool chat : {true, false}) {
      auto r = Post(ClientBody(chat, false).dump(), {}, Path(chat));
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      ASSERT_EQ(r->status, 200) << r->body;
      EXPECT_EQ(r->body, prefill.PlainAnswer(Path(chat)).dump());
      EXPECT_EQ(HeaderOf(*r, "content-type"), "application/json");
      EXPECT_EQ(HeaderOf(*r, "x-kvrouter-prefill-worker-id"), "1");
    }
  }
  EXPECT_EQ(prefill.requests(), 4u);
  EXPECT_EQ(decode.requests(), 0u);
  EXPECT_TRUE(AwaitFreed());
}

// A prefill engine started without the NixlConnector answers its one token at "length" and names
// no KV: that token is not the client's answer. The leg counts as failed, the engine is routed
// away from, and the request goes whole to the decode engine (the router's fallback).
TEST_F(GatewayDisaggTest, APrefillEngineWithoutTheConnectorIsRetriedAwayFrom) {
  const Pair pair = AddNixlPair();  // named references: clang 14 captures no structured binding
  PdEngine &prefill = pair.prefill, &decode = pair.decode;
  prefill.set_mode(PdEngine::Mode::kNoConnector);
  ASSERT_TRUE(AwaitReady(2));
  const std::string client = ClientBody(true, false).dump();
  auto r = Post(client);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(prefill.requests(), 1u);
  ASSERT_EQ(decode.requests(), 1u);
  EXPECT_EQ(decode.seen(0).raw, client);  // whole: no kv_transfer_params
  EXPECT_EQ(json::parse(r->body)["id"], "cmpl-d");
  EXPECT_EQ(Metric("kvgateway_retries_total"), 1);
  EXPECT_TRUE(AwaitFreed());
}

// ... and a streamed client gets it as one chunk in its form (chat.completion.chunk with
// delta.content, or text_completion with text), the usage when it asked for it, then [DONE].
TEST_F(GatewayDisaggTest, EosAtPrefillAnswersAStreamedRequestWithOneChunkInItsForm) {
  const Pair pair = AddNixlPair();  // named references: clang 14 captures no structured binding
  PdEngine &prefill = pair.prefill, &decode = pair.decode;
  prefill.set_mode(PdEngine::Mode::kEos);
  ASSERT_TRUE(AwaitReady(2));
  for (const bool chat : {true, false}) {
    SCOPED_TRACE(chat ? "chat" : "completions");
    auto r = Post(ClientBody(chat, true).dump(), {}, Path(chat));  // stream_options.include_usage
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_EQ(r->status, 200) << r->body;
    EXPECT_EQ(HeaderOf(*r, "content-type"), "text/event-stream");
    const auto events = Events(r->body);
    ASSERT_EQ(events.size(), 3u) << r->body;
    const json chunk = json::parse(events[0]);
    EXPECT_EQ(chunk["object"], chat ? "chat.completion.chunk" : "text_completion");
    EXPECT_EQ(chunk["id"], "cmpl-p");
    EXPECT_EQ(chunk["model"], "m");
    ASSERT_EQ(chunk["choices"].size(), 1u);
    if (chat) {
      EXPECT_EQ(chunk["choices"][0]["delta"]["content"], "P");
      EXPECT_EQ(chunk["choices"][0]["delta"]["role"], "assistant");
    } else {
      EXPECT_EQ(chunk["choices"][0]["text"], "P");
    }
    EXPECT_EQ(chunk["choices"][0]["finish_reason"], "stop");
    const json usage = json::parse(events[1]);
    EXPECT_TRUE(usage["choices"].empty());
    EXPECT_EQ(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 7);
    EXPECT_EQ(events[2], "[DONE]");
  }
  // Without include_usage: the chunk and [DONE].
  json plain = ClientBody(true, true);
  plain.erase("stream_options");
  auto r = Post(plain.dump());
  ASSERT_TRUE(r.ok());
  const auto events = Events(r->body);
  ASSERT_EQ(events.size(), 2u) << r->body;
  EXPECT_EQ(events[1], "[DONE]");
  EXPECT_EQ(decode.requests(), 0u);
  EXPECT_TRUE(AwaitFreed());
}

// A prefill engine that refuses connections is excluded on the next route; with no other prefill
// engine the request goes whole to a decode engine (the router's fallback), the client's body
// unchanged.
TEST_F(GatewayDisaggTest, APrefillEngineRefusingConnectionsIsRetriedAwayFromAndTheFallbackIsLocal) {
  auto dead = PickFreePort();
  ASSERT_TRUE(dead.ok());
  AnnouncePd(1, fmt::format("http://127.0.0.1:{}", *dead), WorkerRole::kPrefill);
  PdEngine& decode = AddPd(2, WorkerRole::kDecode, 99);
  ASSERT_TRUE(AwaitReady(2));
  const std::string answer = PostWholeToDecode(ClientBody(true, false).dump(), decode, "2");
  // Its own cached_tokens: it prefilled the request itself.
  EXPECT_EQ(json::parse(answer)["usage"]["prompt_tokens_details"]["cached_tokens"], 99);
  EXPECT_EQ(Metric("kvgateway_disagg_requests_total{path=\"disaggregated\"}"), 1);
  EXPECT_EQ(Metric("kvgateway_disagg_requests_total{path=\"fallback\"}"), 1);
  EXPECT_EQ(Metric("kvgateway_retries_total"), 1);
  EXPECT_TRUE(AwaitFreed());
}

// A prefill engine answering 500 is retried away from: to another prefill engine when there is
// one, and every request is answered through a working one.
TEST_F(GatewayDisaggTest, APrefillEngineAnswering500IsRetriedAwayFrom) {
  PdEngine& bad = AddPd(1, WorkerRole::kPrefill, 7);
  bad.set_mode(PdEngine::Mode::kFail500);
  PdEngine& decode = AddPd(2, WorkerRole::kDecode, 99);
  ASSERT_TRUE(AwaitReady(2));
  auto r = Post(ClientBody(true, false).dump());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(bad.requests(), 1u);
  EXPECT_EQ(decode.requests(), 1u);  // no decode leg for the failed prefill
  EXPECT_EQ(HeaderOf(*r, "x-kvrouter-prefill-worker-id"), "");  // the fallback, whole
  PdEngine& good = AddPd(3, WorkerRole::kPrefill, 5);
  ASSERT_TRUE(AwaitReady(3));
  for (int i = 0; i < 4; ++i) {
    r = Post(ClientBody(true, false).dump());
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_EQ(r->status, 200) << r->body;
    EXPECT_EQ(HeaderOf(*r, "x-kvrouter-prefill-worker-id"), "3");
    EXPECT_EQ(json::parse(r->body)["usage"]["prompt_tokens_details"]["cached_tokens"], 5);
  }
  EXPECT_EQ(good.requests(), 4u);
  EXPECT_EQ(decode.requests(), 5u);
  EXPECT_EQ(Metric("kvgateway_retries_total"), static_cast<double>(bad.requests()));
  EXPECT_TRUE(AwaitFreed());
}

// A client that goes away while the prefill leg runs: the prefill engine sees its connection
// closed, no decode leg starts, and nothing stays booked.
TEST_F(GatewayDisaggTest, AClientGoneBetweenTheLegsClosesThePrefillLegAndStartsNoDecodeLeg) {
  const Pair pair = AddNixlPair();  // named references: clang 14 captures no structured binding
  PdEngine &prefill = pair.prefill, &decode = pair.decode;
  prefill.HoldNext(1);
  ASSERT_TRUE(AwaitReady(2));
  auto call = client_->Start(endpoint_,
                             {.target = "/v1/chat/completions",
                              .headers = {{"content-type", "application/json"}},
                              .body = ClientBody(true, true).dump()},
                             {});
  ASSERT_TRUE(AwaitTrue([&] { return prefill.held() == 1; }));
  EXPECT_TRUE(AwaitStats([](StatsReply& s) { return s.counters["active_prefill_legs"] == 1; }, 5s));
  call->Cancel();
  ASSERT_TRUE(AwaitTrue([&] { return prefill.seen(0).gone->load(); }));
  EXPECT_TRUE(AwaitFreed());
  prefill.Release();  // its answer goes nowhere: the connection is closed
  EXPECT_EQ(decode.requests(), 0u);
  EXPECT_EQ(Metric("kvgateway_clients_gone_total"), 1);
}

// SGLang: one body (the client's plus the bootstrap fields) to both engines at once: the decode
// engine has its request while the prefill engine has not answered. The prefill answer's end
// sends prefill_done; the client gets the decode answer with the prefill engine's cached_tokens.
TEST_F(GatewayDisaggTest, SglangLegsAreSentAtOnceWithTheBootstrapFields) {
  PdEngine& prefill = AddPd(1, WorkerRole::kPrefill, 6, KvConnector::kSglang, 9123);
  PdEngine& decode = AddPd(2, WorkerRole::kDecode, 99, KvConnector::kSglang);
  prefill.HoldNext(1);
  decode.HoldNext(1);
  ASSERT_TRUE(AwaitReady(2));
  const std::string client = ClientBody(true, false).dump();
  auto answer = std::async(std::launch::async,
                           [&] { return Post(client, {{"x-request-id", "sg-1"}, {"traceparent", kTraceparent}}); });
  ASSERT_TRUE(AwaitTrue([&] { return prefill.held() == 1 && decode.held() == 1; }))
      << "prefill " << prefill.requests() << ", decode " << decode.requests();
  const PdEngine::Seen p = prefill.seen(0), d = decode.seen(0);
  EXPECT_EQ(p.raw, d.raw);
  const json sent = json::parse(d.raw);
  ASSERT_TRUE(sent["bootstrap_room"].is_number_unsigned()) << d.raw;
  EXPECT_EQ(d.raw, Appended(client, fmt::format(R"("bootstrap_host":"127.0.0.1","bootstrap_port":9123,)"
                                                R"("bootstrap_room":{})",
                                                sent["bootstrap_room"].get<std::uint64_t>())));
  EXPECT_EQ(p.request_id, "sg-1");
  EXPECT_EQ(d.request_id, "sg-1");
  EXPECT_EQ(p.Header("traceparent"), kTraceparent);
  EXPECT_EQ(d.Header("traceparent"), kTraceparent);
  EXPECT_TRUE(AwaitStats([](StatsReply& s) { return s.counters["active_prefill_legs"] == 1; }, 5s));
  prefill.Release();  // its end: prefill_done, while the decode leg still runs
  EXPECT_TRUE(AwaitStats(
      [](StatsReply& s) { return s.counters["active_prefill_legs"] == 0 && s.counters["active_requests"] == 1; }, 5s));
  decode.Release();
  auto r = answer.get();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->status, 200) << r->body;
  ordered_json expected = decode.PlainAnswer("/v1/chat/completions");
  expected["usage"]["prompt_tokens_details"]["cached_tokens"] = 6;
  EXPECT_EQ(ordered_json::parse(r->body).dump(), expected.dump());
  EXPECT_EQ(HeaderOf(*r, "x-kvrouter-prefill-worker-id"), "1");
  EXPECT_EQ(HeaderOf(*r, "x-engine-role"), "decode");
  EXPECT_TRUE(AwaitFreed());
  EXPECT_EQ(Metric("kvgateway_prefill_leg_seconds_count"), 1);
}

// An SGLang prefill leg failing before the client has a byte closes the decode leg (which would
// wait for KV that never comes) and routes again: here whole to the decode engine.
TEST_F(GatewayDisaggTest, AFailingSglangPrefillLegClosesTheDecodeLegAndRetries) {
  PdEngine& prefill = AddPd(1, WorkerRole::kPrefill, 6, KvConnector::kSglang);
  PdEngine& decode = AddPd(2, WorkerRole::kDecode, 99, KvConnector::kSglang);
  prefill.set_mode(PdEngine::Mode::kFail500);
  prefill.HoldNext(1);  // its 500 comes once both legs are in
  decode.HoldNext(1);   // the first decode leg waits for its KV
  ASSERT_TRUE(AwaitReady(2));
  const std::string client = ClientBody(true, true).dump();
  auto posted = std::async(std::launch::async, [&] { return Post(client); });
  ASSERT_TRUE(AwaitTrue([&] { return prefill.held() == 1 && decode.held() == 1; }))
      << "prefill " << prefill.requests() << ", decode " << decode.requests();
  prefill.Release();  // 500
  auto r = posted.get();  // then whole to the decode engine
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(HeaderOf(*r, "x-kvrouter-worker-id"), "2");
  EXPECT_EQ(HeaderOf(*r, "x-kvrouter-prefill-worker-id"), "");
  ASSERT_EQ(decode.requests(), 2u);
  EXPECT_EQ(decode.seen(1).raw, client);
  EXPECT_TRUE(AwaitTrue([&] { return decode.seen(0).gone->load(); }));  // the first decode leg was closed
  EXPECT_NE(decode.seen(0).raw.find("bootstrap_room"), std::string::npos);
  EXPECT_EQ(Events(r->body).back(), "[DONE]");
  EXPECT_TRUE(AwaitFreed());
  decode.Release();
}

// A decode leg answering 500 after its prefill leg is retried away from: the pair is routed
// again, its decode rank elsewhere, and each answer comes through a working decode engine.
TEST_F(GatewayDisaggTest, ADecodeEngineAnswering500IsRetriedAwayFrom) {
  PdEngine& prefill = AddPd(1, WorkerRole::kPrefill, 7);
  PdEngine& bad = AddPd(2, WorkerRole::kDecode, 99);
  bad.set_mode(PdEngine::Mode::kFail500);
  PdEngine& good = AddPd(4, WorkerRole::kDecode, 99);
  ASSERT_TRUE(AwaitReady(3));
  for (int i = 0; i < 4; ++i) {
    auto r = Post(ClientBody(i % 2 == 0, false).dump(), {}, Path(i % 2 == 0));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_EQ(r->status, 200) << r->body;
    EXPECT_EQ(HeaderOf(*r, "x-kvrouter-worker-id"), "4");
    EXPECT_EQ(HeaderOf(*r, "x-kvrouter-prefill-worker-id"), "1");
  }
  EXPECT_EQ(good.requests(), 4u);
  EXPECT_GE(bad.requests(), 1u);  // the router tries it (all idle, equal)
  EXPECT_EQ(prefill.requests(), 4u + bad.requests());  // a prefill leg again for each retry
  EXPECT_EQ(Metric("kvgateway_retries_total"), static_cast<double>(bad.requests()));
  EXPECT_TRUE(AwaitFreed());
}

// Many disaggregated requests in a row, plain and streamed, chat and completions: each answered,
// nothing left booked. Prints how long the gateway took from each prefill answer to the decode
// engine's first byte, and to render and route (stand-in engines answer at once: the gateway's
// own steps, on loopback).
TEST_F(GatewayDisaggTest, TwoHundredRequestsInARowAreAnsweredAndLeaveNothingBooked) {
  const Pair pair = AddNixlPair();
  ASSERT_TRUE(AwaitReady(2));
  constexpr int kRequests = 200;
  for (int i = 0; i < kRequests; ++i) {
    const bool chat = i % 2 == 0, stream = i % 4 < 2;
    auto r = Post(ClientBody(chat, stream).dump(), {}, Path(chat));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_EQ(r->status, 200) << r->body;
  }
  EXPECT_EQ(pair.prefill.requests(), static_cast<std::size_t>(kRequests));
  EXPECT_EQ(pair.decode.requests(), static_cast<std::size_t>(kRequests));
  EXPECT_TRUE(AwaitFreed());
  EXPECT_EQ(Metric("kvgateway_decode_wait_seconds_count"), kRequests);
  for (const char* le : {"0.0005", "0.001", "0.0025"}) {
    std::printf("decode wait <= %s s: %.0f of %d; render and route <= %s s: %.0f\n", le,
                Metric(fmt::format("kvgateway_decode_wait_seconds_bucket{{le=\"{}\"}}", le)), kRequests, le,
                Metric(fmt::format("kvgateway_route_seconds_bucket{{le=\"{}\"}}", le)));
  }
}

// No router: a disaggregated fleet's request goes whole to the decode engine (the prefill pool
// is not for generating), its body unchanged, rendered by no one.
TEST_F(GatewayDisaggTest, WithoutARouterARequestGoesWholeToTheDecodeEngine) {
  const Pair pair = AddNixlPair();  // named references: clang 14 captures no structured binding
  PdEngine &prefill = pair.prefill, &decode = pair.decode;
  ASSERT_TRUE(AwaitReady(2));
  router_->Kill();
  ASSERT_TRUE(AwaitTrue([&] { return Metric("kvgateway_router_up") == 0; }));
  const std::size_t before = prefill.requests();
  for (int i = 0; i < 3; ++i) {  // the decode engine each time, however loaded the prefill one is
    auto r = Post(ClientBody(true, false).dump());
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->status, 200) << r->body;
    EXPECT_EQ(HeaderOf(*r, "x-kvrouter-worker-id"), "2");
    EXPECT_EQ(HeaderOf(*r, "x-kvrouter-fallback"), "least-loaded");
  }
  EXPECT_EQ(prefill.requests(), before);
  EXPECT_EQ(decode.seen(decode.requests() - 1).raw, ClientBody(true, false).dump());
  EXPECT_EQ(Metric("kvgateway_router_fallbacks_total"), 3);
}

class GatewayDisaggNeverTest : public GatewayDisaggTest {
 protected:
  std::vector<std::string> ExtraArgs() const override { return {"--router-disagg-policy", "never"}; }
};

// The router keeps the request off the prefill pool: it goes whole to a decode engine, the
// client's body unchanged, counted `local`.
TEST_F(GatewayDisaggNeverTest, ARequestTheRouterPrefillsLocallyGoesWholeToTheDecodeEngine) {
  const Pair pair = AddNixlPair();  // named references: clang 14 captures no structured binding
  PdEngine &prefill = pair.prefill, &decode = pair.decode;
  ASSERT_TRUE(AwaitReady(2));
  PostWholeToDecode(ClientBody(true, true).dump(), decode, "2");
  EXPECT_EQ(prefill.requests(), 0u);
  EXPECT_EQ(Metric("kvgateway_disagg_requests_total{path=\"local\"}"), 1);
  EXPECT_EQ(Metric("kvgateway_disagg_requests_total{path=\"disaggregated\"}"), 0);
  EXPECT_TRUE(AwaitFreed());
}

}  // namespace
}  // namespace kvrouter::testing
