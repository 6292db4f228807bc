// kvmocker's OpenAI HTTP face (docs/protocol.md section 11): the real binary with --http-port on
// free 127.0.0.1 ports against a real nats-server, asked with HttpClient: chat and completions,
// whole and streamed, render, tokenize, models, health, errors, the registration's http_url and
// models, the prefix cache seen in usage and in the KV events, a client that goes away, shutdown.
// (The parsing and rendering alone: tests/router/kvmocker/openai_face_test.cc.)
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <fmt/format.h>

#include <atomic>
#include <map>
#include <mutex>
#include <set>
#include <nlohmann/json.hpp>

#include "events/block_hash.h"
#include "events/event_codec.h"
#include "events/registration_codec.h"
#include "tests/integration/kvrouter_fixture.h"
#include "transport/http_client.h"
#include "transport/http_io.h"

namespace kvrouter::testing {
namespace {

using Json = nlohmann::json;

constexpr std::uint64_t kBase = 1000;  // worker ids 1000, 1001, ...
constexpr std::uint32_t kMockBs = 4;   // kvmocker's block size here
const std::string kModel = "mock-model";

// Sends `bytes` on a fresh connection to 127.0.0.1:port and reads until the server closes.
std::string RawExchange(int port, std::string_view bytes) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval tv{.tv_sec = 10, .tv_usec = 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  std::string out;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size())) {
    char buf[4096];
    for (ssize_t n; (n = ::recv(fd, buf, sizeof(buf), 0)) > 0;) out.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  return out;
}

// What a chat request with one user message renders to (protocol.md section 11); one token per byte.
std::string RenderedUser(const std::string& content) { return "<|user|>\n" + content + "\n<|assistant|>\n"; }
std::vector<std::uint32_t> ByteIds(std::string_view s) { return {s.begin(), s.end()}; }

Json ChatBody(const std::string& content, std::uint32_t max_tokens, bool stream = false) {
  Json body = {{"model", kModel},
               {"messages", Json::array({{{"role", "user"}, {"content", content}}})},
               {"max_tokens", max_tokens}};
  if (stream) {
    body["stream"] = true;
    body["stream_options"] = {{"include_usage", true}};
  }
  return body;
}

Json ParseJson(const std::string& s) {
  Json j = Json::parse(s, nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << s;
  return j;
}

// The "data: ..." payloads of a server-sent event stream, in order.
std::vector<std::string> SseData(const std::string& body) {
  std::vector<std::string> out;
  std::size_t pos = 0;
  while ((pos = body.find("data: ", pos)) != std::string::npos) {
    const std::size_t end = body.find("\n\n", pos);
    if (end == std::string::npos) break;
    out.push_back(body.substr(pos + 6, end - pos - 6));
    pos = end + 2;
  }
  return out;
}

// A streamed call's arrivals, recorded from HttpIo's thread.
struct StreamRecord {
  std::mutex mu;
  int status = 0;
  std::string body;
  std::vector<std::string> pieces;  // each on_data as it came
  std::atomic<bool> done{false};
  Status result;

  HttpCallbacks Callbacks() {
    return {.on_head =
                [this](int s, const HttpHeaders&) {
                  std::lock_guard g(mu);
                  status = s;
                },
            .on_data =
                [this](std::string_view d) {
                  std::lock_guard g(mu);
                  body.append(d);
                  pieces.emplace_back(d);
                },
            .on_done =
                [this](const Status& s) {
                  {
                    std::lock_guard g(mu);
                    result = s;
                  }
                  done = true;
                }};
  }
  std::string Body() {
    std::lock_guard g(mu);
    return body;
  }
  std::size_t Pieces() {
    std::lock_guard g(mu);
    return pieces.size();
  }
};

class KvMockerHttpTest : public NatsServerTest {
 protected:
  void SetUp() override {
    NatsServerTest::SetUp();
    if (HasFatalFailure()) return;
    nc_ = Connect({.name = "kvmocker-http-test", .send_asap = true});
    ASSERT_NE(nc_, nullptr);
    // Subscribed before kvmocker starts, so its first messages are seen.
    Listen(kComp + "instances", instances_);
    Listen(kComp + "kv-events", events_);
    ASSERT_TRUE(nc_->Flush(2s).ok());
  }

  void TearDown() override {
    if (mocker_) mocker_->Stop();
    io_.Stop();
    client_.reset();
    subs_.clear();
    nc_.reset();
    if (!log_.empty() && !HasFailure() && std::getenv("KVROUTER_KEEP_TEST_LOGS") == nullptr) {
      std::remove(log_.c_str());
    }
  }

  void Listen(const std::string& subject, std::vector<std::vector<std::byte>>& into) {
    auto sub = nc_->Subscribe(subject, "", [this, &into](const IncomingMessage& m) {
      std::lock_guard g(mu_);
      into.emplace_back(m.data.begin(), m.data.end());
    });
    ASSERT_TRUE(sub.ok()) << sub.status().ToString();
    subs_.push_back(std::move(sub).value());
  }

  // kvmocker with `workers` workers from id 1000, block size 4, 256 blocks, HTTP from a free port
  // run on 127.0.0.1 with model kModel, bodies up to 16 KiB, /metrics on a free port; waits until
  // every worker registered and its port answers.
  void StartMocker(std::vector<std::string> extra = {}, int workers = 1, double speedup = 10) {
    auto port = PickFreePortRun(workers);
    ASSERT_TRUE(port.ok()) << port.status().ToString();
    http_port_ = *port;
    log_ = LogPath("kvmocker-http");
    std::vector<std::string> args = {"--worker-id-base",
                                     std::to_string(kBase),
                                     "--num-workers",
                                     std::to_string(workers),
                                     "--block-size",
                                     std::to_string(kMockBs),
                                     "--num-gpu-blocks",
                                     "256",
                                     "--speedup-ratio",
                                     fmt::format("{}", speedup),
                                     "--heartbeat-ms",
                                     "100",
                                     "--lease-ms",
                                     "1000",
                                     "--http-port",
                                     std::to_string(http_port_),
                                     "--http-host",
                                     "127.0.0.1",
                                     "--model",
                                     kModel,
                                     "--http-max-body-bytes",
                                     "16384"};
    args.insert(args.end(), extra.begin(), extra.end());
    auto p = StartOnNats(KVMOCKER_BIN, nats_->url(), std::move(args), log_, Metrics::kOnFreePort);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    mocker_ = std::move(p->process);
    metrics_port_ = p->metrics_port;
    ASSERT_TRUE(WaitFor(
        [&] {
          std::set<std::uint64_t> seen;
          for (const auto& r : Registrations()) seen.insert(r.worker_id);
          return seen.size() == static_cast<std::size_t>(workers);
        },
        10s))
        << "kvmocker did not register; log:\n"
        << ReadFile(log_);
    for (int w = 0; w < workers; ++w) ASSERT_TRUE(CanConnect(http_port_ + w)) << ReadFile(log_);
  }

  HttpEndpoint Worker(int w = 0) const {
    return {.host = "127.0.0.1", .port = static_cast<std::uint16_t>(http_port_ + w)};
  }

  HttpClient::Response Post(const std::string& path, const std::string& body, int worker = 0,
                            HttpHeaders headers = {}) {
    auto r = client_->Fetch(Worker(worker), {.target = path, .headers = std::move(headers), .body = body});
    EXPECT_TRUE(r.ok()) << path << ": " << r.status().ToString() << "\n" << ReadFile(log_);
    return r.ok() ? std::move(r).value() : HttpClient::Response{};
  }
  HttpClient::Response Get(const std::string& path, int worker = 0) {
    auto r = client_->Fetch(Worker(worker), {.method = "GET", .target = path});
    EXPECT_TRUE(r.ok()) << path << ": " << r.status().ToString();
    return r.ok() ? std::move(r).value() : HttpClient::Response{};
  }

  std::vector<WorkerRegistration> Registrations() {
    std::lock_guard g(mu_);
    std::vector<WorkerRegistration> out;
    for (const auto& m : instances_) {
      auto r = DecodeWorkerRegistration(m);
      EXPECT_TRUE(r.ok()) << r.status().ToString();
      if (r.ok()) out.push_back(*r);
    }
    return out;
  }
  std::vector<KvEventBatch> Events() {
    std::lock_guard g(mu_);
    std::vector<KvEventBatch> out;
    for (const auto& m : events_) {
      auto b = DecodeDynamoEvent(m);
      EXPECT_TRUE(b.ok()) << b.status().ToString();
      if (b.ok()) out.push_back(std::move(b).value());
    }
    return out;
  }

  // The value of one line of kvmocker's /metrics ("" when absent).
  std::string Metric(const std::string& series) {
    auto m = HttpGet(metrics_port_, "/metrics");
    if (!m.ok()) return "";
    const std::string key = "\n" + series + " ";
    const std::size_t at = m->body.find(key);
    if (at == std::string::npos) return "";
    const std::size_t start = at + key.size();
    return m->body.substr(start, m->body.find('\n', start) - start);
  }

  std::unique_ptr<NatsClient> nc_;
  std::vector<std::unique_ptr<Subscription>> subs_;
  std::mutex mu_;
  std::vector<std::vector<std::byte>> instances_, events_;  // guarded by mu_
  std::unique_ptr<ChildProcess> mocker_;
  int http_port_ = 0;
  int metrics_port_ = 0;
  std::string log_;
  HttpIo io_{1};
  std::unique_ptr<HttpClient> client_ = std::make_unique<HttpClient>(io_, HttpClient::Options{});
};

TEST_F(KvMockerHttpTest, ChatCompletionAnswersWithUsageAndTheRouterSeesItsKvEvents) {
  StartMocker();
  const std::string content = "What is a KV cache?";
  const auto r = Post("/v1/chat/completions", ChatBody(content, 5).dump());
  ASSERT_EQ(r.status, 200) << r.body;
  const Json j = ParseJson(r.body);
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["model"], kModel);
  EXPECT_TRUE(j["id"].get<std::string>().starts_with("chatcmpl-")) << r.body;
  ASSERT_EQ(j["choices"].size(), 1u);
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(j["choices"][0]["message"]["content"].get<std::string>().size(), 5u);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  const std::string rendered = RenderedUser(content);
  EXPECT_EQ(j["usage"]["prompt_tokens"], rendered.size());
  EXPECT_EQ(j["usage"]["completion_tokens"], 5);
  EXPECT_EQ(j["usage"]["total_tokens"], rendered.size() + 5);
  EXPECT_EQ(j["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

  // The same engine published the prompt's blocks, hashed from the byte tokens.
  const auto local = ComputeLocalHashes(ByteIds(rendered), kMockBs);
  ASSERT_TRUE(WaitFor([&] { return !Events().empty(); }, 5s));
  const auto events = Events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].worker_id, kBase);
  const auto& stored = std::get<KvStored>(events[0].ops.at(0).data);
  ASSERT_EQ(stored.blocks.size(), local.size());
  for (std::size_t i = 0; i < local.size(); ++i) EXPECT_EQ(stored.blocks[i].tokens_hash, local[i]);
}

TEST_F(KvMockerHttpTest, TheSameLongPromptAgainFindsItsPrefixCached) {
  StartMocker();
  const std::string content(300, 'x');
  const std::string body = ChatBody(content, 1).dump();
  const Json first = ParseJson(Post("/v1/chat/completions", body).body);
  EXPECT_EQ(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  const Json second = ParseJson(Post("/v1/chat/completions", body).body);
  const std::size_t prompt = RenderedUser(content).size();
  EXPECT_EQ(second["usage"]["prompt_tokens"], prompt);
  EXPECT_GT(second["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  EXPECT_EQ(second["usage"]["prompt_tokens_details"]["cached_tokens"], prompt / kMockBs * kMockBs);
}

TEST_F(KvMockerHttpTest, StreamedChatSendsEachTokenAsTheEngineProducesIt) {
  // At speedup 1 each decode step takes about 6 ms: 100 tokens arrive over about 0.6 s.
  StartMocker({}, 1, /*speedup=*/1);
  StreamRecord rec;
  auto call = client_->Start(Worker(), {.target = "/v1/chat/completions", .body = ChatBody("hi", 100, true).dump()},
                             rec.Callbacks());
  ASSERT_TRUE(WaitFor([&] { return rec.Pieces() > 0; }, 10s));
  // The first chunk came, and the stream is still going.
  {
    std::lock_guard g(rec.mu);
    EXPECT_EQ(rec.status, 200);
    EXPECT_NE(rec.pieces[0].find("data: "), std::string::npos);
    EXPECT_EQ(rec.pieces[0].find("[DONE]"), std::string::npos) << "the whole stream came at once";
  }
  EXPECT_FALSE(rec.done.load());
  ASSERT_TRUE(WaitFor([&] { return rec.done.load(); }, 20s));
  EXPECT_TRUE(rec.result.ok()) << rec.result.ToString();
  EXPECT_GT(rec.Pieces(), 10u);  // written as they came, not at once

  const auto data = SseData(rec.Body());
  ASSERT_EQ(data.size(), 100u + 2u);  // a chunk per token, the usage chunk, [DONE]
  EXPECT_EQ(data.back(), "[DONE]");
  std::string text;
  for (std::size_t k = 0; k < 100; ++k) {
    const Json c = ParseJson(data[k]);
    EXPECT_EQ(c["object"], "chat.completion.chunk");
    EXPECT_EQ(c["choices"][0]["delta"].contains("role"), k == 0);
    text += c["choices"][0]["delta"]["content"].get<std::string>();
    if (k < 99) {
      EXPECT_TRUE(c["choices"][0]["finish_reason"].is_null());
    } else {
      EXPECT_EQ(c["choices"][0]["finish_reason"], "length");
    }
  }
  EXPECT_EQ(text.size(), 100u);
  const Json usage = ParseJson(data[100]);
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["completion_tokens"], 100);
  EXPECT_EQ(usage["usage"]["prompt_tokens"], RenderedUser("hi").size());
}

TEST_F(KvMockerHttpTest, CompletionsTakeAStringOrTokenIdsWholeOrStreamed) {
  StartMocker();
  const auto r = Post("/v1/completions", Json{{"model", kModel}, {"prompt", "hello"}, {"max_tokens", 3}}.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  const Json j = ParseJson(r.body);
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["choices"][0]["text"].get<std::string>().size(), 3u);
  EXPECT_EQ(j["usage"]["prompt_tokens"], 5);

  const auto ids = Post("/v1/completions", Json{{"model", kModel}, {"prompt", {7, 8, 9, 10, 11, 12}}}.dump());
  ASSERT_EQ(ids.status, 200) << ids.body;
  EXPECT_EQ(ParseJson(ids.body)["usage"]["prompt_tokens"], 6);
  EXPECT_EQ(ParseJson(ids.body)["usage"]["completion_tokens"], 16);  // the default max_tokens

  const auto s =
      Post("/v1/completions", Json{{"model", kModel}, {"prompt", "hello"}, {"max_tokens", 4}, {"stream", true}}.dump());
  ASSERT_EQ(s.status, 200) << s.body;
  const auto data = SseData(s.body);
  ASSERT_EQ(data.size(), 5u);  // no usage chunk unless asked
  for (std::size_t k = 0; k < 4; ++k) {
    const Json c = ParseJson(data[k]);
    EXPECT_EQ(c["object"], "text_completion");
    EXPECT_EQ(c["choices"][0]["text"].get<std::string>().size(), 1u);
  }
  EXPECT_EQ(data[4], "[DONE]");
}

TEST_F(KvMockerHttpTest, RenderTokenizeModelsAndHealth) {
  StartMocker();
  const std::string chat = ChatBody("hi", 1).dump();
  const auto render = Post("/v1/chat/completions/render", chat);
  ASSERT_EQ(render.status, 200) << render.body;
  EXPECT_EQ(ParseJson(render.body)["token_ids"].get<std::vector<std::uint32_t>>(), ByteIds(RenderedUser("hi")));

  const auto crender = Post("/v1/completions/render", Json{{"model", kModel}, {"prompt", "ab"}}.dump());
  ASSERT_EQ(crender.status, 200) << crender.body;
  EXPECT_EQ(ParseJson(crender.body)[0]["token_ids"].get<std::vector<std::uint32_t>>(), ByteIds("ab"));

  const auto tok = Post("/tokenize", chat);
  ASSERT_EQ(tok.status, 200) << tok.body;
  const Json t = ParseJson(tok.body);
  EXPECT_EQ(t["tokens"].get<std::vector<std::uint32_t>>(), ByteIds(RenderedUser("hi")));
  EXPECT_EQ(t["count"], RenderedUser("hi").size());
  EXPECT_EQ(t["max_model_len"], 256 * kMockBs);

  const auto models = Get("/v1/models");
  ASSERT_EQ(models.status, 200);
  const Json m = ParseJson(models.body);
  EXPECT_EQ(m["object"], "list");
  ASSERT_EQ(m["data"].size(), 1u);
  EXPECT_EQ(m["data"][0]["id"], kModel);
  EXPECT_EQ(m["data"][0]["object"], "model");
  EXPECT_EQ(m["data"][0]["owned_by"], "kvmocker");
  EXPECT_EQ(Get("/health").status, 200);
}

TEST_F(KvMockerHttpTest, ErrorsAreOpenAiShaped) {
  StartMocker();
  const auto expect_error = [&](const HttpClient::Response& r, int status, const std::string& code) {
    EXPECT_EQ(r.status, status) << r.body;
    const Json j = ParseJson(r.body);
    ASSERT_TRUE(j.contains("error")) << r.body;
    EXPECT_EQ(j["error"]["code"], code) << r.body;
    EXPECT_TRUE(j["error"]["message"].is_string());
    EXPECT_TRUE(j["error"]["type"].is_string());
  };
  Json other = ChatBody("hi", 1);
  other["model"] = "gpt-9";
  expect_error(Post("/v1/chat/completions", other.dump()), 404, "model_not_found");
  expect_error(Post("/v1/chat/completions", "{\"model\": "), 400, "invalid_argument");
  expect_error(Post("/v1/chat/completions", Json{{"model", kModel}}.dump()), 400, "invalid_argument");
  expect_error(Post("/v1/nothing", "{}"), 404, "not_found");
  expect_error(Get("/v1/chat/completions"), 405, "method_not_allowed");
  // Over --http-max-body-bytes (16 KiB): refused by the listener from the Content-Length, before
  // any of the body is sent, in the same shape.
  const std::string too_large =
      RawExchange(http_port_,
                  "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  "Content-Length: 20000\r\n\r\n");
  ASSERT_TRUE(too_large.starts_with("HTTP/1.1 413")) << too_large;
  expect_error({.status = 413, .body = too_large.substr(too_large.find("\r\n\r\n") + 4)}, 413, "body_too_large");
  // Over the context length (256 blocks of 4 tokens).
  expect_error(Post("/v1/completions", Json{{"model", kModel}, {"prompt", std::string(1025, 'x')}}.dump()), 400,
               "invalid_argument");
  // Still serving.
  EXPECT_EQ(Post("/v1/chat/completions", ChatBody("hi", 1).dump()).status, 200);
  EXPECT_EQ(Metric("kvmocker_http_requests_total"), "1");
}

TEST_F(KvMockerHttpTest, RegistrationsCarryEachWorkersHttpUrlAndTheModel) {
  StartMocker({}, 2);
  std::map<std::uint64_t, WorkerRegistration> by_worker;
  for (const auto& r : Registrations()) by_worker[r.worker_id] = r;
  ASSERT_EQ(by_worker.size(), 2u);
  for (int w = 0; w < 2; ++w) {
    const WorkerRegistration& r = by_worker[kBase + w];
    EXPECT_EQ(r.http_url, fmt::format("http://127.0.0.1:{}", http_port_ + w));
    EXPECT_EQ(r.models, std::vector<std::string>{kModel});
    // Each worker serves on its own port, with its own engine.
    const auto answer = Post("/v1/completions", Json{{"model", kModel}, {"prompt", "abcdefgh"}}.dump(), w);
    EXPECT_EQ(answer.status, 200) << answer.body;
  }
  ASSERT_TRUE(WaitFor([&] { return Events().size() >= 2; }, 5s));
  std::set<std::uint64_t> publishers;
  for (const auto& e : Events()) publishers.insert(e.worker_id);
  EXPECT_EQ(publishers, (std::set<std::uint64_t>{kBase, kBase + 1}));
}

TEST_F(KvMockerHttpTest, DataParallelRankHeaderPicksTheRank) {
  StartMocker({"--dp-size", "2"});
  const std::string body = Json{{"model", kModel}, {"prompt", "abcdefgh"}, {"max_tokens", 1}}.dump();
  EXPECT_EQ(Post("/v1/completions", body, 0, {{"x-data-parallel-rank", "1"}}).status, 200);
  EXPECT_EQ(Metric(fmt::format(R"(kvmocker_cached_blocks{{worker_id="{}",dp_rank="1"}})", kBase)), "2");
  EXPECT_EQ(Metric(fmt::format(R"(kvmocker_cached_blocks{{worker_id="{}",dp_rank="0"}})", kBase)), "0");
  EXPECT_EQ(Post("/v1/completions", body, 0, {{"x-data-parallel-rank", "2"}}).status, 400);
}

TEST_F(KvMockerHttpTest, AClientThatGoesAwayMidStreamLeavesTheEngine) {
  // One running request at most: had the abandoned one stayed, the next would wait for its 65,536
  // tokens (minutes at speedup 1).
  StartMocker({"--max-num-seqs", "1"}, 1, /*speedup=*/1);
  StreamRecord rec;
  auto call = client_->Start(Worker(),
                             {.target = "/v1/completions",
                              .body = Json{{"prompt", "abcdefgh"}, {"max_tokens", 65536}, {"stream", true}}.dump()},
                             rec.Callbacks());
  ASSERT_TRUE(WaitFor([&] { return rec.Pieces() > 0; }, 10s)) << ReadFile(log_);
  const std::string running = fmt::format(R"(kvmocker_running_requests{{worker_id="{}",dp_rank="0"}})", kBase);
  EXPECT_EQ(Metric(running), "1");
  call->Cancel();
  ASSERT_TRUE(WaitFor([&] { return rec.done.load(); }, 5s));
  ASSERT_TRUE(WaitFor([&] { return Metric(running) == "0" && Metric("kvmocker_requests_aborted_total") == "1"; }, 5s))
      << Metric(running) << " running, " << Metric("kvmocker_requests_aborted_total") << " aborted";
  EXPECT_EQ(Metric("kvmocker_outstanding_requests"), "0");
  // Its blocks stayed cached, and the engine serves the next request at once.
  const auto next = Post("/v1/completions", Json{{"prompt", "abcdefgh"}, {"max_tokens", 2}}.dump());
  ASSERT_EQ(next.status, 200) << next.body;
  EXPECT_EQ(ParseJson(next.body)["usage"]["prompt_tokens_details"]["cached_tokens"], 8);
}

TEST_F(KvMockerHttpTest, SigtermEndsAStreamWithAnErrorEventAndAnswersWaitingRequests503) {
  StartMocker({"--max-num-seqs", "1"}, 1, /*speedup=*/1);
  StreamRecord stream, waiting;
  auto s = client_->Start(
      Worker(),
      {.target = "/v1/completions", .body = Json{{"prompt", "abcd"}, {"max_tokens", 65536}, {"stream", true}}.dump()},
      stream.Callbacks());
  ASSERT_TRUE(WaitFor([&] { return stream.Pieces() > 0; }, 10s));
  // Waits behind the stream (one running request at most).
  auto w = client_->Start(Worker(), {.target = "/v1/completions", .body = Json{{"prompt", "efgh"}}.dump()},
                          waiting.Callbacks());
  ASSERT_TRUE(WaitFor(
      [&] { return Metric(fmt::format(R"(kvmocker_waiting_requests{{worker_id="{}",dp_rank="0"}})", kBase)) == "1"; },
      5s));

  mocker_->Stop(10s);  // its metrics server takes up to 2 s to stop, more under sanitizers
  ASSERT_TRUE(WIFEXITED(mocker_->exit_status())) << ReadFile(log_);
  EXPECT_EQ(WEXITSTATUS(mocker_->exit_status()), 0);
  ASSERT_TRUE(WaitFor([&] { return stream.done.load() && waiting.done.load(); }, 5s));
  const auto data = SseData(stream.Body());
  ASSERT_GE(data.size(), 3u);
  EXPECT_EQ(data.back(), "[DONE]");
  EXPECT_EQ(ParseJson(data[data.size() - 2])["error"]["code"], "unavailable");
  std::lock_guard g(waiting.mu);
  EXPECT_EQ(waiting.status, 503);
  EXPECT_EQ(ParseJson(waiting.body)["error"]["code"], "unavailable");
}

}  // namespace
}  // namespace kvrouter::testing
