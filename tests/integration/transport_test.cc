// NatsClient against a real nats-server: each test starts its own server on a free port and
// stops only that server. Waits are on conditions (WaitFor), never fixed sleeps.
#include "transport/nats_client.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "tests/integration/kvrouter_fixture.h"

namespace kvrouter::testing {
namespace {

std::span<const std::byte> Bytes(std::string_view s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}
std::string Text(std::span<const std::byte> b) { return {reinterpret_cast<const char*>(b.data()), b.size()}; }

// Thread-safe bag of received payloads.
class Inbox {
 public:
  void Add(std::string s) {
    std::lock_guard<std::mutex> lock(mu_);
    items_.push_back(std::move(s));
  }
  size_t size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return items_.size();
  }
  std::vector<std::string> items() const {
    std::lock_guard<std::mutex> lock(mu_);
    return items_;
  }
  bool Contains(const std::string& s) const {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& i : items_) {
      if (i == s) return true;
    }
    return false;
  }

 private:
  mutable std::mutex mu_;
  std::vector<std::string> items_;
};

MessageHandler Collect(Inbox& inbox) {
  return [&inbox](const IncomingMessage& m) { inbox.Add(Text(m.data)); };
}

class TransportTest : public NatsServerTest {};

TEST_F(TransportTest, PublishedMessageReachesSubscriber) {
  auto nc = Connect();
  ASSERT_NE(nc, nullptr);
  EXPECT_TRUE(nc->IsConnected());
  Inbox inbox;
  std::string seen_subject;
  std::mutex mu;
  auto sub = nc->Subscribe("kv.test.events", "", [&](const IncomingMessage& m) {
    {
      std::lock_guard<std::mutex> lock(mu);
      seen_subject = std::string(m.subject);
    }
    EXPECT_TRUE(m.reply.empty());
    inbox.Add(Text(m.data));
  });
  ASSERT_TRUE(sub.ok()) << sub.status().ToString();
  EXPECT_EQ((*sub)->subject(), "kv.test.events");
  ASSERT_TRUE(nc->Flush(2s).ok());  // the server has the subscription

  auto publisher = Connect();
  ASSERT_NE(publisher, nullptr);
  ASSERT_TRUE(publisher->Publish("kv.test.events", Bytes("hello")).ok());
  ASSERT_TRUE(publisher->Publish("kv.test.events", Bytes("")).ok());  // empty body is fine
  ASSERT_TRUE(WaitFor([&] { return inbox.size() == 2; }, 5s));
  EXPECT_EQ(inbox.items(), (std::vector<std::string>{"hello", ""}));
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_EQ(seen_subject, "kv.test.events");
}

// A handler learns whether more messages of its subscription are already queued behind the
// one it is given (the router gathers events into bulks while they are): every message of a
// burst but the last says so, burst after burst. (A burst's first message holds the handler
// until the whole burst is queued; whether it saw the rest coming depends on when it was
// taken, so it is not checked.)
TEST_F(TransportTest, MorePendingIsSetForEveryQueuedMessageButTheLast) {
  auto nc = Connect();
  ASSERT_NE(nc, nullptr);
  std::mutex mu;
  std::condition_variable cv;
  int released = 0;  // bursts the first handler call may go on with
  std::vector<bool> more;
  const std::vector<std::size_t> bursts = {50, 5, 2};
  auto sub = nc->Subscribe("kv.test.burst", "", [&](const IncomingMessage& m) {
    std::unique_lock<std::mutex> lock(mu);
    // A burst's first message waits until the whole burst is queued.
    std::size_t first = 0;
    for (std::size_t b = 0; b < bursts.size() && first <= more.size(); first += bursts[b++]) {
      if (first == more.size()) cv.wait(lock, [&] { return released > static_cast<int>(b); });
    }
    more.push_back(m.more_pending);
  });
  ASSERT_TRUE(sub.ok());
  // Delivered by the same connection's reader after the burst: once it arrives, the whole
  // burst is in the burst subscription's queue.
  auto marker = nc->Subscribe("kv.test.marker", "", [&](const IncomingMessage&) {
    std::lock_guard<std::mutex> lock(mu);
    ++released;
    cv.notify_all();
  });
  ASSERT_TRUE(marker.ok());
  ASSERT_TRUE(nc->Flush(2s).ok());
  auto publisher = Connect();
  ASSERT_NE(publisher, nullptr);
  std::size_t total = 0;
  for (std::size_t n : bursts) {
    for (std::size_t i = 0; i < n; ++i) ASSERT_TRUE(publisher->Publish("kv.test.burst", Bytes("x")).ok());
    ASSERT_TRUE(publisher->Publish("kv.test.marker", Bytes("")).ok());
    total += n;
    ASSERT_TRUE(WaitFor(
        [&] {
          std::lock_guard<std::mutex> lock(mu);
          return more.size() == total;
        },
        5s));
  }
  std::vector<bool> expected, seen;
  std::lock_guard<std::mutex> lock(mu);
  for (std::size_t b = 0, first = 0; b < bursts.size(); first += bursts[b++]) {
    for (std::size_t i = 1; i < bursts[b]; ++i) {
      expected.push_back(i + 1 < bursts[b]);
      seen.push_back(more[first + i]);
    }
  }
  EXPECT_EQ(seen, expected);
}

TEST_F(TransportTest, QueueGroupMembersShareRequestsAndEachIsHandledOnce) {
  // Two router replicas, each with its own connection, in queue group "kvrouter".
  auto replica_a = Connect({.name = "replica-a"});
  auto replica_b = Connect({.name = "replica-b"});
  auto client = Connect({.name = "client"});
  ASSERT_TRUE(replica_a && replica_b && client);

  std::mutex mu;
  std::map<std::string, int> handled;  // request body -> times handled
  std::map<std::string, int> per_replica;
  auto make_handler = [&](NatsClient* nc, std::string name) {
    return [&, nc, name](const IncomingMessage& m) {
      {
        std::lock_guard<std::mutex> lock(mu);
        ++handled[Text(m.data)];
        ++per_replica[name];
      }
      EXPECT_TRUE(nc->Respond(m, Bytes(name)).ok());
    };
  };
  auto sub_a = replica_a->Subscribe("ns.router.route", "kvrouter", make_handler(replica_a.get(), "a"));
  auto sub_b = replica_b->Subscribe("ns.router.route", "kvrouter", make_handler(replica_b.get(), "b"));
  ASSERT_TRUE(sub_a.ok() && sub_b.ok());
  ASSERT_TRUE(replica_a->Flush(2s).ok());
  ASSERT_TRUE(replica_b->Flush(2s).ok());

  constexpr int kRequests = 200;
  for (int i = 0; i < kRequests; ++i) {
    auto reply = client->Request("ns.router.route", Bytes("req-" + std::to_string(i)), 2s);
    ASSERT_TRUE(reply.ok()) << reply.status().ToString();
    const std::string who = Text(*reply);
    EXPECT_TRUE(who == "a" || who == "b") << who;
  }
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_EQ(handled.size(), static_cast<size_t>(kRequests));
  for (const auto& [body, times] : handled) EXPECT_EQ(times, 1) << body;
  // Random distribution over 200 requests: both members get some (fails with p = 2^-199).
  EXPECT_GT(per_replica["a"], 0);
  EXPECT_GT(per_replica["b"], 0);
  EXPECT_EQ(per_replica["a"] + per_replica["b"], kRequests);
}

TEST_F(TransportTest, RequestWithoutRespondersIsNotFoundQuickly) {
  auto nc = Connect();
  ASSERT_NE(nc, nullptr);
  const auto start = std::chrono::steady_clock::now();
  auto reply = nc->Request("nobody.listens.here", Bytes("ping"), 5s);
  const auto elapsed = std::chrono::steady_clock::now() - start;
  ASSERT_FALSE(reply.ok());
  EXPECT_EQ(reply.status().code(), StatusCode::kNotFound) << reply.status().ToString();
  EXPECT_LT(elapsed, 1s);  // answered by the server, not by the 5 s timeout
}

TEST_F(TransportTest, RequestWithSilentResponderTimesOut) {
  auto nc = Connect();
  ASSERT_NE(nc, nullptr);
  std::atomic<int> seen{0};
  auto sub = nc->Subscribe("silent.service", "", [&](const IncomingMessage& m) {
    EXPECT_FALSE(m.reply.empty());
    ++seen;  // never answers
  });
  ASSERT_TRUE(sub.ok());
  ASSERT_TRUE(nc->Flush(2s).ok());
  const auto start = std::chrono::steady_clock::now();
  auto reply = nc->Request("silent.service", Bytes("ping"), 200ms);
  const auto elapsed = std::chrono::steady_clock::now() - start;
  ASSERT_FALSE(reply.ok());
  EXPECT_EQ(reply.status().code(), StatusCode::kTimeout) << reply.status().ToString();
  EXPECT_GE(elapsed, 190ms);
  EXPECT_EQ(seen.load(), 1);
}

TEST_F(TransportTest, RespondToMessageWithoutReplySubjectIsInvalidArgument) {
  auto nc = Connect();
  ASSERT_NE(nc, nullptr);
  std::atomic<int> code{-1};
  auto sub = nc->Subscribe(
      "no.reply", "", [&](const IncomingMessage& m) { code = static_cast<int>(nc->Respond(m, Bytes("x")).code()); });
  ASSERT_TRUE(sub.ok());
  ASSERT_TRUE(nc->Flush(2s).ok());
  ASSERT_TRUE(nc->Publish("no.reply", Bytes("fire-and-forget")).ok());
  ASSERT_TRUE(WaitFor([&] { return code.load() != -1; }, 5s));
  EXPECT_EQ(code.load(), static_cast<int>(StatusCode::kInvalidArgument));
}

TEST_F(TransportTest, HeadersRoundTripIncludingVllmKvSeq) {
  auto nc = Connect();
  ASSERT_NE(nc, nullptr);
  std::mutex mu;
  std::optional<std::string> kv_seq, kv_seq_lower, missing, repeated, body;
  std::atomic<bool> got{false};
  auto sub = nc->Subscribe("namespace.dynamo.component.backend.vllm-kv-events.7.0", "", [&](const IncomingMessage& m) {
    std::lock_guard<std::mutex> lock(mu);
    kv_seq = m.Header("Kv-Seq");
    kv_seq_lower = m.Header("kv-seq");
    missing = m.Header("Absent");
    repeated = m.Header("Multi");
    body = Text(m.data);
    got = true;
  });
  ASSERT_TRUE(sub.ok());
  ASSERT_TRUE(nc->Flush(2s).ok());
  ASSERT_TRUE(nc->PublishWithHeaders("namespace.dynamo.component.backend.vllm-kv-events.7.0", Bytes("batch"),
                                     {{"Kv-Seq", "18446744073709551615"}, {"Multi", "first"}, {"Multi", "second"}})
                  .ok());
  ASSERT_TRUE(WaitFor([&] { return got.load(); }, 5s));
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_EQ(kv_seq, "18446744073709551615");
  EXPECT_EQ(kv_seq_lower, "18446744073709551615");  // case-insensitive fallback
  EXPECT_EQ(missing, std::nullopt);
  EXPECT_EQ(repeated, "first");
  EXPECT_EQ(body, "batch");
}

TEST_F(TransportTest, MessageWithoutHeadersHasNoHeader) {
  auto nc = Connect();
  ASSERT_NE(nc, nullptr);
  std::atomic<int> state{0};  // 1 = no header, 2 = header found
  auto sub =
      nc->Subscribe("plain", "", [&](const IncomingMessage& m) { state = m.Header("Kv-Seq").has_value() ? 2 : 1; });
  ASSERT_TRUE(sub.ok());
  ASSERT_TRUE(nc->Flush(2s).ok());
  ASSERT_TRUE(nc->Publish("plain", Bytes("x")).ok());
  ASSERT_TRUE(WaitFor([&] { return state.load() != 0; }, 5s));
  EXPECT_EQ(state.load(), 1);
}

TEST_F(TransportTest, SubscriptionDestructorWaitsForRunningHandlerAndNothingRunsAfter) {
  auto nc = Connect();
  ASSERT_NE(nc, nullptr);
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  std::atomic<bool> entered{false};
  std::atomic<bool> destroyed{false};
  std::atomic<int> calls{0};
  std::atomic<int> calls_after_destroy{0};
  std::atomic<bool> destructor_returned_during_handler{false};

  auto sub = nc->Subscribe("burst", "", [&](const IncomingMessage&) {
    if (destroyed) ++calls_after_destroy;
    ++calls;
    if (!entered.exchange(true)) {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return release; });
      // Give a (wrongly) non-waiting destructor time to return while we are still running.
      if (WaitFor([&] { return destroyed.load(); }, 200ms)) {
        destructor_returned_during_handler = true;
      }
    }
  });
  ASSERT_TRUE(sub.ok());
  // A sentinel on the same subject tells us when later messages have been delivered.
  Inbox sentinel;
  auto sentinel_sub = nc->Subscribe("burst", "", Collect(sentinel));
  ASSERT_TRUE(sentinel_sub.ok());
  ASSERT_TRUE(nc->Flush(2s).ok());

  for (int i = 0; i < 100; ++i) ASSERT_TRUE(nc->Publish("burst", Bytes("before")).ok());
  ASSERT_TRUE(WaitFor([&] { return entered.load(); }, 5s));

  std::unique_ptr<Subscription> owned = std::move(sub).value();
  std::thread destroyer([&] {
    owned.reset();  // blocks until the handler call in progress has returned
    destroyed = true;
  });
  {
    std::lock_guard<std::mutex> lock(mu);
    release = true;
  }
  cv.notify_all();
  destroyer.join();
  EXPECT_FALSE(destructor_returned_during_handler.load());
  const int calls_at_destroy = calls.load();
  EXPECT_GE(calls_at_destroy, 1);

  for (int i = 0; i < 50; ++i) ASSERT_TRUE(nc->Publish("burst", Bytes("after")).ok());
  ASSERT_TRUE(WaitFor([&] { return sentinel.size() == 150; }, 5s));
  EXPECT_EQ(calls.load(), calls_at_destroy);
  EXPECT_EQ(calls_after_destroy.load(), 0);
}

TEST_F(TransportTest, SubscriptionMayBeDestroyedFromItsOwnHandler) {
  auto nc = Connect();
  ASSERT_NE(nc, nullptr);
  std::mutex mu;
  std::unique_ptr<Subscription> self;  // GUARDED_BY(mu)
  std::atomic<int> calls{0};
  std::atomic<bool> destroyed{false};

  auto sub = nc->Subscribe("selfdestruct", "", [&](const IncomingMessage&) {
    ++calls;
    std::unique_ptr<Subscription> doomed;
    {
      std::lock_guard<std::mutex> lock(mu);
      doomed = std::move(self);
    }
    if (doomed) {
      doomed.reset();  // must neither deadlock nor free state this call still uses
      destroyed = true;
    }
  });
  ASSERT_TRUE(sub.ok());
  {
    std::lock_guard<std::mutex> lock(mu);
    self = std::move(sub).value();
  }
  Inbox sentinel;
  auto sentinel_sub = nc->Subscribe("selfdestruct", "", Collect(sentinel));
  ASSERT_TRUE(sentinel_sub.ok());
  ASSERT_TRUE(nc->Flush(2s).ok());

  ASSERT_TRUE(nc->Publish("selfdestruct", Bytes("1")).ok());
  ASSERT_TRUE(WaitFor([&] { return destroyed.load(); }, 5s));
  for (int i = 0; i < 20; ++i) ASSERT_TRUE(nc->Publish("selfdestruct", Bytes("more")).ok());
  ASSERT_TRUE(WaitFor([&] { return sentinel.size() == 21; }, 5s));
  EXPECT_EQ(calls.load(), 1);
}

TEST_F(TransportTest, ThrowingHandlerIsCountedAndDeliveryContinues) {
  auto nc = Connect();
  ASSERT_NE(nc, nullptr);
  Inbox inbox;
  auto sub = nc->Subscribe("throws", "", [&](const IncomingMessage& m) {
    const std::string body = Text(m.data);
    if (body == "std") throw std::runtime_error("handler failed");
    if (body == "int") throw 42;  // not even a std::exception
    inbox.Add(body);
  });
  ASSERT_TRUE(sub.ok());
  ASSERT_TRUE(nc->Flush(2s).ok());
  for (const char* body : {"std", "ok1", "int", "ok2"}) {
    ASSERT_TRUE(nc->Publish("throws", Bytes(body)).ok());
  }
  ASSERT_TRUE(WaitFor([&] { return inbox.size() == 2 && nc->Stats().callback_errors == 2; }, 5s));
  EXPECT_EQ(inbox.items(), (std::vector<std::string>{"ok1", "ok2"}));
  EXPECT_EQ(nc->Stats().callback_errors, 2u);
}

TEST_F(TransportTest, ThrowingConnectionCallbackIsCounted) {
  std::atomic<int> reconnected{0};
  NatsClient::Callbacks callbacks;
  callbacks.on_disconnected = [] { throw std::runtime_error("on_disconnected failed"); };
  callbacks.on_reconnected = [&] {
    ++reconnected;
    throw std::runtime_error("on_reconnected failed");
  };
  auto nc = Connect({}, std::move(callbacks));
  ASSERT_NE(nc, nullptr);
  ASSERT_TRUE(nats_->Restart().ok());
  ASSERT_TRUE(WaitFor([&] { return reconnected.load() >= 1; }, 10s));
  ASSERT_TRUE(WaitFor([&] { return nc->Stats().callback_errors >= 2; }, 5s));
}

TEST_F(TransportTest, ReconnectAfterServerRestartResumesExistingSubscription) {
  std::atomic<int> reconnected{0};
  std::atomic<int> disconnected{0};
  NatsClient::Callbacks callbacks;
  callbacks.on_reconnected = [&] { ++reconnected; };
  callbacks.on_disconnected = [&] { ++disconnected; };
  auto nc = Connect({.name = "subscriber"}, std::move(callbacks));
  auto publisher = Connect({.name = "publisher"});
  ASSERT_TRUE(nc && publisher);

  Inbox inbox;
  auto sub = nc->Subscribe("kv.events", "", Collect(inbox));
  ASSERT_TRUE(sub.ok());
  ASSERT_TRUE(nc->Flush(2s).ok());
  ASSERT_TRUE(publisher->Publish("kv.events", Bytes("before")).ok());
  ASSERT_TRUE(WaitFor([&] { return inbox.Contains("before"); }, 5s));

  const int port = nats_->port();
  ASSERT_TRUE(nats_->Restart().ok());
  EXPECT_EQ(nats_->port(), port);

  ASSERT_TRUE(WaitFor([&] { return reconnected.load() >= 1; }, 10s));
  EXPECT_GE(disconnected.load(), 1);
  EXPECT_TRUE(nc->IsConnected());
  // The publisher reconnects on its own schedule: keep publishing until one message arrives
  // through the re-sent subscription.
  int n = 0;
  ASSERT_TRUE(WaitFor(
      [&] {
        (void)publisher->Publish("kv.events", Bytes("after-" + std::to_string(n++)));
        for (const auto& s : inbox.items()) {
          if (s.rfind("after-", 0) == 0) return true;
        }
        return false;
      },
      10s, 20ms));
  const NatsStats stats = nc->Stats();
  EXPECT_GE(stats.reconnects, 1u);
  EXPECT_GE(stats.disconnects, 1u);
  EXPECT_EQ(stats.callback_errors, 0u);
}

TEST_F(TransportTest, ConnectSucceedsBeforeServerIsUpAndConnectsInBackground) {
  auto port = PickFreePort();
  ASSERT_TRUE(port.ok());
  std::atomic<int> connected{0};
  NatsOptions options;
  options.url = "nats://127.0.0.1:" + std::to_string(*port);
  NatsClient::Callbacks callbacks;
  callbacks.on_reconnected = [&] { ++connected; };
  auto nc = NatsClient::Connect(options, std::move(callbacks));
  ASSERT_TRUE(nc.ok()) << nc.status().ToString();
  EXPECT_FALSE((*nc)->IsConnected());

  Inbox inbox;
  auto sub = (*nc)->Subscribe("late", "", Collect(inbox));
  ASSERT_TRUE(sub.ok()) << sub.status().ToString();

  auto late_server = NatsServerProcess::Start(*port);
  ASSERT_TRUE(late_server.ok()) << late_server.status().ToString();
  ASSERT_TRUE(WaitFor([&] { return connected.load() == 1; }, 10s));
  ASSERT_TRUE((*nc)->Flush(2s).ok());
  ASSERT_TRUE((*nc)->Publish("late", Bytes("hi")).ok());
  ASSERT_TRUE(WaitFor([&] { return inbox.Contains("hi"); }, 5s));
}

TEST_F(TransportTest, ClientDestroyedWhileStillConnectingReturnsPromptly) {
  auto port = PickFreePort();
  ASSERT_TRUE(port.ok());
  NatsOptions options;
  options.url = "nats://127.0.0.1:" + std::to_string(*port);
  auto nc = NatsClient::Connect(options, {});
  ASSERT_TRUE(nc.ok()) << nc.status().ToString();
  auto sub = (*nc)->Subscribe("never", "", [](const IncomingMessage&) {});
  ASSERT_TRUE(sub.ok());
  const auto start = std::chrono::steady_clock::now();
  nc->reset();  // closes while reconnect attempts are under way
  sub->reset();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
}

TEST_F(TransportTest, CommaSeparatedUrlListReachesTheLiveServer) {
  auto dead_port = PickFreePort();
  ASSERT_TRUE(dead_port.ok());
  NatsOptions options;
  options.url = "nats://127.0.0.1:" + std::to_string(*dead_port) + ", " + nats_->url();
  options.retry_on_failed_connect = false;  // must connect now, to the live one
  auto nc = NatsClient::Connect(options, {});
  ASSERT_TRUE(nc.ok()) << nc.status().ToString();
  EXPECT_TRUE((*nc)->IsConnected());
  EXPECT_TRUE((*nc)->Flush(2s).ok());
}

TEST_F(TransportTest, ConnectWithoutRetryFailsWhenNoServer) {
  auto port = PickFreePort();
  ASSERT_TRUE(port.ok());
  NatsOptions options;
  options.url = "nats://127.0.0.1:" + std::to_string(*port);
  options.retry_on_failed_connect = false;
  auto nc = NatsClient::Connect(options, {});
  ASSERT_FALSE(nc.ok());
  EXPECT_EQ(nc.status().code(), StatusCode::kInternal) << nc.status().ToString();
  EXPECT_NE(nc.status().message().find("connect to"), std::string::npos) << nc.status().ToString();
}

TEST_F(TransportTest, DrainDeliversQueuedMessagesThenCloses) {
  auto nc = Connect();
  ASSERT_NE(nc, nullptr);
  std::atomic<int> handled{0};
  auto sub = nc->Subscribe("drain.me", "", [&](const IncomingMessage&) { ++handled; });
  ASSERT_TRUE(sub.ok());
  ASSERT_TRUE(nc->Flush(2s).ok());
  for (int i = 0; i < 100; ++i) ASSERT_TRUE(nc->Publish("drain.me", Bytes("x")).ok());
  ASSERT_TRUE(nc->Flush(2s).ok());  // the server has sent them back to us
  nc->Drain(5s);
  EXPECT_EQ(handled.load(), 100);
  EXPECT_FALSE(nc->IsConnected());
  const Status after = nc->Publish("drain.me", Bytes("late"));
  EXPECT_FALSE(after.ok());
  EXPECT_EQ(nc->Stats().disconnects, 0u);  // our own close is not a disconnect
}

TEST_F(TransportTest, SubscriptionOutlivingItsClientIsSafe) {
  auto nc = Connect();
  ASSERT_NE(nc, nullptr);
  auto sub = nc->Subscribe("orphan", "", [](const IncomingMessage&) {});
  ASSERT_TRUE(sub.ok());
  nc.reset();
  std::unique_ptr<Subscription> owned = std::move(sub).value();
  EXPECT_EQ(owned->subject(), "orphan");
  owned.reset();  // must not hang or touch freed memory (ASan build checks the latter)
}

// nats.c 3.4's read loop may lock a subscription it looked up just before an unsubscribe
// (nats-io/nats.c#637): subscriptions destroyed while messages for them stream in must not be
// freed under it, and the ones kept back must be freed in bounded batches, not piled up.
TEST_F(TransportTest, SubscriptionsDestroyedDuringAFloodAreFreedInBoundedBatches) {
  auto nc = Connect();
  auto publisher = Connect({.name = "flood"});
  ASSERT_NE(nc, nullptr);
  ASSERT_NE(publisher, nullptr);
  std::atomic<bool> stop{false};
  std::thread flood([&] {
    while (!stop) (void)publisher->Publish("churn", Bytes("x"));
  });
  constexpr int kRounds = 100;
  std::size_t most_retired = 0;
  for (int i = 0; i < kRounds; ++i) {
    std::atomic<int> got{0};
    auto sub = nc->Subscribe("churn", "", [&](const IncomingMessage&) { ++got; });
    ASSERT_TRUE(sub.ok());
    ASSERT_TRUE(WaitFor([&] { return got.load() > 0; }, 5s)) << "round " << i;
    sub->reset();  // unsubscribes while the read loop is busy with this subject
    most_retired = std::max<std::size_t>(most_retired, nc->Stats().retired_subscriptions);
  }
  stop = true;
  flood.join();
  // 100 destroyed: three batches of 32 were freed by later Subscribe calls, 4 wait for the next.
  EXPECT_EQ(most_retired, NatsClient::kRetiredBatch);
  EXPECT_EQ(nc->Stats().retired_subscriptions, kRounds % NatsClient::kRetiredBatch);
}

TEST_F(TransportTest, InvalidSubjectIsInvalidArgument) {
  auto nc = Connect();
  ASSERT_NE(nc, nullptr);
  const Status st = nc->Publish("", Bytes("x"));
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
}

}  // namespace
}  // namespace kvrouter::testing
