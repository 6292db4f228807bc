// SessionAffinity: the worker rank each session last went to (docs/protocol.md section 11,
// "Session affinity"; --router-session-affinity-ttl-secs, --router-max-sessions). A binding holds
// for `ttl` after its last use; at most `max_sessions` are kept, the least recently used going
// first, so a client inventing session ids cannot grow the router. Whether a binding is obeyed
// (its rank still a candidate and not past the queue threshold) is the caller's business.
// Thread contract: none; Routing holds its routing mutex around every call.
//
//   if (auto w = affinity.Find("chat-7", now)) { ... }  affinity.Bind("chat-7", chosen, now);
#pragma once

#include <chrono>
#include <cstdint>
#include <list>
#include <optional>
#include <string>
#include <unordered_map>

#include "events/base/clock.h"
#include "router/index/worker_key.h"

namespace kvrouter {

class SessionAffinity {
 public:
  SessionAffinity(std::chrono::milliseconds ttl, std::size_t max_sessions);

  bool on() const { return ttl_.count() > 0; }
  // The rank `session` is bound to, when its binding was used less than ttl before `now`.
  std::optional<WorkerKey> Find(const std::string& session, SteadyTime now) const;
  // Binds `session` to `worker` (again), as used at `now`.
  void Bind(const std::string& session, WorkerKey worker, SteadyTime now);
  // Drops the bindings unused for ttl or more.
  void Expire(SteadyTime now);

  std::size_t size() const { return index_.size(); }
  std::uint64_t evicted() const { return evicted_; }  // dropped for room, not for age

 private:
  struct Binding {
    std::string session;
    WorkerKey worker;
    SteadyTime used;
  };
  using Lru = std::list<Binding>;  // most recently used first

  const std::chrono::milliseconds ttl_;
  const std::size_t max_sessions_;
  Lru lru_;
  std::unordered_map<std::string, Lru::iterator> index_;
  std::uint64_t evicted_ = 0;
};

}  // namespace kvrouter
