// RouterLink (the gateway's side of the router's NATS endpoints) against a real nats-server and
// a stand-in router of the test's own: what the link does when its connection is lost and back
// (SetConnected), driven directly so that it is deterministic. The gateway's own outage tests
// stop the server (gateway_test.cc).
#include "router/kvgateway/router_link.h"

#include <gtest/gtest.h>

#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <string>

#include <boost/asio/post.hpp>

#include "events/msgpack_reader.h"
#include "tests/await.h"
#include "tests/integration/process.h"
#include "transport/http_io_impl.h"
#include "transport/nats_loops.h"

namespace kvrouter {
namespace {

using namespace std::chrono_literals;
const std::string kPrefix = "namespace.dynamo.router.";

class RouterLinkTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = testing::NatsServerProcess::Start();
    ASSERT_TRUE(server.ok()) << server.status().ToString();
    server_ = std::move(server).value();
    auto link_nc = NatsClient::Connect({.url = server_->url(), .name = "gateway", .send_asap = true}, {});
    auto router_nc = NatsClient::Connect({.url = server_->url(), .name = "router", .send_asap = true}, {});
    ASSERT_TRUE(link_nc.ok() && router_nc.ok());
    link_nc_ = std::move(link_nc).value();
    router_nc_ = std::move(router_nc).value();
    auto frees = router_nc_->Subscribe(kPrefix + "free", "", [this](const IncomingMessage& m) {
      if (auto id = DecodeLifecycleRequest(m.data); id.ok()) {
        std::lock_guard g(mu_);
        ++frees_[*id];
      }
    });
    auto routes = router_nc_->Subscribe(kPrefix + "route", "", [this](const IncomingMessage& m) {
      std::lock_guard g(mu_);
      route_replies_.emplace_back(m.reply);
    });
    auto stats = router_nc_->Subscribe(kPrefix + "stats", "", [this](const IncomingMessage& m) {
      if (!answer_stats_.load()) return;
      if (answer_main_only_.load() && m.reply.find(".L") != std::string_view::npos) return;  // a loop's probe
      StatsReply reply;
      auto body = EncodeStatsReply(reply, 1 << 20);
      ASSERT_TRUE(body.ok());
      ASSERT_TRUE(router_nc_->Publish(m.reply, AsBytes(*body)).ok());
      ++stats_answered_;
    });
    ASSERT_TRUE(frees.ok() && routes.ok() && stats.ok());
    subs_.push_back(std::move(frees).value());
    subs_.push_back(std::move(routes).value());
    subs_.push_back(std::move(stats).value());
    ASSERT_TRUE(router_nc_->Flush(2s).ok());  // the server has the stand-in's subscriptions
    link_.emplace(*link_nc_, "dynamo", 10s);
    ASSERT_TRUE(link_->Start().ok());
    ASSERT_TRUE(link_nc_->Flush(2s).ok());  // and the link's inbox
  }
  void TearDown() override {
    link_.reset();
    subs_.clear();
  }
  int Frees(const std::string& id) {
    std::lock_guard g(mu_);
    return frees_[id];
  }
  std::size_t Routes() {
    std::lock_guard g(mu_);
    return route_replies_.size();
  }
  std::string RouteReplySubject(std::size_t i) {
    std::lock_guard g(mu_);
    return route_replies_[i];
  }

  std::unique_ptr<testing::NatsServerProcess> server_;
  std::unique_ptr<NatsClient> link_nc_, router_nc_;
  std::vector<std::unique_ptr<Subscription>> subs_;
  std::optional<RouterLink> link_;
  std::mutex mu_;
  std::map<std::string, int> frees_;
  std::vector<std::string> route_replies_;
  std::atomic<bool> answer_stats_{true};
  std::atomic<bool> answer_main_only_{false};  // probes sent on the loops' connections go unanswered
  std::atomic<int> stats_answered_{0};
};

TEST_F(RouterLinkTest, ARouteWaitingWhenTheConnectionGoesFailsAtOnceAndItsBookingIsFreed) {
  std::optional<Result<RouteReply>> first;
  link_->Route({.request_id = "b1"}, [&](Result<RouteReply> r) { first = std::move(r); });
  ASSERT_TRUE(AwaitTrue([&] { return Routes() == 1; }));  // the router has it and says nothing yet
  EXPECT_FALSE(first.has_value());
  link_->SetConnected(false);
  ASSERT_TRUE(first.has_value());  // failed on the spot, not at the route timeout
  EXPECT_EQ(first->status().code(), StatusCode::kNoWorkers);
  EXPECT_EQ(link_->pending(), 0u);
  EXPECT_TRUE(AwaitTrue([&] { return Frees("b1") == 1; }));  // in case the router booked it
  // While down a route fails at once too.
  std::optional<Result<RouteReply>> second;
  link_->Route({.request_id = "b2"}, [&](Result<RouteReply> r) { second = std::move(r); });
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->status().code(), StatusCode::kNoWorkers);
  // Back up: the first router answer after the loss sends b1's free again ...
  link_->SetConnected(true);
  link_->Tick(std::chrono::steady_clock::now());
  ASSERT_TRUE(AwaitTrue([&] { return Frees("b1") == 2 && link_->Answering(std::chrono::steady_clock::now()); }));
  // ... and the router's late answer to the route frees what it booked then.
  ASSERT_TRUE(router_nc_->Publish(RouteReplySubject(0), AsBytes(EncodeRouteReply({.worker_id = 7}))).ok());
  EXPECT_TRUE(AwaitTrue([&] { return Frees("b1") == 3; }));
  EXPECT_EQ(Routes(), 1u);
}

// The gateway's shutdown: what waits fails while its continuations can still run, and no answer
// reaches the gateway after it (a late one is freed here).
TEST_F(RouterLinkTest, StopFailsWhatWaitsFreesItsBookingAndLetsNoLaterAnswerThrough) {
  int calls = 0;
  std::optional<Result<RouteReply>> first;
  link_->Route({.request_id = "s1"}, [&](Result<RouteReply> r) {
    ++calls;
    first = std::move(r);
  });
  ASSERT_TRUE(AwaitTrue([&] { return Routes() == 1; }));
  link_->Stop();
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->status().code(), StatusCode::kNoWorkers);
  EXPECT_EQ(link_->pending(), 0u);
  EXPECT_TRUE(AwaitTrue([&] { return Frees("s1") == 1; }));
  std::optional<Result<RouteReply>> second;
  link_->Route({.request_id = "s2"}, [&](Result<RouteReply> r) { second = std::move(r); });
  ASSERT_TRUE(second.has_value());  // at once, never sent
  EXPECT_EQ(second->status().code(), StatusCode::kNoWorkers);
  // The router's late answer to s1 books nothing that stays, and calls nobody.
  ASSERT_TRUE(router_nc_->Publish(RouteReplySubject(0), AsBytes(EncodeRouteReply({.worker_id = 7}))).ok());
  EXPECT_TRUE(AwaitTrue([&] { return Frees("s1") == 2; }));
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(Routes(), 1u);
}

TEST_F(RouterLinkTest, FreesNoAnswerConfirmedAreSentAgainAtTheFirstAnswerAfterALossAndOnceMore) {
  const SteadyTime t0 = std::chrono::steady_clock::now();
  link_->Free("f1");
  link_->Tick(t0);  // a stats probe, sent after f1: its answer confirms f1
  ASSERT_TRUE(AwaitTrue([&] { return link_->unconfirmed() == 0; }));
  answer_stats_ = false;
  link_->Free("f2");  // sent; nothing confirms it before the loss
  link_->SetConnected(false);
  EXPECT_FALSE(link_->Answering(std::chrono::steady_clock::now()));
  link_->Free("f3");  // sent while down
  link_->SetConnected(true);
  ASSERT_TRUE(AwaitTrue([&] { return Frees("f1") == 1 && Frees("f2") == 1 && Frees("f3") == 1; }));
  EXPECT_FALSE(link_->Answering(std::chrono::steady_clock::now()));  // no answer since the loss
  // The first answer after the loss: f2 and f3 go again, f1 does not.
  answer_stats_ = true;
  link_->Tick(t0 + 2s);
  ASSERT_TRUE(AwaitTrue([&] { return Frees("f2") == 2 && Frees("f3") == 2; }));
  EXPECT_TRUE(AwaitTrue([&] { return link_->Answering(std::chrono::steady_clock::now()); }));
  // And once more later, for a replica that subscribes again later than the one that answered.
  link_->Tick(std::chrono::steady_clock::now() + 6s);
  EXPECT_TRUE(AwaitTrue([&] { return Frees("f2") == 3 && Frees("f3") == 3; }));
  EXPECT_EQ(Frees("f1"), 1);
}

TEST_F(RouterLinkTest, FreesSentAgainIntoASecondLossGoAgainAfterItUntilAProbeConfirmsThem) {
  answer_stats_ = false;
  link_->Free("g1");
  link_->SetConnected(false);
  link_->SetConnected(true);
  answer_stats_ = true;
  link_->Tick(std::chrono::steady_clock::now());  // the first answer after the loss sends g1 again
  ASSERT_TRUE(AwaitTrue([&] { return Frees("g1") == 2 && link_->Answering(std::chrono::steady_clock::now()); }));
  EXPECT_EQ(link_->unconfirmed(), 1u);  // the probe that answered was sent before the re-send
  // Lost again before any probe confirmed it: it goes again after this loss too.
  answer_stats_ = false;
  link_->SetConnected(false);
  link_->SetConnected(true);
  answer_stats_ = true;
  link_->Tick(std::chrono::steady_clock::now());
  ASSERT_TRUE(AwaitTrue([&] { return Frees("g1") == 3 && link_->Answering(std::chrono::steady_clock::now()); }));
  // A probe sent after it confirms it: a third loss sends nothing again.
  link_->Tick(std::chrono::steady_clock::now() + 2s);
  ASSERT_TRUE(AwaitTrue([&] { return link_->unconfirmed() == 0; }));
  answer_stats_ = false;
  link_->SetConnected(false);
  link_->SetConnected(true);
  answer_stats_ = true;
  link_->Tick(std::chrono::steady_clock::now() + 3s);
  ASSERT_TRUE(AwaitTrue([&] { return link_->Answering(std::chrono::steady_clock::now()); }));
  EXPECT_EQ(Frees("g1"), 3);
}

TEST_F(RouterLinkTest, NoRouterSubscribedFailsARouteAtOnceAndTheLinkIsNotAnsweringFromThen) {
  link_->Tick(std::chrono::steady_clock::now());
  ASSERT_TRUE(AwaitTrue([&] { return link_->Answering(std::chrono::steady_clock::now()); }));
  subs_.clear();  // the router goes: nothing subscribes to its subjects
  ASSERT_TRUE(router_nc_->Flush(2s).ok());
  std::atomic<bool> answered{false};
  std::optional<Result<RouteReply>> r;
  link_->Route({.request_id = "n1"}, [&](Result<RouteReply> got) {
    r = std::move(got);
    answered = true;
  });
  ASSERT_TRUE(AwaitTrue([&] { return answered.load(); }));  // NATS' no-responders, not the route timeout
  EXPECT_EQ(r->status().code(), StatusCode::kNoWorkers);
  // Within the answering window of the last stats answer, yet not answering: the gateway's
  // fallback (and /ready) need not wait for the window to end.
  EXPECT_FALSE(link_->Answering(std::chrono::steady_clock::now()));
}

// The link with a NATS connection per event loop, as kvgateway runs it.
class RouterLinkLoopsTest : public RouterLinkTest {
 protected:
  void SetUp() override {
    RouterLinkTest::SetUp();
    if (HasFatalFailure()) return;
    link_.reset();
    io_.emplace(2);
    auto loops = NatsLoops::Connect(*io_, {.url = server_->url(), .name = "gateway"});
    ASSERT_TRUE(loops.ok()) << loops.status().ToString();
    loops_ = std::move(loops).value();
    link_.emplace(*link_nc_, "dynamo", 10s, loops_.get());
    ASSERT_TRUE(link_->Start().ok());
    for (std::size_t i = 0; i < loops_->size(); ++i) ASSERT_TRUE(loops_->at(i).Flush(2s).ok());
  }
  void TearDown() override {
    link_.reset();
    loops_.reset();
    io_.reset();
    RouterLinkTest::TearDown();
  }
  // Asks for a route on loop `loop`; the result and the thread it came on land in `out`.
  struct Outcome {
    std::atomic<bool> done{false};
    std::optional<Result<RouteReply>> result;
    std::thread::id thread;
  };
  void RouteOnLoop(std::size_t loop, const std::string& request_id, Outcome& out) {
    boost::asio::post(io_->impl().loops[loop]->ioc, [this, request_id, &out] {
      link_->Route({.request_id = request_id}, [&out](Result<RouteReply> r) {
        out.result = std::move(r);
        out.thread = std::this_thread::get_id();
        out.done = true;
      });
    });
  }
  std::thread::id LoopThread(std::size_t loop) { return io_->impl().loops[loop]->thread.get_id(); }
  // Ticks the link at the gateway ticker's period (its clock `advance` ahead each time) until
  // `pred` holds, for at most 10 s.
  template <typename Pred>
  bool TickUntil(Pred pred, std::chrono::seconds advance) {
    SteadyTime t = std::chrono::steady_clock::now();
    for (int i = 0; i < 200 && !pred(); ++i) {
      link_->Tick(t += advance);
      std::this_thread::sleep_for(50ms);  // the ticker's period, not a wait for a state
    }
    return pred();
  }
  // A free sent from loop `loop`, as the gateway sends it when a response ends there.
  void FreeOnLoop(std::size_t loop, const std::string& request_id) {
    std::promise<void> sent;
    boost::asio::post(io_->impl().loops[loop]->ioc, [&] {
      link_->Free(request_id);
      sent.set_value();
    });
    sent.get_future().wait();
  }

  std::optional<HttpIo> io_;
  std::unique_ptr<NatsLoops> loops_;
};

TEST_F(RouterLinkLoopsTest, ARouteAskedOnALoopGoesOverItsConnectionAndIsAnsweredOnIt) {
  Outcome on0, on1;
  RouteOnLoop(0, "l0", on0);
  RouteOnLoop(1, "l1", on1);
  ASSERT_TRUE(AwaitTrue([&] { return Routes() == 2; }));
  for (std::size_t i = 0; i < 2; ++i) {
    const std::string reply = RouteReplySubject(i);
    const bool from_loop1 = reply.find(".L1.") != std::string::npos;
    EXPECT_TRUE(from_loop1 || reply.find(".L0.") != std::string::npos) << reply;
    ASSERT_TRUE(router_nc_->Publish(reply, AsBytes(EncodeRouteReply({.worker_id = from_loop1 ? 11u : 10u}))).ok());
  }
  ASSERT_TRUE(AwaitTrue([&] { return on0.done.load() && on1.done.load(); }));
  ASSERT_TRUE(on0.result->ok() && on1.result->ok());
  EXPECT_EQ((*on0.result)->worker_id, 10u);
  EXPECT_EQ((*on1.result)->worker_id, 11u);
  EXPECT_EQ(on0.thread, LoopThread(0));
  EXPECT_EQ(on1.thread, LoopThread(1));
  EXPECT_EQ(link_->pending(), 0u);
}

TEST_F(RouterLinkLoopsTest, NoRouterSubscribedFailsALoopsRouteAtOnceAndALateAnswerIsFreed) {
  Outcome waiting;
  RouteOnLoop(0, "w1", waiting);  // the router has it and says nothing yet
  ASSERT_TRUE(AwaitTrue([&] { return Routes() == 1; }));
  const std::string late_reply = RouteReplySubject(0);
  link_->Tick(std::chrono::steady_clock::now());
  ASSERT_TRUE(AwaitTrue([&] { return link_->Answering(std::chrono::steady_clock::now()); }));
  subs_.clear();  // the router goes: nothing subscribes to its subjects
  ASSERT_TRUE(router_nc_->Flush(2s).ok());
  Outcome refused;
  RouteOnLoop(0, "n1", refused);
  // NATS' no-responders, not the route timeout; it does not say which request it answers, so
  // the one still waiting on that connection fails too.
  ASSERT_TRUE(AwaitTrue([&] { return refused.done.load() && waiting.done.load(); }));
  EXPECT_EQ(refused.result->status().code(), StatusCode::kNoWorkers);
  EXPECT_EQ(waiting.result->status().code(), StatusCode::kNoWorkers);
  EXPECT_EQ(refused.thread, LoopThread(0));
  EXPECT_FALSE(link_->Answering(std::chrono::steady_clock::now()));
  EXPECT_EQ(link_->pending(), 0u);
  // A router that answers the failed one after all gets its booking freed.
  auto frees = router_nc_->Subscribe(kPrefix + "free", "", [this](const IncomingMessage& m) {
    if (auto id = DecodeLifecycleRequest(m.data); id.ok()) {
      std::lock_guard g(mu_);
      ++frees_[*id];
    }
  });
  ASSERT_TRUE(frees.ok());
  ASSERT_TRUE(router_nc_->Flush(2s).ok());
  ASSERT_TRUE(router_nc_->Publish(late_reply, AsBytes(EncodeRouteReply({.worker_id = 7}))).ok());
  EXPECT_TRUE(AwaitTrue([&] { return Frees("w1") == 1; }));
}

TEST_F(RouterLinkLoopsTest, FreesSentOnLoopsAreConfirmedByTheProbesOfTheirLanes) {
  FreeOnLoop(0, "c0");
  FreeOnLoop(1, "c1");
  link_->Free("cm");  // off the loops: the main connection's lane
  ASSERT_TRUE(AwaitTrue([&] { return Frees("c0") == 1 && Frees("c1") == 1 && Frees("cm") == 1; }));
  EXPECT_EQ(link_->unconfirmed(), 3u);
  // Only the main connection's probe answered: it confirms the free sent on it, not the loops'.
  answer_main_only_ = true;
  const SteadyTime t0 = std::chrono::steady_clock::now();
  link_->Tick(t0);  // a probe on each lane, each after its free
  ASSERT_TRUE(AwaitTrue([&] { return link_->unconfirmed() == 2; }));
  answer_main_only_ = false;
  link_->Tick(t0 + 2s);
  ASSERT_TRUE(AwaitTrue([&] { return link_->unconfirmed() == 0; }));
  // The stand-in counts an answer after sending it: the link may have it first.
  EXPECT_TRUE(AwaitTrue([&] { return stats_answered_.load() >= 4; }));
}

// A loop's connection lost (here with every other, but only the loops' losses are seen: the test
// does not call SetConnected): the routes waiting on it fail, and the frees no probe confirmed
// go again on the router's first answer after it.
TEST_F(RouterLinkLoopsTest, ALoopsConnectionLostFailsItsWaitingRoutesAndItsUnconfirmedFreesGoAgain) {
  answer_stats_ = false;  // nothing confirms x1 before the loss
  FreeOnLoop(0, "x1");
  ASSERT_TRUE(AwaitTrue([&] { return Frees("x1") == 1; }));
  Outcome waiting;
  RouteOnLoop(1, "r1", waiting);
  ASSERT_TRUE(AwaitTrue([&] { return Routes() == 1; }));
  ASSERT_TRUE(server_->Restart().ok());
  ASSERT_TRUE(TickUntil([&] { return waiting.done.load(); }, 0s));
  EXPECT_EQ(waiting.result->status().code(), StatusCode::kNoWorkers);
  EXPECT_EQ(link_->pending(), 0u);
  answer_stats_ = true;
  // A probe at each Tick, until a router that subscribed again answers one.
  ASSERT_TRUE(TickUntil([&] { return Frees("x1") >= 2; }, 2s));
  EXPECT_TRUE(AwaitTrue([&] { return link_->Answering(std::chrono::steady_clock::now()); }));
}

}  // namespace
}  // namespace kvrouter
