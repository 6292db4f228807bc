#include "router/scheduling/session_affinity.h"

#include <algorithm>

namespace kvrouter {

SessionAffinity::SessionAffinity(std::chrono::milliseconds ttl, std::size_t max_sessions)
    : ttl_(ttl), max_sessions_(std::max<std::size_t>(1, max_sessions)) {}

std::optional<WorkerKey> SessionAffinity::Find(const std::string& session, SteadyTime now) const {
  auto it = index_.find(session);
  if (it == index_.end() || now - it->second->used >= ttl_) return std::nullopt;
  return it->second->worker;
}

void SessionAffinity::Bind(const std::string& session, WorkerKey worker, SteadyTime now) {
  if (!on() || session.empty()) return;
  if (auto it = index_.find(session); it != index_.end()) {
    it->second->worker = worker;
    it->second->used = now;
    lru_.splice(lru_.begin(), lru_, it->second);
    return;
  }
  if (index_.size() >= max_sessions_) {
    index_.erase(lru_.back().session);
    lru_.pop_back();
    ++evicted_;
  }
  lru_.push_front(Binding{session, worker, now});
  index_.emplace(session, lru_.begin());
}

void SessionAffinity::Expire(SteadyTime now) {
  while (!lru_.empty() && now - lru_.back().used >= ttl_) {
    index_.erase(lru_.back().session);
    lru_.pop_back();
  }
}

}  // namespace kvrouter
