#include "router/replica_peers.h"

#include <algorithm>

namespace kvrouter {

void ReplicaPeers::Heard(std::uint64_t router_id, Time now) {
  auto it = last_heard_.find(router_id);
  if (it != last_heard_.end()) {
    it->second = now;
  } else if (last_heard_.size() < kMaxPeers) {
    last_heard_.emplace(router_id, now);
  }
}

void ReplicaPeers::Booked(std::uint64_t router_id, const std::string& request_id, Time now) {
  origin_[request_id] = router_id;
  Seen(router_id, now);
}

void ReplicaPeers::Seen(std::uint64_t router_id, Time now) {
  if (auto it = last_heard_.find(router_id); it != last_heard_.end()) it->second = now;
}

std::vector<std::string> ReplicaPeers::TakeSilent(Time now) {
  std::vector<std::string> released;
  if (paused_) return released;
  std::vector<std::uint64_t> silent;
  for (const auto& [id, heard] : last_heard_) {
    if (now - heard >= kSilence) silent.push_back(id);
  }
  if (silent.empty()) return released;
  for (std::uint64_t id : silent) last_heard_.erase(id);
  dead_ += silent.size();
  for (auto it = origin_.begin(); it != origin_.end();) {
    if (std::find(silent.begin(), silent.end(), it->second) != silent.end()) {
      released.push_back(it->first);
      it = origin_.erase(it);
    } else {
      ++it;
    }
  }
  return released;
}

void ReplicaPeers::Prune(const std::function<bool(const std::string&)>& gone) {
  std::erase_if(origin_, [&](const auto& e) { return gone(e.first); });
}

std::vector<std::string> ReplicaPeers::Resume(Time now) {
  paused_ = false;
  for (auto& [id, heard] : last_heard_) heard = now;
  std::vector<std::string> all;
  all.reserve(origin_.size());
  for (auto& [request, peer] : origin_) all.push_back(request);
  origin_.clear();
  return all;
}

}  // namespace kvrouter
