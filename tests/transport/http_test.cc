// HttpListener and HttpClient on 127.0.0.1 (no server but their own): whole and streamed
// responses, the keep-alive pool, the limits checked before a body is read, slow and vanishing
// clients. A raw socket stands in for a hostile client.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tests/await.h"
#include "tests/black_hole.h"
#include "transport/http_client.h"
#include "transport/http_listener.h"

namespace kvrouter {
namespace {

using std::chrono::milliseconds;

// A plain TCP client: sends bytes as given, reads what comes until the server closes or `limit`.
class RawClient {
 public:
  explicit RawClient(std::uint16_t port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
    timeval tv{.tv_sec = 10, .tv_usec = 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  }
  ~RawClient() { ::close(fd_); }
  bool connected() const { return connected_; }
  void Send(std::string_view bytes) { ASSERT_EQ(::send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL), ssize_t(bytes.size())); }
  // Everything until the server closes the connection (or 10 s pass).
  std::string ReadAll() {
    std::string out;
    char buf[4096];
    for (;;) {
      const ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
      if (n <= 0) return out;
      out.append(buf, static_cast<std::size_t>(n));
    }
  }
  // Everything until `end` closes what came (or the server closes, or 10 s pass).
  std::string ReadAllUntil(std::string_view end) {
    std::string out;
    char buf[1 << 16];
    while (!out.ends_with(end)) {
      const ssize_t n = ::recv(fd_, buf, sizeof(buf), 0);
      if (n <= 0) return out;
      out.append(buf, static_cast<std::size_t>(n));
    }
    return out;
  }
  void Close() { ::shutdown(fd_, SHUT_RDWR); }
  int fd() const { return fd_; }

 private:
  int fd_ = -1;
  bool connected_ = false;
};

class HttpTest : public ::testing::Test {
 protected:
  void Listen(HttpListenerOptions o, HttpRequestHandler h) {
    o.host = "127.0.0.1";
    auto l = HttpListener::Start(io_, std::move(o), std::move(h));
    ASSERT_TRUE(l.ok()) << l.status().ToString();
    listener_ = std::move(l).value();
    endpoint_ = {.host = "127.0.0.1", .port = listener_->port()};
  }
  void TearDown() override {
    if (listener_) listener_->Stop();
    client_.reset();
    io_.Stop();
  }
  HttpIo io_{2};
  std::unique_ptr<HttpListener> listener_;
  std::unique_ptr<HttpClient> client_ = std::make_unique<HttpClient>(io_, HttpClient::Options{});
  HttpEndpoint endpoint_;
};

TEST(ParseHttpUrl, TakesHostAndPortAndRefusesAPathOrAnotherScheme) {
  auto e = ParseHttpUrl("http://10.0.0.7:8000/");
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->host, "10.0.0.7");
  EXPECT_EQ(e->port, 8000);
  EXPECT_EQ(ParseHttpUrl("http://engine")->port, 80);
  EXPECT_EQ(ParseHttpUrl("http://[::1]:9")->host, "::1");
  EXPECT_FALSE(ParseHttpUrl("https://engine:8000").ok());
  EXPECT_FALSE(ParseHttpUrl("http://engine:8000/v1").ok());
  EXPECT_FALSE(ParseHttpUrl("http://engine:0").ok());
  EXPECT_FALSE(ParseHttpUrl("http://:80").ok());
  EXPECT_EQ(ParseHttpUrl("HTTP://Engine:81")->port, 81);  // the scheme in any case
  EXPECT_FALSE(ParseHttpUrl("http://host:").ok());
  EXPECT_FALSE(ParseHttpUrl("http://user@host:80").ok());
  EXPECT_FALSE(ParseHttpUrl("http://::1").ok());          // IPv6 needs [ ]
  EXPECT_FALSE(ParseHttpUrl("http://host:80?x=1").ok());
  EXPECT_FALSE(ParseHttpUrl("http://host:80#f").ok());
  EXPECT_EQ(ParseHttpUrl("http://[::1]:8000")->Key(), "[::1]:8000");
  EXPECT_EQ(ParseHttpUrl("http://e:8000")->Key(), "e:8000");
}

TEST_F(HttpTest, AWholeResponseArrivesAndTheConnectionIsKeptForTheNextCall) {
  Listen({}, [](HttpRequest req, std::shared_ptr<HttpReply> reply) {
    reply->Send(200, {{"content-type", "text/plain"}, {"x-echo", req.method + " " + req.target}}, "body:" + req.body);
  });
  for (int i = 0; i < 3; ++i) {
    auto r = client_->Fetch(endpoint_, {.target = "/v1/x?y=1", .body = "hi"});
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->status, 200);
    EXPECT_EQ(r->body, "body:hi");
    bool echoed = false;
    for (const auto& [k, v] : r->headers) echoed |= k == "x-echo" && v == "POST /v1/x?y=1";
    EXPECT_TRUE(echoed);
  }
  EXPECT_EQ(client_->counters().connects, 1u);
  EXPECT_EQ(client_->counters().reused, 2u);
  EXPECT_EQ(listener_->counters().connections, 1u);
}

// The client writes the request head itself: every header given goes out as given (a repeated
// one twice), with Host and the body's length; a line break in a header fails the call and sends
// nothing.
TEST_F(HttpTest, TheRequestHeadCarriesEveryHeaderAndALineBreakInOneFailsTheCallUnsent) {
  std::atomic<int> served{0};
  HttpHeaders seen;
  std::mutex mu;
  Listen({}, [&](HttpRequest req, std::shared_ptr<HttpReply> reply) {
    ++served;
    {
      std::lock_guard g(mu);
      seen = req.headers;
    }
    reply->Send(200, {}, req.body);
  });
  auto r = client_->Fetch(
      endpoint_,
      {.target = "/h", .headers = {{"x-a", "1"}, {"x-a", "2"}, {"traceparent", "00-ab"}}, .body = "twelve bytes"});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->body, "twelve bytes");
  {
    std::lock_guard g(mu);
    auto count = [&](std::string_view name, std::string_view value) {
      return std::count_if(seen.begin(), seen.end(),
                           [&](const auto& h) { return h.first == name && h.second == value; });
    };
    EXPECT_EQ(count("x-a", "1"), 1);
    EXPECT_EQ(count("x-a", "2"), 1);
    EXPECT_EQ(count("traceparent", "00-ab"), 1);
    EXPECT_EQ(count("content-length", "12"), 1);
    EXPECT_EQ(count("host", endpoint_.Key()), 1);
  }
  auto bad = client_->Fetch(endpoint_, {.target = "/h", .headers = {{"x-b", "1\r\nx-injected: 1"}}});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(served.load(), 1);
}

// A whole response's head is written by the listener: its headers as given, a header with a
// line break left out (it would split the head), the body's length, Connection as HTTP/1.0 needs.
TEST_F(HttpTest, AWholeResponsesHeadCarriesItsHeadersAndLeavesOutOneWithALineBreak) {
  Listen({.server_name = "unit"}, [](HttpRequest, std::shared_ptr<HttpReply> reply) {
    reply->Send(201, {{"x-good", "1"}, {"x-bad", "1\r\nx-injected: 1"}}, "made");
  });
  RawClient c(listener_->port());
  ASSERT_TRUE(c.connected());
  c.Send("GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n");
  const std::string got = c.ReadAllUntil("made");
  EXPECT_TRUE(got.starts_with("HTTP/1.0 201 Created\r\nServer: unit\r\n")) << got;
  EXPECT_NE(got.find("\r\nx-good: 1\r\n"), std::string::npos) << got;
  EXPECT_EQ(got.find("x-bad"), std::string::npos) << got;
  EXPECT_EQ(got.find("x-injected"), std::string::npos) << got;
  EXPECT_NE(got.find("\r\nConnection: keep-alive\r\n"), std::string::npos) << got;
  EXPECT_TRUE(got.ends_with("Content-Length: 4\r\n\r\nmade")) << got;
}

// A proxy's request is served on its client connection's thread: a call started there runs its
// callbacks there, and so does a task deferred to the reply (the gateway's route answer), for
// every connection, whichever loop it is on.
TEST_F(HttpTest, ACallStartedOnAConnectionsThreadAndADeferredTaskRunThere) {
  std::mutex mu;
  std::vector<std::string> wrong;  // what ran elsewhere than its connection's thread
  Listen({}, [&](HttpRequest req, std::shared_ptr<HttpReply> reply) {
    if (req.target == "/inner") return reply->Send(200, {}, "inner");
    const std::thread::id here = std::this_thread::get_id();
    auto check = [&mu, &wrong, here](const char* what) {
      if (std::this_thread::get_id() == here) return;
      std::lock_guard g(mu);
      wrong.push_back(what);
    };
    auto body = std::make_shared<std::string>();
    client_->Start(endpoint_, {.target = "/inner"},
                   {.on_head = [check](int, const HttpHeaders&) { check("on_head"); },
                    .on_data =
                        [check, body](std::string_view d) {
                          check("on_data");
                          body->append(d);
                        },
                    .on_done =
                        [check, body, reply](const Status& s) {
                          check("on_done");
                          reply->Defer([check, body, reply, ok = s.ok()] {
                            check("deferred");
                            reply->Send(ok ? 200 : 502, {}, "outer:" + *body);
                          });
                        }});
  });
  // Several connections at once, over both loops.
  std::vector<std::thread> clients;
  std::atomic<int> answered{0};
  for (int c = 0; c < 4; ++c) {
    clients.emplace_back([&] {
      HttpClient own(io_, {});
      for (int i = 0; i < 20; ++i) {
        auto r = own.Fetch(endpoint_, {.target = "/outer"});
        if (r.ok() && r->status == 200 && r->body == "outer:inner") ++answered;
      }
    });
  }
  for (auto& t : clients) t.join();
  EXPECT_EQ(answered.load(), 80);
  std::lock_guard g(mu);
  EXPECT_TRUE(wrong.empty()) << wrong.size() << " callbacks off their connection's thread, first: " << wrong.front();
}

// Regression: a stale readiness of the socket (an edge for bytes already read) once passed for a
// client that went away, and closed busy keep-alive connections now and then (a few in 10,000
// requests: this test caught it in about one run of three).
TEST_F(HttpTest, BackToBackRequestsKeepTheirConnections) {
  // A request with a body: the listener reads a header and a body, as the engines' clients send.
  Listen({}, [](HttpRequest, std::shared_ptr<HttpReply> r) { r->Send(200, {}, "ok"); });
  std::vector<std::thread> clients;
  std::atomic<int> failed{0};
  for (int c = 0; c < 4; ++c) {
    clients.emplace_back([&] {
      for (int i = 0; i < 3000; ++i) {
        auto r = client_->Fetch(endpoint_, {.target = "/", .body = "{\"n\":1}"});
        if (!r.ok() || r->status != 200) ++failed;
      }
    });
  }
  for (auto& t : clients) t.join();
  EXPECT_EQ(failed.load(), 0);
  EXPECT_EQ(client_->counters().retried, 0u);      // no pooled connection was found closed
  EXPECT_LE(listener_->counters().connections, 4u);  // one per client, kept throughout
  EXPECT_EQ(listener_->counters().clients_gone, 0u);
}

// Reply calls handed from thread to thread take effect in the order they were made: a call on the
// connection's loop made behind a waiting one, then calls another thread makes after it.
TEST_F(HttpTest, ReplyCallsHandedFromThreadToThreadTakeEffectInTheirOrder) {
  Listen({}, [](HttpRequest, std::shared_ptr<HttpReply> reply) {
    std::thread([&] { reply->Begin(200, {}); }).join();  // waits for the loop (busy here)
    reply->Write("a");                                   // on the loop, behind it
    std::thread([&] {
      reply->Write("b");
      reply->End();
    }).join();
  });
  for (int i = 0; i < 20; ++i) {
    auto r = client_->Fetch(endpoint_, {.target = "/"});
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->body, "ab") << "request " << i;
  }
}

TEST_F(HttpTest, AStreamedResponseReachesTheClientChunkByChunkNotWhole) {
  std::shared_ptr<HttpReply> held;
  std::mutex mu;
  Listen({}, [&](HttpRequest, std::shared_ptr<HttpReply> reply) {
    reply->Begin(200, {{"content-type", "text/event-stream"}});
    reply->Write("data: one\n\n");
    std::lock_guard g(mu);
    held = std::move(reply);  // the rest comes when the test says
  });
  std::mutex got_mu;
  std::string got;
  std::atomic<bool> done{false};
  client_->Start(endpoint_, {.target = "/stream"},
                 {.on_data = [&](std::string_view d) {
                    std::lock_guard g(got_mu);
                    got.append(d);
                  },
                  .on_done = [&](const Status& s) {
                    EXPECT_TRUE(s.ok()) << s.ToString();
                    done = true;
                  }});
  // The first event arrives while the response is still open.
  ASSERT_TRUE(AwaitTrue([&] {
    std::lock_guard g(got_mu);
    return got == "data: one\n\n";
  }));
  EXPECT_FALSE(done.load());
  {
    std::lock_guard g(mu);
    held->Write("data: two\n\n");
    held->End();
  }
  ASSERT_TRUE(AwaitTrue([&] { return done.load(); }));
  std::lock_guard g(got_mu);
  EXPECT_EQ(got, "data: one\n\ndata: two\n\n");
}

TEST_F(HttpTest, ABodyAnnouncedOverTheLimitIsRefusedBeforeItIsRead) {
  std::atomic<int> handled{0};
  Listen({.max_body_bytes = 1000}, [&](HttpRequest, std::shared_ptr<HttpReply> r) {
    ++handled;
    r->Send(200, {}, "");
  });
  RawClient c(listener_->port());
  ASSERT_TRUE(c.connected());
  c.Send("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n");
  const std::string answer = c.ReadAll();  // no body sent: the refusal cannot have waited for it
  EXPECT_TRUE(answer.starts_with("HTTP/1.1 413")) << answer;
  EXPECT_EQ(handled.load(), 0);
  EXPECT_EQ(listener_->counters().bad_requests, 1u);
}

// A client that writes its whole body before it reads (as many HTTP clients do) must still
// read the 413: a close with its bytes unread would reset the connection under its writes.
TEST_F(HttpTest, AClientStillUploadingABodyFarOverTheLimitReadsTheWhole413) {
  Listen({.max_body_bytes = 1000,
          .error_body = [](int, std::string_view) {
            return std::pair<std::string, std::string>("application/json", std::string(2000, 'e'));
          }},
         [](HttpRequest, std::shared_ptr<HttpReply> r) { r->Send(200, {}, ""); });
  constexpr std::size_t kBody = 32 << 20;  // far past both ends' socket buffers
  RawClient c(listener_->port());
  ASSERT_TRUE(c.connected());
  c.Send(fmt::format("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n", kBody));
  const std::string piece(1 << 20, 'a');
  for (std::size_t sent = 0; sent < kBody; sent += piece.size()) {
    ASSERT_EQ(::send(c.fd(), piece.data(), piece.size(), MSG_NOSIGNAL), ssize_t(piece.size())) << "cut at " << sent;
  }
  const std::string a = c.ReadAll();
  EXPECT_TRUE(a.starts_with("HTTP/1.1 413")) << a.substr(0, 200);
  EXPECT_TRUE(a.ends_with(std::string(2000, 'e'))) << a.size();
  EXPECT_EQ(listener_->counters().bad_requests, 1u);
}

// The linger is bounded: a client that goes on sending after the answer is closed once
// linger_max_bytes of it were read (and, by linger_timeout, one that sends nothing more).
TEST_F(HttpTest, ALingerEndsAfterItsBytesOrItsTime) {
  Listen({.max_body_bytes = 10, .linger_timeout = milliseconds(300), .linger_max_bytes = 1 << 20},
         [](HttpRequest, std::shared_ptr<HttpReply> r) { r->Send(200, {}, ""); });
  {
    RawClient c(listener_->port());
    c.Send("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n");
    const std::string piece(64 << 10, 'a');
    bool cut = false;
    for (int i = 0; i < 1600 && !cut; ++i) {  // 100 MiB at most
      cut = ::send(c.fd(), piece.data(), piece.size(), MSG_NOSIGNAL) < 0;
    }
    EXPECT_TRUE(cut);  // reset once the linger's bytes were read
  }
  {
    RawClient c(listener_->port());
    c.Send("GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(20000, 'a') + "\r\n\r\n");
    EXPECT_TRUE(c.ReadAll().starts_with("HTTP/1.1 431"));  // the FIN ends the read
    // The client keeps its end open and sends nothing: the listener closes after the linger time.
    EXPECT_TRUE(AwaitTrue([&] { return listener_->counters().open == 0; }));
  }
}

// Drain: no connection is accepted, an idle one is closed, and a streamed response under way
// finishes (its connection closing after it).
TEST_F(HttpTest, DrainFinishesTheResponseUnderWayAndRefusesNewConnections) {
  std::shared_ptr<HttpReply> held;
  std::mutex held_mu;
  Listen({}, [&](HttpRequest req, std::shared_ptr<HttpReply> r) {
    if (req.Path() == "/late") return r->Send(200, {}, req.body);
    r->Begin(200, {{"content-type", "text/event-stream"}});
    r->Write("one ");
    std::lock_guard g(held_mu);
    held = std::move(r);
  });
  std::mutex got_mu;
  std::string got;
  std::atomic<bool> done{false};
  Status end;
  auto call = client_->Start(endpoint_, {.target = "/"},
                             {.on_data =
                                  [&](std::string_view d) {
                                    std::lock_guard g(got_mu);
                                    got.append(d);
                                  },
                              .on_done =
                                  [&](const Status& s) {
                                    end = s;
                                    done = true;
                                  }});
  ASSERT_TRUE(AwaitTrue([&] {
    std::lock_guard g(got_mu);
    return got == "one ";
  }));
  RawClient idle(listener_->port());
  ASSERT_TRUE(idle.connected());
  // Its headers came, its body (after 100 Continue) has not yet: a request under way.
  RawClient expecting(listener_->port());
  expecting.Send("POST /late HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n");
  char cont[25] = {};
  ASSERT_GT(::recv(expecting.fd(), cont, sizeof(cont) - 1, 0), 0);  // HTTP/1.1 100 Continue
  ASSERT_TRUE(AwaitTrue([&] { return listener_->counters().open == 3; }));
  listener_->Drain();
  EXPECT_FALSE(RawClient(listener_->port()).connected());
  EXPECT_EQ(idle.ReadAll(), "");  // closed without a word: it had asked nothing
  expecting.Send("hello");
  const std::string late = expecting.ReadAll();  // answered, and closed after it
  EXPECT_NE(late.find("HTTP/1.1 200"), std::string::npos) << late;
  EXPECT_NE(late.find("Connection: close"), std::string::npos) << late;
  EXPECT_FALSE(listener_->AwaitClosed(milliseconds(100)));  // the stream is still under way
  {
    std::lock_guard g(held_mu);
    held->Write("two");
    held->End();
    held.reset();
  }
  ASSERT_TRUE(AwaitTrue([&] { return done.load(); }));
  EXPECT_TRUE(end.ok()) << end.ToString();
  {
    std::lock_guard g(got_mu);
    EXPECT_EQ(got, "one two");
  }
  EXPECT_TRUE(listener_->AwaitClosed(milliseconds(10'000)));
  EXPECT_EQ(listener_->counters().open, 0u);
}

// After a burst (release_memory_burst requests under way at once) the allocator's free memory
// goes back once no request has been under way for release_memory_after, once; requests one at
// a time never make a burst.
TEST_F(HttpTest, FreeMemoryIsReturnedOnceAfterABurstAndNeverForRequestsOneAtATime) {
  std::mutex held_mu;
  std::vector<std::shared_ptr<HttpReply>> held;
  Listen({.release_memory_after = milliseconds(50), .release_memory_burst = 4},
         [&](HttpRequest req, std::shared_ptr<HttpReply> r) {
           if (req.Path() == "/one") return r->Send(200, {}, "");
           std::lock_guard g(held_mu);
           held.push_back(std::move(r));
         });
  auto one_at_a_time = [&] {
    for (int i = 0; i < 8; ++i) {
      auto r = client_->Fetch(endpoint_, {.target = "/one"});
      ASSERT_TRUE(r.ok()) << r.status().ToString();
    }
    // What is not to happen cannot be awaited: four times the release's wait.
    std::this_thread::sleep_for(milliseconds(200));
  };
  one_at_a_time();
  EXPECT_EQ(listener_->counters().memory_releases, 0u);
  std::atomic<int> done{0};
  for (int i = 0; i < 4; ++i) client_->Start(endpoint_, {.target = "/held"}, {.on_done = [&](const Status&) { ++done; }});
  // Every one held (the listener counts a request under way just before its handler runs).
  ASSERT_TRUE(AwaitTrue([&] {
    std::lock_guard g(held_mu);
    return held.size() == 4;
  }));
  EXPECT_EQ(listener_->counters().under_way, 4u);
  EXPECT_EQ(listener_->counters().memory_releases, 0u);  // not while the burst is under way
  {
    std::lock_guard g(held_mu);
    for (auto& r : held) r->Send(200, {}, "ok");
    held.clear();
  }
  ASSERT_TRUE(AwaitTrue([&] { return done.load() == 4; }));
  EXPECT_TRUE(AwaitTrue([&] { return listener_->counters().memory_releases == 1; }));
  EXPECT_EQ(listener_->counters().under_way, 0u);
  one_at_a_time();
  EXPECT_EQ(listener_->counters().memory_releases, 1u);
}

TEST_F(HttpTest, AChunkedBodyGrowingPastTheLimitIs413) {
  Listen({.max_body_bytes = 10}, [&](HttpRequest, std::shared_ptr<HttpReply> r) { r->Send(200, {}, ""); });
  RawClient c(listener_->port());
  c.Send("POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n20\r\n" + std::string(32, 'a') + "\r\n0\r\n\r\n");
  EXPECT_TRUE(c.ReadAll().starts_with("HTTP/1.1 413"));
}

TEST_F(HttpTest, OversizedHeadersAre431AndMalformedChunksAre400WithTheConfiguredBody) {
  Listen({.max_header_bytes = 1024,
          .error_body = [](int status, std::string_view) {
            return std::pair<std::string, std::string>("application/json", fmt::format("{{\"status\":{}}}", status));
          }},
         [](HttpRequest, std::shared_ptr<HttpReply> r) { r->Send(200, {}, ""); });
  {
    RawClient c(listener_->port());
    c.Send("GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(4096, 'a') + "\r\n\r\n");
    const std::string a = c.ReadAll();
    EXPECT_TRUE(a.starts_with("HTTP/1.1 431")) << a;
    EXPECT_NE(a.find("{\"status\":431}"), std::string::npos);
  }
  {
    RawClient c(listener_->port());
    c.Send("POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n");
    EXPECT_TRUE(c.ReadAll().starts_with("HTTP/1.1 400"));
  }
  EXPECT_EQ(listener_->counters().requests, 0u);
}

TEST_F(HttpTest, AClientSlowToSendItsHeadersIsCutOff) {
  Listen({.header_timeout = milliseconds(200)}, [](HttpRequest, std::shared_ptr<HttpReply> r) { r->Send(200, {}, ""); });
  RawClient c(listener_->port());
  c.Send("GET / HTTP/1.1\r\nHost:");  // and nothing more
  EXPECT_EQ(c.ReadAll(), "");         // closed without an answer
  // The stream closes the socket as its timer fires; the count follows on the io thread.
  EXPECT_TRUE(AwaitTrue([&] { return listener_->counters().timeouts == 1; }));
}

TEST_F(HttpTest, AClientThatGoesAwayMidResponseIsReportedOnce) {
  std::atomic<int> gone{0};
  std::shared_ptr<HttpReply> held;
  std::atomic<bool> begun{false};
  Listen({}, [&](HttpRequest, std::shared_ptr<HttpReply> r) {
    r->OnClientGone([&] { ++gone; });
    r->Begin(200, {});
    r->Write("partial");
    held = r;
    begun = true;
  });
  std::atomic<bool> got_data{false};
  auto call = client_->Start(endpoint_, {.target = "/"}, {.on_data = [&](std::string_view) { got_data = true; }});
  ASSERT_TRUE(AwaitTrue([&] { return got_data.load(); }));
  call->Cancel();
  ASSERT_TRUE(AwaitTrue([&] { return gone.load() == 1; }));
  EXPECT_EQ(listener_->counters().clients_gone, 1u);
  held->Write("more");  // into a closed connection: ignored
  held->End();
  EXPECT_EQ(gone.load(), 1);
}

TEST_F(HttpTest, StopCancelsTheCallsInFlightAndFreesThePortAtOnce) {
  std::vector<std::shared_ptr<HttpReply>> held;
  std::mutex mu;
  Listen({}, [&](HttpRequest, std::shared_ptr<HttpReply> r) {
    std::lock_guard g(mu);
    held.push_back(std::move(r));  // never answered
  });
  std::atomic<int> done{0};
  Status last;
  std::mutex last_mu;
  for (int i = 0; i < 3; ++i) {
    client_->Start(endpoint_, {.target = "/"}, {.on_done = [&](const Status& s) {
                     std::lock_guard g(last_mu);
                     last = s;
                     ++done;
                   }});
  }
  ASSERT_TRUE(AwaitTrue([&] {
    std::lock_guard g(mu);
    return held.size() == 3;
  }));
  client_->Stop();
  EXPECT_EQ(done.load(), 3);  // every call ended before Stop returned
  {
    std::lock_guard g(last_mu);
    EXPECT_NE(last.message().find("cancelled"), std::string::npos);
  }
  const std::uint16_t port = listener_->port();
  listener_->Stop();
  EXPECT_EQ(listener_->port(), port);
  // The port is free again as soon as Stop returned.
  auto again = HttpListener::Start(io_, {.host = "127.0.0.1", .port = port}, [](HttpRequest, std::shared_ptr<HttpReply>) {});
  EXPECT_TRUE(again.ok()) << again.status().ToString();
  if (again.ok()) (*again)->Stop();
  std::lock_guard g(mu);
  held.clear();
}

TEST_F(HttpTest, Expect100ContinueIsAnsweredBeforeTheBody) {
  Listen({}, [](HttpRequest req, std::shared_ptr<HttpReply> r) { r->Send(200, {}, req.body); });
  RawClient c(listener_->port());
  c.Send("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n");
  c.Send("hello");
  const std::string a = c.ReadAll();
  EXPECT_TRUE(a.starts_with("HTTP/1.1 100 Continue")) << a;
  EXPECT_NE(a.find("HTTP/1.1 200"), std::string::npos);
  EXPECT_TRUE(a.ends_with("hello"));
}

TEST_F(HttpTest, AConnectionRefusedEndsTheCallWithAnError) {
  Listen({}, [](HttpRequest, std::shared_ptr<HttpReply> r) { r->Send(200, {}, ""); });
  const std::uint16_t port = listener_->port();
  listener_->Stop();
  listener_.reset();
  ASSERT_TRUE(AwaitTrue([&] { return !RawClient(port).connected(); }));
  auto r = client_->Fetch({.host = "127.0.0.1", .port = port}, {.target = "/"});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInternal);
  EXPECT_EQ(client_->counters().failed, 1u);
}

TEST_F(HttpTest, APooledConnectionTheServerClosedIsReplacedOnce) {
  Listen({.idle_timeout = milliseconds(100)}, [](HttpRequest, std::shared_ptr<HttpReply> r) { r->Send(200, {}, "ok"); });
  ASSERT_TRUE(client_->Fetch(endpoint_, {.target = "/"}).ok());
  // The listener drops the idle connection; the pooled one is dead when the next call takes it.
  ASSERT_TRUE(AwaitTrue([&] { return listener_->counters().open == 0; }));
  auto r = client_->Fetch(endpoint_, {.target = "/"});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->body, "ok");
  EXPECT_EQ(client_->counters().retried, 1u);
  EXPECT_EQ(client_->counters().connects, 2u);
}

TEST_F(HttpTest, AConnectToAHostThatDropsPacketsFailsWithinTheConnectTimeoutAsNotDelivered) {
  BlackHole hole;
  ASSERT_TRUE(hole.ok());
  const auto start = std::chrono::steady_clock::now();
  auto r = client_->Fetch({.host = "127.0.0.1", .port = hole.port()},
                          {.target = "/", .connect_timeout = milliseconds(200), .head_timeout = milliseconds(30'000)});
  const auto took = std::chrono::steady_clock::now() - start;
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInternal) << r.status().ToString();  // not delivered: another may take it
  EXPECT_NE(r.status().message().find("within 200 ms"), std::string::npos) << r.status().ToString();
  EXPECT_GE(took, milliseconds(200));
  EXPECT_LT(took, milliseconds(5'000));
}

TEST_F(HttpTest, AHeadLateForADeliveredRequestIsATimeoutNotAConnectFailure) {
  std::mutex mu;
  std::vector<std::shared_ptr<HttpReply>> held;
  Listen({}, [&](HttpRequest, std::shared_ptr<HttpReply> r) {
    std::lock_guard g(mu);
    held.push_back(std::move(r));  // the generation goes on past the head timeout
  });
  auto r = client_->Fetch(endpoint_, {.target = "/", .body = "long", .head_timeout = milliseconds(200)});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kTimeout) << r.status().ToString();
  std::lock_guard g(mu);
  EXPECT_EQ(held.size(), 1u);
}

// A client that closes as soon as it has its response: the connection closes then, not at the
// idle timeout, whatever the order in which the server sees the close and its write's end.
TEST_F(HttpTest, AClientClosingRightAfterItsResponseHasItsConnectionClosedAtOnce) {
  Listen({}, [](HttpRequest, std::shared_ptr<HttpReply> r) { r->Send(200, {}, "ok"); });
  for (int i = 0; i < 500; ++i) {
    RawClient c(endpoint_.port);
    ASSERT_TRUE(c.connected());
    c.Send("GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    ASSERT_TRUE(c.ReadAllUntil("ok").ends_with("ok"));
  }
  EXPECT_TRUE(AwaitTrue([&] { return listener_->counters().open == 0; }))
      << listener_->counters().open << " of 500 still open";
}

TEST_F(HttpTest, IdlePooledConnectionsAreClosedByATimerAndADroppedPoolAtOnce) {
  client_ = std::make_unique<HttpClient>(io_, HttpClient::Options{.max_idle = milliseconds(300)});
  std::mutex mu;
  std::vector<std::shared_ptr<HttpReply>> held;
  Listen({}, [&](HttpRequest, std::shared_ptr<HttpReply> r) {
    std::lock_guard g(mu);
    held.push_back(std::move(r));
  });
  // A burst of four calls at once: four connections, pooled when answered.
  std::atomic<int> done{0};
  for (int i = 0; i < 4; ++i) {
    client_->Start(endpoint_, {.target = "/"}, {.on_done = [&](const Status& s) {
                     EXPECT_TRUE(s.ok()) << s.ToString();
                     ++done;
                   }});
  }
  ASSERT_TRUE(AwaitTrue([&] {
    std::lock_guard g(mu);
    return held.size() == 4;
  }));
  {
    std::lock_guard g(mu);
    for (auto& r : held) r->Send(200, {}, "ok");
    held.clear();
  }
  ASSERT_TRUE(AwaitTrue([&] { return done.load() == 4; }));
  EXPECT_EQ(client_->counters().idle, 4u);
  EXPECT_EQ(listener_->counters().open, 4u);
  // Nobody takes them again: the timer closes them (the server's own idle timeout is a minute).
  ASSERT_TRUE(AwaitTrue([&] { return listener_->counters().open == 0; }));
  EXPECT_EQ(client_->counters().idle, 0u);
  EXPECT_EQ(client_->counters().reaped, 4u);

  // An endpoint dropped from the pool is closed at once, without waiting for the timer.
  client_ = std::make_unique<HttpClient>(io_, HttpClient::Options{.max_idle = std::chrono::minutes(1)});
  Listen({}, [](HttpRequest, std::shared_ptr<HttpReply> r) { r->Send(200, {}, "ok"); });
  ASSERT_TRUE(client_->Fetch(endpoint_, {.target = "/"}).ok());
  EXPECT_EQ(client_->counters().idle, 1u);
  client_->DropIdle(endpoint_);
  EXPECT_EQ(client_->counters().idle, 0u);
  ASSERT_TRUE(AwaitTrue([&] { return listener_->counters().open == 0; }));
}

// Pause stops the body's reads: the server's writes pile up on its side (its TCP window is
// full); Resume delivers the rest, whole and in order.
TEST_F(HttpTest, APausedCallReadsNothingUntilResumedAndTheServersBacklogGrows) {
  constexpr std::size_t kPiece = 64 << 10, kPieces = 256;  // 16 MiB, past any socket buffers
  std::shared_ptr<HttpReply> reply;
  std::mutex mu;
  Listen({}, [&](HttpRequest, std::shared_ptr<HttpReply> r) {
    r->Begin(200, {});
    for (std::size_t i = 0; i < kPieces; ++i) r->Write(std::string(kPiece, static_cast<char>('a' + i % 26)));
    r->End();
    std::lock_guard g(mu);
    reply = std::move(r);
  });
  auto got = std::make_shared<std::string>();
  auto got_size = std::make_shared<std::atomic<std::size_t>>(0);
  auto done = std::make_shared<std::atomic<bool>>(false);
  auto paused_once = std::make_shared<std::atomic<bool>>(false);
  std::shared_ptr<HttpCall> call;
  auto call_ready = std::make_shared<std::promise<std::shared_ptr<HttpCall>>>();
  auto call_future = call_ready->get_future().share();
  call = client_->Start(endpoint_, {.target = "/"},
                        {.on_data =
                             [=](std::string_view d) {
                               got->append(d);
                               *got_size = got->size();
                               if (!paused_once->exchange(true)) call_future.get()->Pause();
                             },
                         .on_done =
                             [=](const Status& s) {
                               EXPECT_TRUE(s.ok()) << s.ToString();
                               *done = true;
                             }});
  call_ready->set_value(call);
  ASSERT_TRUE(AwaitTrue([&] { return paused_once->load(); }));
  // Most of the body waits on the server's side; the client took one read's worth.
  ASSERT_TRUE(AwaitTrue([&] {
    std::lock_guard g(mu);
    return reply && reply->Backlog() > kPiece * kPieces / 2;
  }));
  const std::size_t before = got_size->load();
  std::this_thread::sleep_for(milliseconds(100));  // time for reads that must not happen
  EXPECT_EQ(got_size->load(), before);
  EXPECT_LE(before, 16u << 10);
  EXPECT_FALSE(done->load());
  call->Resume();
  ASSERT_TRUE(AwaitTrue([&] { return done->load(); }));
  ASSERT_EQ(got->size(), kPiece * kPieces);
  for (std::size_t i = 0; i < kPieces; ++i) ASSERT_EQ((*got)[i * kPiece], static_cast<char>('a' + i % 26)) << i;
  std::lock_guard g(mu);
  EXPECT_EQ(reply->Backlog(), 0u);
}

// The backlog counts a Write as soon as it is called (a producer checking it after its own
// Write sees it) and OnDrained runs once it is low enough.
TEST_F(HttpTest, TheBacklogCountsAWriteAtOnceAndOnDrainedRunsWhenTheClientTakesIt) {
  std::shared_ptr<HttpReply> reply;
  std::mutex mu;
  std::atomic<std::size_t> seen_after_write{0};
  std::atomic<bool> drained{false};
  Listen({}, [&](HttpRequest, std::shared_ptr<HttpReply> r) {
    r->Begin(200, {});
    r->Write(std::string(8 << 20, 'x'));
    seen_after_write = r->Backlog();
    r->OnDrained(1 << 20, [&] { drained = true; });
    std::lock_guard g(mu);
    reply = std::move(r);
  });
  RawClient c(listener_->port());
  c.Send("GET / HTTP/1.1\r\nHost: x\r\n\r\n");
  ASSERT_TRUE(AwaitTrue([&] {
    std::lock_guard g(mu);
    return reply != nullptr;
  }));
  EXPECT_EQ(seen_after_write.load(), std::size_t{8 << 20});
  EXPECT_FALSE(drained.load());  // nobody reads yet: most of it is queued
  {
    std::lock_guard g(mu);
    reply->End();
  }
  const std::string all = c.ReadAllUntil("0\r\n\r\n");
  EXPECT_GT(all.size(), std::size_t{8 << 20});
  EXPECT_TRUE(drained.load());
  std::lock_guard g(mu);
  EXPECT_EQ(reply->Backlog(), 0u);
}

}  // namespace
}  // namespace kvrouter

namespace kvrouter {
namespace {

TEST(ParseHttpRequest, ParsesAWholeRequestWithTheListenersLimits) {
  auto r = ParseHttpRequest("POST /v1/x?q=1 HTTP/1.1\r\nHost: h\r\nX-Request-Id: r1\r\nContent-Length: 2\r\n\r\nhi", 1024, 16);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->method, "POST");
  EXPECT_EQ(r->Path(), "/v1/x");
  EXPECT_EQ(r->Header("x-request-id"), "r1");
  EXPECT_EQ(r->body, "hi");
  EXPECT_EQ(ParseHttpRequest("GET / HTTP/1.1\r\nX: " + std::string(2048, 'a') + "\r\n\r\n", 1024, 16).status().code(),
            StatusCode::kOverloaded);
  EXPECT_EQ(ParseHttpRequest("POST / HTTP/1.1\r\nContent-Length: 17\r\n\r\n", 1024, 16).status().code(),
            StatusCode::kOverloaded);
  EXPECT_EQ(ParseHttpRequest("NOT HTTP\r\n\r\n", 1024, 16).status().code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(ParseHttpRequest("POST / HTTP/1.1\r\nContent-Length: 5\r\n\r\nab", 1024, 16).ok());  // incomplete
}

}  // namespace
}  // namespace kvrouter
