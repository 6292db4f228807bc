#include "router/kvrelay/engine_watch.h"

#include <fmt/format.h>

#include <utility>

namespace kvrouter {

EngineWatch::EngineWatch(EngineWatchOptions options, Check check, RateLimitedLog& log, std::string engine)
    : options_(options), check_(std::move(check)), log_(log), engine_(std::move(engine)) {}

EngineWatch::~EngineWatch() {
  if (in_flight_ && cancel_) cancel_();
}

EngineTransition EngineWatch::Poll(SteadyTime now) {
  std::optional<Status> outcome;
  if (in_flight_) {
    {
      KvMutexLock g(mailbox_->mu);
      if (mailbox_->answer) {
        outcome = std::move(mailbox_->answer);
        mailbox_->answer.reset();
        mailbox_->awaited = 0;
      }
    }
    if (!outcome && now - started_ >= options_.timeout) {
      {
        KvMutexLock g(mailbox_->mu);
        mailbox_->awaited = 0;  // a late answer is dropped
      }
      if (cancel_) cancel_();
      outcome = Status(StatusCode::kTimeout, fmt::format("no answer within {} ms", options_.timeout.count()));
    }
    if (outcome) {
      in_flight_ = false;
      cancel_ = nullptr;
    }
  }
  const EngineTransition transition = outcome ? Judge(*outcome) : EngineTransition::kNone;
  if (!in_flight_ && now >= next_check_) StartCheck(now);
  return transition;
}

EngineTransition EngineWatch::Judge(const Status& outcome) {
  KvMutexLock g(mu_);
  if (outcome.ok()) {
    consecutive_failures_ = 0;
    if (health_ == EngineHealth::kUp) return EngineTransition::kNone;
    health_ = EngineHealth::kUp;
    ++counters_.ups;
    log_.Log(LogLevel::kInfo, "engine up", "engine {} answers its health checks: up", engine_);
    return EngineTransition::kUp;
  }
  ++counters_.checks_failed;
  ++consecutive_failures_;
  last_failure_ = outcome;
  if (health_ == EngineHealth::kUp && consecutive_failures_ >= options_.failures) {
    health_ = EngineHealth::kDown;
    ++counters_.downs;
    log_.Log(LogLevel::kWarning, "engine down", "engine {} failed {} health checks in a row (the last: {}): down",
             engine_, consecutive_failures_, outcome.message());
    return EngineTransition::kDown;
  }
  log_.Log(LogLevel::kWarning, "health check", "engine {} {}: {}", engine_,
           health_ == EngineHealth::kStarting ? "not answering yet" : "health check failed", outcome.message());
  return EngineTransition::kNone;
}

void EngineWatch::StartCheck(SteadyTime now) {
  const std::uint64_t id = ++last_check_;
  {
    KvMutexLock g(mailbox_->mu);
    mailbox_->awaited = id;
    mailbox_->answer.reset();
  }
  {
    KvMutexLock g(mu_);
    ++counters_.checks;
  }
  in_flight_ = true;
  started_ = now;
  next_check_ = now + options_.interval;
  // `done` may run right here, inside check_ (so no lock is held around it), or much later.
  cancel_ = check_([mailbox = mailbox_, id](const Status& s) {
    KvMutexLock g(mailbox->mu);
    if (mailbox->awaited == id && !mailbox->answer) mailbox->answer = s;
  });
}

EngineHealth EngineWatch::health() const {
  KvMutexLock g(mu_);
  return health_;
}

EngineWatch::Counters EngineWatch::counters() const {
  KvMutexLock g(mu_);
  return counters_;
}

}  // namespace kvrouter
