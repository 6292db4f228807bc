// EngineWatch: whether the engine beside kvrelay is alive, judged from periodic health checks
// (GET {engine}/health) as a state machine on the time it is handed. A check starts every
// `interval` (never two at once); one not answered within `timeout` fails and is cancelled. The
// first healthy answer while the engine is not known up is the transition kUp; `failures`
// consecutive failed checks while it is up are kDown. Before the first healthy answer failures
// change nothing (the engine is still starting). Transitions and failures are logged through a
// RateLimitedLog (fixed keys: "engine up", "engine down", "health check").
// No sockets: the check is a function (HttpHealthChecks in health_check.h; tests answer by hand).
//
// Thread contract: Poll on one thread (kvrelay's ZMQ loop); health() and counters() from any
// thread (metrics). A check's `done` may run on any thread, at any time, even after the watch is
// gone: it only fills a mailbox the watch shares with it. Ownership: the watch owns that mailbox;
// the check function (and what it captures) must outlive the watch; the log is borrowed.
//
//   EngineWatch watch({.interval = 1s, .timeout = 1s, .failures = 2}, checks.check(), log, url);
//   if (watch.Poll(now) == EngineTransition::kDown) relay.EngineDown(watch.last_failure().message());
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "events/base/clock.h"
#include "events/base/log.h"
#include "events/base/status.h"
#include "events/base/thread_annotations.h"

namespace kvrouter {

struct EngineWatchOptions {
  std::chrono::milliseconds interval{1000};  // between the starts of two checks (--health-interval-ms)
  std::chrono::milliseconds timeout{1000};   // a check unanswered this long failed (--health-timeout-ms)
  std::uint32_t failures = 2;                // consecutive failed checks that take an up engine down (>= 1)
};

// kStarting: no healthy answer yet; kUp: answering; kDown: was up, then failed `failures` checks.
enum class EngineHealth { kStarting, kUp, kDown };
enum class EngineTransition { kNone, kUp, kDown };

class EngineWatch {
 public:
  // Starts one check of the engine; `done` is to run once, on any thread, with OK (healthy) or why
  // not. Returns a function that cancels the check (may be empty); `done` may still run after it.
  using Done = std::function<void(const Status&)>;
  using Check = std::function<std::function<void()>(Done done)>;

  struct Counters {
    std::uint64_t checks = 0;         // started
    std::uint64_t checks_failed = 0;  // an error, a non-2xx answer, or no answer within the timeout
    std::uint64_t ups = 0;            // transitions to up (the first healthy answer included)
    std::uint64_t downs = 0;          // transitions to down
  };

  // `engine` names the engine in log lines (its URL).
  EngineWatch(EngineWatchOptions options, Check check, RateLimitedLog& log, std::string engine);
  ~EngineWatch();  // cancels a check in flight
  EngineWatch(const EngineWatch&) = delete;
  EngineWatch& operator=(const EngineWatch&) = delete;

  // Takes the answer of the check in flight (or fails it when its time is up), judges it, and
  // starts the next check when one is due. At most one transition per call.
  EngineTransition Poll(SteadyTime now);

  // Why the last failed check failed (OK before any failed). Poll's thread.
  const Status& last_failure() const { return last_failure_; }
  EngineHealth health() const;
  Counters counters() const;

 private:
  // Where a check's `done` leaves its answer; shared with the check, so a late answer is safe.
  struct Mailbox {
    KvMutex mu;
    std::uint64_t awaited KV_GUARDED_BY(mu) = 0;  // the check whose answer is wanted (0: none)
    std::optional<Status> answer KV_GUARDED_BY(mu);
  };

  EngineTransition Judge(const Status& outcome);
  void StartCheck(SteadyTime now);

  const EngineWatchOptions options_;
  const Check check_;
  RateLimitedLog& log_;
  const std::string engine_;
  const std::shared_ptr<Mailbox> mailbox_ = std::make_shared<Mailbox>();
  // Poll's thread only:
  std::uint64_t last_check_ = 0;  // number of the last check started
  bool in_flight_ = false;
  SteadyTime started_{}, next_check_{};
  std::function<void()> cancel_;
  std::uint32_t consecutive_failures_ = 0;
  Status last_failure_;
  // Poll writes, any thread reads:
  mutable KvMutex mu_;
  EngineHealth health_ KV_GUARDED_BY(mu_) = EngineHealth::kStarting;
  Counters counters_ KV_GUARDED_BY(mu_);
};

}  // namespace kvrouter
