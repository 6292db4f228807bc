#include "router/kvgateway/engine_load.h"

#include <utility>

namespace kvrouter {

EngineLoad::Hold EngineLoad::Add(std::uint64_t worker) {
  {
    KvMutexLock g(counts_->mu);
    ++counts_->in_flight[worker];
  }
  // The deleter decrements; the pointer itself is a non-null token.
  return Hold(reinterpret_cast<void*>(worker + 1), [counts = counts_, worker](void*) {
    KvMutexLock g(counts->mu);
    auto it = counts->in_flight.find(worker);
    if (it != counts->in_flight.end() && --it->second == 0) counts->in_flight.erase(it);
  });
}

std::uint32_t EngineLoad::InFlight(std::uint64_t worker) const {
  KvMutexLock g(counts_->mu);
  auto it = counts_->in_flight.find(worker);
  return it == counts_->in_flight.end() ? 0 : it->second;
}

void EngineLoad::Failed(std::uint64_t worker, SteadyTime now) {
  KvMutexLock g(counts_->mu);
  auto& f = counts_->failed;
  if (f.size() > 1024) std::erase_if(f, [&](const auto& e) { return now - e.second >= kFailedPause; });
  f[worker] = now;
}

bool EngineLoad::AnyHealthy(std::span<const std::uint64_t> workers, SteadyTime now) const {
  KvMutexLock g(counts_->mu);
  for (std::uint64_t id : workers) {
    auto f = counts_->failed.find(id);
    if (f == counts_->failed.end() || now - f->second >= kFailedPause) return true;
  }
  return false;
}

std::optional<std::uint64_t> EngineLoad::Least(std::span<const std::uint64_t> candidates, std::size_t rotation,
                                               SteadyTime now) const {
  if (candidates.empty()) return std::nullopt;
  const std::size_t n = candidates.size();
  const std::size_t start = rotation % n;
  KvMutexLock g(counts_->mu);
  // Ordered by (failed within kFailedPause, calls in flight): the least loaded healthy engine,
  // or the least loaded of all when none is healthy.
  std::optional<std::uint64_t> best;
  std::pair<bool, std::uint32_t> best_key{};
  for (std::size_t k = 0; k < n; ++k) {
    const std::uint64_t id = candidates[(start + k) % n];
    auto it = counts_->in_flight.find(id);
    auto f = counts_->failed.find(id);
    const std::pair<bool, std::uint32_t> key{f != counts_->failed.end() && now - f->second < kFailedPause,
                                             it == counts_->in_flight.end() ? 0 : it->second};
    if (!best || key < best_key) {
      best = id;
      best_key = key;
    }
  }
  return best;
}

}  // namespace kvrouter
