#include "events/base/log.h"

#include <chrono>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace kvrouter {
namespace {

using namespace std::chrono_literals;

struct FakeClockAndSink {
  SteadyTime now{};
  std::vector<std::string> lines;

  RateLimitedLog Make(std::chrono::milliseconds interval) {
    return RateLimitedLog(
        interval, [this] { return now; }, [this](LogLevel, std::string_view line) { lines.emplace_back(line); });
  }
};

TEST(RateLimitedLogTest, FirstLineOfAKeyIsWrittenAtOnce) {
  FakeClockAndSink env;
  RateLimitedLog log = env.Make(1s);
  EXPECT_TRUE(log.Log(LogLevel::kWarning, "decode", "bad message from {}", "w1"));
  ASSERT_EQ(env.lines.size(), 1u);
  EXPECT_EQ(env.lines[0], "kvrouter W [decode] bad message from w1");
}

TEST(RateLimitedLogTest, LinesWithinTheIntervalAreSuppressedAndCounted) {
  FakeClockAndSink env;
  RateLimitedLog log = env.Make(1s);
  EXPECT_TRUE(log.Log(LogLevel::kError, "k", "one"));
  env.now += 500ms;
  EXPECT_FALSE(log.Log(LogLevel::kError, "k", "two"));
  EXPECT_FALSE(log.Log(LogLevel::kError, "k", "three"));
  EXPECT_EQ(env.lines.size(), 1u);
  EXPECT_EQ(log.suppressed_total(), 2u);

  env.now += 500ms;  // interval over
  EXPECT_TRUE(log.Log(LogLevel::kError, "k", "four"));
  ASSERT_EQ(env.lines.size(), 2u);
  EXPECT_EQ(env.lines[1], "kvrouter E [k] four (2 similar suppressed)");
}

TEST(RateLimitedLogTest, KeysAreLimitedIndependently) {
  FakeClockAndSink env;
  RateLimitedLog log = env.Make(1s);
  EXPECT_TRUE(log.Log(LogLevel::kInfo, "a", "x"));
  EXPECT_TRUE(log.Log(LogLevel::kInfo, "b", "y"));
  EXPECT_FALSE(log.Log(LogLevel::kInfo, "a", "z"));
  EXPECT_EQ(env.lines.size(), 2u);
}

TEST(RateLimitedLogTest, AdmitReportsSuppressedCountOfThatKeyOnly) {
  FakeClockAndSink env;
  RateLimitedLog log = env.Make(1s);
  uint64_t suppressed = 99;
  EXPECT_TRUE(log.Admit("a", &suppressed));
  EXPECT_EQ(suppressed, 0u);
  EXPECT_FALSE(log.Admit("a", &suppressed));
  EXPECT_FALSE(log.Admit("a", &suppressed));
  EXPECT_TRUE(log.Admit("b", &suppressed));
  EXPECT_EQ(suppressed, 0u);
  env.now += 2s;
  EXPECT_TRUE(log.Admit("a", &suppressed));
  EXPECT_EQ(suppressed, 2u);
}

TEST(RateLimitedLogTest, KeyTableIsBoundedAndOverflowKeysShareOneLimit) {
  FakeClockAndSink env;
  RateLimitedLog log = env.Make(1s);
  for (std::size_t i = 0; i < RateLimitedLog::kMaxKeys; ++i) {
    EXPECT_TRUE(log.Log(LogLevel::kWarning, "key-" + std::to_string(i), "first of its key"));
  }
  // Past the bound every new key shares one limit: one line, then suppression.
  EXPECT_TRUE(log.Log(LogLevel::kWarning, "peer-a", "one"));
  for (int i = 0; i < 1000; ++i) EXPECT_FALSE(log.Log(LogLevel::kWarning, "peer-" + std::to_string(i), "more"));
  EXPECT_EQ(env.lines.size(), RateLimitedLog::kMaxKeys + 1);
  EXPECT_EQ(log.suppressed_total(), 1000u);
  // Known keys keep their own limit.
  env.now += 2s;
  EXPECT_TRUE(log.Log(LogLevel::kWarning, "key-0", "again"));
}

}  // namespace
}  // namespace kvrouter
