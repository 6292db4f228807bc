// EngineWatch on virtual time with checks answered by hand: up at the first healthy answer, down
// after `failures` consecutive failed checks (errors or no answer in time), up again, checks
// spaced by the interval and never two at once, late answers dropped, transitions logged at a
// limited rate.
#include "router/kvrelay/engine_watch.h"

#include <gtest/gtest.h>

#include <deque>
#include <string>
#include <vector>

namespace kvrouter {
namespace {

using std::chrono::milliseconds;

const SteadyTime kT0 = SteadyTime{} + std::chrono::hours(1);
SteadyTime At(int ms) { return kT0 + milliseconds(ms); }

// Checks that wait until the test answers them.
struct HandChecks {
  std::deque<EngineWatch::Done> pending;
  int started = 0;
  int cancelled = 0;
  EngineWatch::Check check() {
    return [this](EngineWatch::Done done) {
      ++started;
      pending.push_back(std::move(done));
      return [this] { ++cancelled; };
    };
  }
  // Answers the oldest check still open.
  void Answer(const Status& s) {
    ASSERT_FALSE(pending.empty());
    EngineWatch::Done d = std::move(pending.front());
    pending.pop_front();
    d(s);
  }
};

const Status kRefused = Internal("cannot connect to 127.0.0.1:8001: Connection refused");

class EngineWatchTest : public ::testing::Test {
 protected:
  void Make(EngineWatchOptions o = {.interval = milliseconds(1000), .timeout = milliseconds(1000), .failures = 2}) {
    watch_ = std::make_unique<EngineWatch>(o, checks_.check(), log_, "http://127.0.0.1:8001");
  }
  // One check: started at `ms` (a Poll there), answered `s`, judged 10 ms later.
  EngineTransition CheckAt(int ms, const Status& s) {
    EXPECT_EQ(watch_->Poll(At(ms)), EngineTransition::kNone);
    checks_.Answer(s);
    return watch_->Poll(At(ms + 10));
  }
  // From nothing to up, the check at 0 ms.
  void Up() { ASSERT_EQ(CheckAt(0, Status::Ok()), EngineTransition::kUp); }

  HandChecks checks_;
  SteadyTime log_now_ = kT0;
  std::vector<std::string> lines_;
  RateLimitedLog log_{std::chrono::seconds(10), [this] { return log_now_; },
                      [this](LogLevel, std::string_view line) { lines_.emplace_back(line); }};
  std::unique_ptr<EngineWatch> watch_;
};

TEST_F(EngineWatchTest, TheFirstHealthyAnswerIsUp) {
  Make();
  EXPECT_EQ(watch_->health(), EngineHealth::kStarting);
  Up();
  EXPECT_EQ(watch_->health(), EngineHealth::kUp);
  EXPECT_EQ(watch_->counters().ups, 1u);
  EXPECT_EQ(CheckAt(1000, Status::Ok()), EngineTransition::kNone);  // still up: nothing new
  EXPECT_EQ(watch_->counters().checks, 2u);
}

TEST_F(EngineWatchTest, FailuresBeforeTheFirstHealthyAnswerChangeNothing) {
  Make();
  for (int i = 0; i < 5; ++i) EXPECT_EQ(CheckAt(i * 1000, kRefused), EngineTransition::kNone);
  EXPECT_EQ(watch_->health(), EngineHealth::kStarting);
  EXPECT_EQ(watch_->counters().checks_failed, 5u);
  EXPECT_EQ(watch_->counters().downs, 0u);
  EXPECT_EQ(CheckAt(5000, Status::Ok()), EngineTransition::kUp);
}

TEST_F(EngineWatchTest, DownAfterTheConfiguredNumberOfFailuresInARow) {
  Make();
  Up();
  EXPECT_EQ(CheckAt(1000, kRefused), EngineTransition::kNone);
  EXPECT_EQ(watch_->health(), EngineHealth::kUp);
  EXPECT_EQ(CheckAt(2000, Internal("/health answered 503")), EngineTransition::kDown);
  EXPECT_EQ(watch_->health(), EngineHealth::kDown);
  EXPECT_EQ(watch_->last_failure().message(), "/health answered 503");
  EXPECT_EQ(watch_->counters().downs, 1u);
  EXPECT_EQ(CheckAt(3000, kRefused), EngineTransition::kNone);  // down stays down: said once
}

TEST_F(EngineWatchTest, OneFailureIsEnoughWhenConfiguredSo) {
  Make({.interval = milliseconds(1000), .timeout = milliseconds(1000), .failures = 1});
  Up();
  EXPECT_EQ(CheckAt(1000, kRefused), EngineTransition::kDown);
}

TEST_F(EngineWatchTest, AHealthyAnswerBetweenFailuresStartsTheCountAgain) {
  Make({.interval = milliseconds(1000), .timeout = milliseconds(1000), .failures = 3});
  Up();
  EXPECT_EQ(CheckAt(1000, kRefused), EngineTransition::kNone);
  EXPECT_EQ(CheckAt(2000, kRefused), EngineTransition::kNone);
  EXPECT_EQ(CheckAt(3000, Status::Ok()), EngineTransition::kNone);
  EXPECT_EQ(CheckAt(4000, kRefused), EngineTransition::kNone);
  EXPECT_EQ(CheckAt(5000, kRefused), EngineTransition::kNone);
  EXPECT_EQ(CheckAt(6000, kRefused), EngineTransition::kDown);
}

TEST_F(EngineWatchTest, AnEngineThatAnswersAgainIsUpAgain) {
  Make();
  Up();
  EXPECT_EQ(CheckAt(1000, kRefused), EngineTransition::kNone);
  EXPECT_EQ(CheckAt(2000, kRefused), EngineTransition::kDown);
  EXPECT_EQ(CheckAt(3000, Status::Ok()), EngineTransition::kUp);
  EXPECT_EQ(watch_->health(), EngineHealth::kUp);
  const EngineWatch::Counters c = watch_->counters();
  EXPECT_EQ(c.ups, 2u);
  EXPECT_EQ(c.downs, 1u);
  EXPECT_EQ(c.checks, 4u);
  EXPECT_EQ(c.checks_failed, 2u);
}

TEST_F(EngineWatchTest, AnUnansweredCheckFailsAtItsTimeoutAndIsCancelled) {
  Make({.interval = milliseconds(1000), .timeout = milliseconds(300), .failures = 1});
  Up();
  EXPECT_EQ(watch_->Poll(At(1000)), EngineTransition::kNone);  // starts a check nobody answers
  EXPECT_EQ(watch_->Poll(At(1299)), EngineTransition::kNone);
  EXPECT_EQ(checks_.cancelled, 0);
  EXPECT_EQ(watch_->Poll(At(1300)), EngineTransition::kDown);
  EXPECT_EQ(checks_.cancelled, 1);
  EXPECT_EQ(watch_->last_failure().code(), StatusCode::kTimeout);
  // Its answer, late, counts for nothing: the engine is up again only when a new check says so.
  checks_.Answer(Status::Ok());
  EXPECT_EQ(watch_->Poll(At(1500)), EngineTransition::kNone);
  EXPECT_EQ(watch_->health(), EngineHealth::kDown);
  EXPECT_EQ(CheckAt(2000, Status::Ok()), EngineTransition::kUp);
}

TEST_F(EngineWatchTest, ChecksStartEveryIntervalAndNeverTwoAtOnce) {
  Make({.interval = milliseconds(100), .timeout = milliseconds(1000), .failures = 2});
  watch_->Poll(At(0));
  EXPECT_EQ(checks_.started, 1);
  for (int ms = 10; ms < 1000; ms += 10) watch_->Poll(At(ms));  // the first one still open
  EXPECT_EQ(checks_.started, 1);
  checks_.Answer(Status::Ok());
  watch_->Poll(At(1000));  // judged, and the next one is long due
  EXPECT_EQ(checks_.started, 2);
  checks_.Answer(Status::Ok());
  watch_->Poll(At(1050));
  EXPECT_EQ(checks_.started, 2);  // answered, but the interval is not over
  watch_->Poll(At(1100));
  EXPECT_EQ(checks_.started, 3);
}

TEST_F(EngineWatchTest, AnAnswerGivenInsideTheCheckIsTaken) {
  int started = 0;
  watch_ = std::make_unique<EngineWatch>(
      EngineWatchOptions{},
      [&](EngineWatch::Done done) {
        ++started;
        done(Status::Ok());  // before the check function even returns
        return std::function<void()>();
      },
      log_, "e");
  EXPECT_EQ(watch_->Poll(At(0)), EngineTransition::kNone);
  EXPECT_EQ(watch_->Poll(At(1)), EngineTransition::kUp);
  EXPECT_EQ(started, 1);
}

TEST_F(EngineWatchTest, AnAnswerAfterTheWatchIsGoneIsHarmless) {
  Make();
  watch_->Poll(At(0));
  watch_.reset();
  EXPECT_EQ(checks_.cancelled, 1);  // the check in flight was cancelled
  checks_.Answer(Status::Ok());     // and its answer comes anyway
}

TEST_F(EngineWatchTest, TransitionsAreLoggedAtALimitedRate) {
  Make({.interval = milliseconds(100), .timeout = milliseconds(100), .failures = 1});
  // Flapping: up, down, up, down within one second of the log's clock.
  EXPECT_EQ(CheckAt(0, Status::Ok()), EngineTransition::kUp);
  EXPECT_EQ(CheckAt(100, kRefused), EngineTransition::kDown);
  EXPECT_EQ(CheckAt(200, Status::Ok()), EngineTransition::kUp);
  EXPECT_EQ(CheckAt(300, kRefused), EngineTransition::kDown);
  auto count = [&](std::string_view what) {
    return std::count_if(lines_.begin(), lines_.end(),
                         [&](const std::string& l) { return l.find(what) != std::string::npos; });
  };
  EXPECT_EQ(count(": up"), 1);
  EXPECT_EQ(count(": down"), 1);
  EXPECT_NE(lines_.back().find("Connection refused"), std::string::npos) << lines_.back();
  log_now_ += std::chrono::seconds(11);  // the next one after the interval is written
  EXPECT_EQ(CheckAt(400, Status::Ok()), EngineTransition::kUp);
  EXPECT_EQ(count(": up"), 2);
  EXPECT_EQ(watch_->counters().ups, 3u);  // counted, all of them
  EXPECT_EQ(watch_->counters().downs, 2u);
}

}  // namespace
}  // namespace kvrouter
