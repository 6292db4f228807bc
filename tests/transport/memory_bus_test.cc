#include "transport/memory_bus.h"

#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tests/await.h"

namespace kvrouter {
namespace {

std::span<const std::byte> Bytes(std::string_view s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}
std::string Text(std::span<const std::byte> b) { return {reinterpret_cast<const char*>(b.data()), b.size()}; }

TEST(InMemoryBus, DeliversByWildcardAndOneMemberPerQueueGroup) {
  InMemoryBus bus;
  std::vector<std::string> got;
  auto all = bus.Subscribe("a.*", "", [&](const BusMessage& m) { got.push_back("all:" + std::string(m.subject)); });
  auto g1 = bus.Subscribe("a.>", "q", [&](const BusMessage&) { got.push_back("g1"); });
  auto g2 = bus.Subscribe("a.>", "q", [&](const BusMessage&) { got.push_back("g2"); });
  ASSERT_TRUE(bus.Publish("a.b", Bytes("x")).ok());
  ASSERT_TRUE(bus.Publish("a.c", Bytes("y")).ok());
  ASSERT_TRUE(bus.Publish("b.c", Bytes("z")).ok());
  EXPECT_EQ(got, (std::vector<std::string>{"all:a.b", "g1", "all:a.c", "g2"}));
  EXPECT_EQ(bus.published("a.b"), 1u);
}

TEST(InMemoryBus, PublishLargerThanMaxPayloadFails) {
  InMemoryBus bus;
  bus.set_max_payload(4);
  int delivered = 0;
  auto sub = bus.Subscribe("s", "", [&](const BusMessage&) { ++delivered; });
  EXPECT_TRUE(bus.Publish("s", Bytes("four")).ok());
  EXPECT_FALSE(bus.Publish("s", Bytes("fives")).ok());
  EXPECT_EQ(delivered, 1);
}

TEST(InMemoryBus, HandlerMayDropItsOwnSubscription) {
  InMemoryBus bus;
  std::unique_ptr<BusSubscription> sub;
  int calls = 0;
  sub = std::move(bus.Subscribe("s", "", [&](const BusMessage&) {
          ++calls;
          sub.reset();  // must not wait for itself
        })).value();
  ASSERT_TRUE(bus.Publish("s", Bytes("1")).ok());
  ASSERT_TRUE(bus.Publish("s", Bytes("2")).ok());
  EXPECT_EQ(calls, 1);
}

TEST(InMemoryBus, DroppingASubscriptionWaitsForItsRunningHandler) {
  InMemoryBus bus;
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  std::atomic<bool> in_handler{false}, handler_done{false};
  std::atomic<int> probes{0};
  auto sub = std::move(bus.Subscribe("s", "", [&](const BusMessage& m) {
               if (Text(m.data) != "block") {
                 ++probes;
                 return;
               }
               in_handler = true;
               std::unique_lock lk(mu);
               cv.wait(lk, [&] { return release; });
               handler_done = true;
             })).value();
  std::thread publisher([&] { (void)bus.Publish("s", Bytes("block")); });
  AwaitTrue([&] { return in_handler.load(); });
  std::atomic<bool> dropped{false};
  bool done_when_dropped = false;
  std::thread dropper([&] {
    sub.reset();
    done_when_dropped = handler_done.load();
    dropped = true;
  });
  // Once the subscription is unlinked, probes stop arriving: the dropper is inside the
  // destructor, which must now be waiting for the blocked handler.
  AwaitTrue([&] {
    const int before = probes.load();
    (void)bus.Publish("s", Bytes("probe"));
    return probes.load() == before;
  });
  EXPECT_FALSE(dropped.load());
  {
    std::lock_guard g(mu);
    release = true;
  }
  cv.notify_all();
  dropper.join();
  publisher.join();
  EXPECT_TRUE(done_when_dropped);
}

TEST(InMemoryBus, ConcurrentRequestsEachGetTheirOwnReply) {
  InMemoryBus bus;
  auto echo =
      std::move(bus.Subscribe("echo", "", [&](const BusMessage& m) { (void)bus.Publish(m.reply, m.data); })).value();
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 500; ++i) {
        const std::string body = std::to_string(t) + ":" + std::to_string(i);
        auto reply = bus.Request("echo", Bytes(body));
        if (!reply || Text(*reply) != body) ++wrong;
        // Subscriptions come and go while others publish.
        auto extra = bus.Subscribe("echo.extra." + std::to_string(t), "", [](const BusMessage&) {});
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(wrong.load(), 0);
}

}  // namespace
}  // namespace kvrouter
