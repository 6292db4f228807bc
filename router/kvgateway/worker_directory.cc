#include "router/kvgateway/worker_directory.h"

#include <algorithm>
#include <chrono>
#include <set>
#include <utility>

namespace kvrouter {

void WorkerDirectory::Apply(const WorkerRegistration& reg, SteadyTime now) {
  KvMutexLock g(mu_);
  if (reg.leaving || reg.http_url.empty()) {
    workers_.erase(reg.worker_id);
    return;
  }
  auto it = workers_.find(reg.worker_id);
  if (it == workers_.end()) {
    if (workers_.size() >= kMaxWorkers) return;
    it = workers_.emplace(reg.worker_id, Worker{}).first;
  }
  it->second.http_url = reg.http_url;
  it->second.models = reg.models;
  it->second.role = reg.role;
  it->second.lease = std::chrono::milliseconds(reg.lease_ms);
  it->second.lease_end = now + it->second.lease;
}

void WorkerDirectory::Expire(SteadyTime now) {
  KvMutexLock g(mu_);
  if (paused_) return;
  std::erase_if(workers_, [&](const auto& w) { return w.second.lease_end < now; });
}

void WorkerDirectory::Pause() {
  KvMutexLock g(mu_);
  paused_ = true;
}

void WorkerDirectory::Resume(SteadyTime now) {
  KvMutexLock g(mu_);
  if (!std::exchange(paused_, false)) return;
  for (auto& [id, w] : workers_) w.lease_end = std::max(w.lease_end, now + w.lease);
}

std::vector<std::uint64_t> WorkerDirectory::Serving(std::string_view model) const {
  KvMutexLock g(mu_);
  std::vector<std::uint64_t> ids;
  for (const auto& [id, w] : workers_) {
    if (std::find(w.models.begin(), w.models.end(), model) != w.models.end()) ids.push_back(id);
  }
  return ids;
}

std::optional<std::string> WorkerDirectory::HttpUrl(std::uint64_t worker_id) const {
  KvMutexLock g(mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) return std::nullopt;
  return it->second.http_url;
}

WorkerRole WorkerDirectory::Role(std::uint64_t worker_id) const {
  KvMutexLock g(mu_);
  auto it = workers_.find(worker_id);
  return it == workers_.end() ? WorkerRole::kBoth : it->second.role;
}

std::vector<std::string> WorkerDirectory::Models() const {
  KvMutexLock g(mu_);
  std::set<std::string> models;
  for (const auto& [id, w] : workers_) models.insert(w.models.begin(), w.models.end());
  return {models.begin(), models.end()};
}

std::size_t WorkerDirectory::size() const {
  KvMutexLock g(mu_);
  return workers_.size();
}

}  // namespace kvrouter
