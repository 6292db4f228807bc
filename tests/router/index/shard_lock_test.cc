#include "router/index/shard_lock.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "tests/await.h"

namespace kvrouter {
namespace {

TEST(ShardLock, YieldToReadersDoesNothingWhenNoReaderWaits) {
  ShardLock mu;
  mu.lock();
  EXPECT_FALSE(mu.ReadersWaiting());
  EXPECT_FALSE(mu.YieldToReaders());
  // Still held for writing: a reader on another thread cannot get in.
  std::atomic<bool> got_in{false};
  std::thread reader([&] {
    KvReaderLock r(mu);
    got_in = true;
  });
  EXPECT_TRUE(AwaitTrue([&] { return mu.ReadersWaiting(); }));
  EXPECT_FALSE(got_in.load());
  mu.unlock();
  reader.join();
  EXPECT_TRUE(got_in.load());
}

TEST(ShardLock, AWaitingReaderGetsInBetweenTheWritersSteps) {
  ShardLock mu;
  mu.lock();  // the writer's session: it never calls unlock() itself until the end
  std::atomic<bool> got_in{false};
  std::thread reader([&] {
    KvReaderLock r(mu);
    got_in = true;
  });
  EXPECT_TRUE(AwaitTrue([&] { return mu.ReadersWaiting(); }));
  // Between steps the writer yields; the reader gets in and out while the session goes on.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!got_in.load() && std::chrono::steady_clock::now() < deadline) mu.YieldToReaders();
  EXPECT_TRUE(got_in.load());
  EXPECT_FALSE(mu.ReadersWaiting());
  mu.unlock();
  reader.join();
}

TEST(ShardLock, ReadersNeverSeeAWriterHalfwayThroughAStep) {
  ShardLock mu;
  // Two values the writer keeps equal at the end of each step, and makes unequal inside it.
  std::uint64_t a = 0, b = 0;
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> reads{0}, torn{0};
  std::vector<std::thread> readers;
  for (int t = 0; t < 2; ++t) {
    readers.emplace_back([&] {
      while (!stop.load()) {
        KvReaderLock r(mu);
        if (a != b) torn.fetch_add(1);
        reads.fetch_add(1);
      }
    });
  }
  mu.lock();
  for (int step = 0; step < 20000; ++step) {
    ++a;
    ++b;
    mu.YieldToReaders();
  }
  mu.unlock();
  // Keep going until the readers have had their turns, with the lock taken and let go per step.
  ASSERT_TRUE(AwaitTrue([&] {
    mu.lock();
    ++a;
    ++b;
    mu.unlock();
    return reads.load() > 1000;
  }));
  stop = true;
  for (auto& r : readers) r.join();
  EXPECT_EQ(torn.load(), 0u);
}

}  // namespace
}  // namespace kvrouter
