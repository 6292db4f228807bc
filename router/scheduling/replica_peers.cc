#include "router/scheduling/replica_peers.h"

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

std::optional<std::vector<std::string>> ReplicaPeers::Advance(std::uint64_t router_id, std::uint32_t epoch, Time now) {
  auto it = epoch_.find(router_id);
  if (it == epoch_.end()) {
    if (epoch_.size() >= kMaxPeers) return std::nullopt;  // not tracked: not judged either
    epoch_.emplace(router_id, Epoch{epoch, now});
    if (epoch == 0) return std::nullopt;
  } else {
    it->second.last_seen = now;
    if (epoch <= it->second.epoch) return std::nullopt;
    it->second.epoch = epoch;
  }
  return TakeBookings([&](std::uint64_t peer) { return peer == router_id; });
}

void ReplicaPeers::Booked(std::uint64_t router_id, const std::string& request_id, Time now) {
  origin_[request_id] = router_id;
  Seen(router_id, now);
}

void ReplicaPeers::Seen(std::uint64_t router_id, Time now) {
  if (auto it = last_heard_.find(router_id); it != last_heard_.end()) it->second = now;
  if (auto it = epoch_.find(router_id); it != epoch_.end()) it->second.last_seen = now;
}

std::vector<std::string> ReplicaPeers::TakeSilent(Time now) {
  if (paused_) return {};
  std::erase_if(epoch_, [&](const auto& e) {
    return !last_heard_.contains(e.first) && now - e.second.last_seen >= kForgetEpoch;
  });
  std::vector<std::uint64_t> silent;
  for (const auto& [id, heard] : last_heard_) {
    if (now - heard >= kSilence) silent.push_back(id);
  }
  if (silent.empty()) return {};
  for (std::uint64_t id : silent) {
    last_heard_.erase(id);
    epoch_.erase(id);
  }
  dead_ += silent.size();
  return TakeBookings(
      [&](std::uint64_t peer) { return std::find(silent.begin(), silent.end(), peer) != silent.end(); });
}

std::vector<std::string> ReplicaPeers::TakeBookings(const std::function<bool(std::uint64_t)>& take) {
  std::vector<std::string> taken;
  for (auto it = origin_.begin(); it != origin_.end();) {
    if (take(it->second)) {
      taken.push_back(it->first);
      it = origin_.erase(it);
    } else {
      ++it;
    }
  }
  return taken;
}

void ReplicaPeers::Prune(const std::function<bool(const std::string&)>& gone) {
  std::erase_if(origin_, [&](const auto& e) { return gone(e.first); });
}

std::vector<std::string> ReplicaPeers::Resume(Time now) {
  paused_ = false;
  for (auto& [id, heard] : last_heard_) heard = now;
  return TakeBookings([](std::uint64_t) { return true; });
}

}  // namespace kvrouter
