#include "router/kvgateway/worker_directory.h"

#include <algorithm>
#include <chrono>
#include <set>
#include <utility>

namespace kvrouter {

std::vector<std::string> WorkerDirectory::Apply(const WorkerRegistration& reg, SteadyTime now) {
  KvMutexLock g(mu_);
  auto it = workers_.find(reg.worker_id);
  std::vector<std::string> before;  // its URL, when it leaves or moves
  if (it != workers_.end()) before.push_back(it->second.http_url);
  if (reg.leaving || reg.http_url.empty()) {
    if (it != workers_.end()) workers_.erase(it);
    return Unused(std::move(before));
  }
  if (it == workers_.end()) {
    if (workers_.size() >= kMaxWorkers) return {};
    it = workers_.emplace(reg.worker_id, Worker{}).first;
  }
  if (it->second.http_url != reg.http_url || !it->second.endpoint) {
    auto endpoint = ParseHttpUrl(reg.http_url);
    it->second.endpoint = endpoint.ok() ? std::optional<HttpEndpoint>(std::move(endpoint).value()) : std::nullopt;
  }
  it->second.http_url = reg.http_url;
  it->second.models = reg.models;
  it->second.role = reg.role;
  it->second.connector = reg.kv_connector;
  it->second.lease = std::chrono::milliseconds(reg.lease_ms);
  it->second.lease_end = now + it->second.lease;
  return Unused(std::move(before));
}

std::vector<std::string> WorkerDirectory::Expire(SteadyTime now) {
  KvMutexLock g(mu_);
  if (paused_) return {};
  std::vector<std::string> gone;
  std::erase_if(workers_, [&](const auto& w) {
    if (w.second.lease_end >= now) return false;
    gone.push_back(w.second.http_url);
    return true;
  });
  return Unused(std::move(gone));
}

std::vector<std::string> WorkerDirectory::Unused(std::vector<std::string> urls) const {
  std::sort(urls.begin(), urls.end());
  urls.erase(std::unique(urls.begin(), urls.end()), urls.end());
  std::erase_if(urls, [&](const std::string& url) {
    mu_.AssertHeld();
    return std::any_of(workers_.begin(), workers_.end(), [&](const auto& w) { return w.second.http_url == url; });
  });
  return urls;
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

std::optional<HttpEndpoint> WorkerDirectory::Endpoint(std::uint64_t worker_id) const {
  KvMutexLock g(mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) return std::nullopt;
  return it->second.endpoint;
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

std::vector<std::uint64_t> WorkerDirectory::Ids() const {
  KvMutexLock g(mu_);
  std::vector<std::uint64_t> ids;
  ids.reserve(workers_.size());
  for (const auto& [id, w] : workers_) ids.push_back(id);
  return ids;
}

bool WorkerDirectory::ServesAlone(std::uint64_t worker_id) const {
  KvMutexLock g(mu_);
  auto it = workers_.find(worker_id);
  return it == workers_.end() || it->second.role == WorkerRole::kBoth || it->second.connector != KvConnector::kSglang;
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
