#include "router/kvgateway/engine_load.h"

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

std::optional<std::uint64_t> EngineLoad::Least(std::span<const std::uint64_t> candidates, std::size_t rotation) const {
  if (candidates.empty()) return std::nullopt;
  const std::size_t n = candidates.size();
  const std::size_t start = rotation % n;
  KvMutexLock g(counts_->mu);
  std::optional<std::uint64_t> best;
  std::uint32_t fewest = 0;
  for (std::size_t k = 0; k < n; ++k) {
    const std::uint64_t id = candidates[(start + k) % n];
    auto it = counts_->in_flight.find(id);
    const std::uint32_t c = it == counts_->in_flight.end() ? 0 : it->second;
    if (!best || c < fewest) {
      best = id;
      fewest = c;
    }
  }
  return best;
}

}  // namespace kvrouter
