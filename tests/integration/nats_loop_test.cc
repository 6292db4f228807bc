// NatsClient in event-loop mode (NatsOptions::event_loop) and NatsLoops, against a real
// nats-server started by each test: handlers run on the loop's thread, publishes from the loop
// and from other threads go out, "no responders" reaches the handler, a restarted server is
// reconnected to, nothing runs after a subscription is destroyed (its client closing under a
// flood after it), Flush writes what queued handlers publish, and TLS is refused.
#include "transport/nats_loops.h"

#include <atomic>
#include <chrono>
#include <future>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <boost/asio/post.hpp>
#include <gtest/gtest.h>

#include "tests/integration/kvrouter_fixture.h"
#include "transport/http_io_impl.h"

namespace kvrouter::testing {
namespace {

std::span<const std::byte> Bytes(std::string_view s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}
std::string Text(std::span<const std::byte> b) { return {reinterpret_cast<const char*>(b.data()), b.size()}; }

class NatsLoopTest : public NatsServerTest {
 protected:
  // Runs `f` on loop `i` of `io`.
  template <typename F>
  static void OnLoop(HttpIo& io, std::size_t i, F f) {
    boost::asio::post(io.impl().loops[i]->ioc, std::move(f));
  }
  // Returns once every handler posted to loop `i` before it has run.
  static void Settle(HttpIo& io, std::size_t i) {
    std::promise<void> done;
    OnLoop(io, i, [&] { done.set_value(); });
    done.get_future().wait();
  }
  static std::thread::id LoopThread(HttpIo& io, std::size_t i) { return io.impl().loops[i]->thread.get_id(); }

  NatsOptions Options() const { return {.url = nats_->url(), .name = "loop-test"}; }

  // Answers every request on "echo" with its payload.
  void StartEcho() {
    echo_client_ = Connect({.name = "echo", .send_asap = true});
    ASSERT_NE(echo_client_, nullptr);
    auto sub = echo_client_->Subscribe("echo", "",
                                       [this](const IncomingMessage& m) { (void)echo_client_->Respond(m, m.data); });
    ASSERT_TRUE(sub.ok());
    echo_ = std::move(sub).value();
    ASSERT_TRUE(echo_client_->Flush(2s).ok());
  }

  std::unique_ptr<NatsClient> echo_client_;
  std::unique_ptr<Subscription> echo_;
};

TEST_F(NatsLoopTest, AnswersToRequestsSentOnALoopAreHandledOnThatLoopsThread) {
  StartEcho();
  HttpIo io(2);
  auto loops = NatsLoops::Connect(io, Options());
  ASSERT_TRUE(loops.ok()) << loops.status().message();
  ASSERT_EQ((*loops)->size(), 2u);
  EXPECT_FALSE((*loops)->Current().has_value());

  constexpr int kPerLoop = 200;
  std::mutex mu;
  std::vector<std::set<std::string>> got(2);
  std::atomic<int> elsewhere{0};
  std::vector<std::unique_ptr<Subscription>> subs;
  for (std::size_t i = 0; i < 2; ++i) {
    auto sub = (*loops)->at(i).Subscribe("_LOOP." + std::to_string(i) + ".*", "", [&, i](const IncomingMessage& m) {
      if (std::this_thread::get_id() != LoopThread(io, i)) ++elsewhere;
      std::lock_guard<std::mutex> g(mu);
      got[i].insert(Text(m.data));
    });
    ASSERT_TRUE(sub.ok()) << sub.status().message();
    subs.push_back(std::move(sub).value());
  }
  for (std::size_t i = 0; i < 2; ++i) {
    OnLoop(io, i, [&, i] {
      ASSERT_EQ((*loops)->Current(), i);
      for (int n = 0; n < kPerLoop; ++n) {
        const std::string payload = std::to_string(i) + "-" + std::to_string(n);
        ASSERT_TRUE((*loops)
                        ->at(i)
                        .PublishRequest("echo", "_LOOP." + std::to_string(i) + "." + std::to_string(n), Bytes(payload))
                        .ok());
      }
    });
  }
  ASSERT_TRUE(WaitFor(
      [&] {
        std::lock_guard<std::mutex> g(mu);
        return got[0].size() == kPerLoop && got[1].size() == kPerLoop;
      },
      10s));
  EXPECT_EQ(elsewhere.load(), 0);
  EXPECT_TRUE(got[1].contains("1-" + std::to_string(kPerLoop - 1)));

  // A publish from a thread off the loops goes out too (the loop writes it).
  ASSERT_TRUE((*loops)->at(0).PublishRequest("echo", "_LOOP.0.outside", Bytes("outside")).ok());
  ASSERT_TRUE(WaitFor(
      [&] {
        std::lock_guard<std::mutex> g(mu);
        return got[0].contains("outside");
      },
      5s));
  EXPECT_EQ(elsewhere.load(), 0);
  Settle(io, 0);
  Settle(io, 1);
  subs.clear();
  loops->reset();
}

TEST_F(NatsLoopTest, NoRespondersReachesTheHandlerAsAStatus) {
  HttpIo io(1);
  auto loops = NatsLoops::Connect(io, Options());
  ASSERT_TRUE(loops.ok()) << loops.status().message();
  std::atomic<int> no_responders{0}, other{0};
  auto sub = (*loops)->at(0).Subscribe("_LOOP.*", "", [&](const IncomingMessage& m) {
    const auto status = m.Header("Status");
    if (m.no_responders && m.subject.empty() && status == "503") {
      ++no_responders;
    } else {
      ++other;
    }
  });
  ASSERT_TRUE(sub.ok());
  OnLoop(io, 0, [&] { (void)(*loops)->at(0).PublishRequest("nobody.listens", "_LOOP.1", Bytes("x")); });
  ASSERT_TRUE(WaitFor([&] { return no_responders.load() == 1; }, 5s));
  EXPECT_EQ(other.load(), 0);
  Settle(io, 0);
  sub->reset();
  loops->reset();
}

TEST_F(NatsLoopTest, ARestartedServerIsReconnectedToAndTheSubscriptionResumes) {
  HttpIo io(1);
  auto loops = NatsLoops::Connect(io, Options());
  ASSERT_TRUE(loops.ok()) << loops.status().message();
  std::mutex mu;
  std::set<std::string> got;
  auto sub = (*loops)->at(0).Subscribe("_LOOP.*", "", [&](const IncomingMessage& m) {
    std::lock_guard<std::mutex> g(mu);
    got.insert(Text(m.data));
  });
  ASSERT_TRUE(sub.ok());
  StartEcho();
  auto ask = [&](const std::string& what) {
    OnLoop(io, 0, [&, what] { (void)(*loops)->at(0).PublishRequest("echo", "_LOOP.1", Bytes(what)); });
  };
  ask("before");
  ASSERT_TRUE(WaitFor(
      [&] {
        std::lock_guard<std::mutex> g(mu);
        return got.contains("before");
      },
      5s));

  echo_.reset();
  echo_client_.reset();
  ASSERT_TRUE(nats_->Restart().ok());
  ASSERT_TRUE(WaitFor([&] { return (*loops)->at(0).IsConnected(); }, 10s));
  StartEcho();
  int n = 0;
  ASSERT_TRUE(WaitFor(
      [&] {
        ask("after-" + std::to_string(n++));
        std::lock_guard<std::mutex> g(mu);
        for (const auto& s : got) {
          if (s.starts_with("after-")) return true;
        }
        return false;
      },
      10s, 20ms));
  EXPECT_GE((*loops)->at(0).Stats().disconnects, 1u);
  Settle(io, 0);  // the asks still queued use the client
  sub->reset();
  loops->reset();
}

TEST_F(NatsLoopTest, NothingRunsAfterASubscriptionOrItsClientIsDestroyedUnderAFlood) {
  HttpIo io(1);
  auto loops = NatsLoops::Connect(io, Options());
  ASSERT_TRUE(loops.ok()) << loops.status().message();
  auto publisher = Connect({.name = "flood"});
  ASSERT_NE(publisher, nullptr);
  std::atomic<int> handled{0};
  std::atomic<bool> gone{false};
  std::atomic<int> after{0};
  auto sub = (*loops)->at(0).Subscribe("flood", "", [&](const IncomingMessage&) {
    if (gone.load()) ++after;
    ++handled;
  });
  ASSERT_TRUE(sub.ok());
  ASSERT_TRUE((*loops)->at(0).Flush(2s).ok());  // off the loop: the loop reads the PONG
  std::atomic<bool> stop{false};
  std::thread flood([&] {
    while (!stop.load()) (void)publisher->Publish("flood", Bytes("m"));
  });
  ASSERT_TRUE(WaitFor([&] { return handled.load() > 1000; }, 10s));
  sub->reset();
  gone = true;
  const int at_reset = handled.load();
  // The loop goes on reading the flood (the server still sends what it had queued).
  OnLoop(io, 0, [] {});
  loops->reset();
  stop = true;
  flood.join();
  EXPECT_EQ(after.load(), 0);
  EXPECT_EQ(handled.load(), at_reset);
}

// A gateway's shutdown: what the handlers still queued on the loops publish reaches the server
// although the loops stop right after.
TEST_F(NatsLoopTest, FlushWritesWhatQueuedHandlersPublishBeforeTheLoopsStop) {
  auto listener = Connect({.name = "listener"});
  ASSERT_NE(listener, nullptr);
  std::atomic<int> got{0};
  auto sub = listener->Subscribe("last.words", "", [&](const IncomingMessage&) { ++got; });
  ASSERT_TRUE(sub.ok());
  ASSERT_TRUE(listener->Flush(2s).ok());
  HttpIo io(2);
  auto loops = NatsLoops::Connect(io, Options());
  ASSERT_TRUE(loops.ok()) << loops.status().message();
  constexpr int kEach = 50;
  for (std::size_t i = 0; i < 2; ++i) {
    OnLoop(io, i, [&, i] {
      for (int n = 0; n < kEach; ++n) (void)(*loops)->at(i).Publish("last.words", Bytes("bye"));
    });
  }
  (*loops)->Flush(5s);
  io.Stop();
  ASSERT_TRUE(WaitFor([&] { return got.load() == 2 * kEach; }, 5s)) << got.load();
  loops->reset();
}

// nats.c waits inside its TLS reads and writes: a loop's thread must not, so it is refused.
TEST_F(NatsLoopTest, AConnectionWithTlsIsNotServedByALoop) {
  HttpIo io(1);
  NatsOptions options = Options();
  options.security.tls_ca = "/nonexistent/ca.pem";
  auto loops = NatsLoops::Connect(io, options);
  ASSERT_FALSE(loops.ok());
  EXPECT_EQ(loops.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(loops.status().message().find("TLS"), std::string::npos) << loops.status().message();
}

}  // namespace
}  // namespace kvrouter::testing
