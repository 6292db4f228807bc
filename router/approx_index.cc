#include "router/approx_index.h"

#include <algorithm>
#include <cmath>

namespace kvrouter {

ApproxIndex::ApproxIndex(std::chrono::milliseconds ttl, std::uint64_t max_blocks, double prune_target_ratio)
    : ttl_(ttl),
      max_blocks_(max_blocks),
      prune_to_(static_cast<std::uint64_t>(std::floor(static_cast<double>(max_blocks) * prune_target_ratio))) {}

void ApproxIndex::Record(WorkerKey worker, std::span<const LocalHash> local, std::span<const SequenceHash> seq,
                         SteadyTime now) {
  const std::size_t n = std::min(local.size(), seq.size());
  if (n == 0) return;
  std::vector<StoredBlock> chain(n);
  for (std::size_t i = 0; i < n; ++i) chain[i] = {seq[i], local[i]};
  (void)index_.ApplyStored(worker, std::nullopt, chain);  // known blocks: idempotent
  auto& mine = where_[worker];
  // Leaf first, so the root of the prefix ends up last (expires last among equals).
  for (std::size_t k = n; k-- > 0;) {
    auto [it, inserted] = mine.try_emplace(seq[k]);
    if (inserted) {
      lru_.push_back({worker, seq[k], now});
      it->second = std::prev(lru_.end());
    } else {
      it->second->last_use = now;
      lru_.splice(lru_.end(), lru_, it->second);
    }
  }
  if (lru_.size() > max_blocks_) {
    while (lru_.size() > prune_to_) {
      Drop(lru_.begin());
      ++pruned_;
    }
  }
}

void ApproxIndex::Drop(Lru::iterator it) {
  const SequenceHash h = it->seq;
  (void)index_.ApplyRemoved(it->worker, std::span<const BlockHash>(&h, 1));
  auto w = where_.find(it->worker);
  w->second.erase(h);
  if (w->second.empty()) where_.erase(w);
  lru_.erase(it);
}

std::size_t ApproxIndex::Expire(SteadyTime now) {
  std::size_t n = 0;
  while (!lru_.empty() && now - lru_.front().last_use >= ttl_) {
    Drop(lru_.begin());
    ++n;
  }
  expired_ += n;
  return n;
}

void ApproxIndex::RemoveWorker(std::uint64_t worker_id) {
  for (auto w = where_.begin(); w != where_.end();) {
    if (w->first.worker_id != worker_id) {
      ++w;
      continue;
    }
    for (auto& [seq, it] : w->second) lru_.erase(it);
    w = where_.erase(w);
  }
  index_.RemoveWorker(worker_id);
}

}  // namespace kvrouter
