// ApproxIndex: approximate mode's prediction of worker caches (DESIGN.md "Approximate mode").
// Without KV events, every booked routing decision records the request's blocks as held by the
// chosen (worker, dp_rank); a block expires `ttl` after its last use, and routing the same
// prefix again refreshes it. Blocks live in one LRU list ordered by expiry (all share one ttl,
// so least recently used = earliest expiring); a prefix is refreshed leaf first, so among
// blocks of equal age the deepest sits nearest the front. Expiry and pruning pop the front:
// no per-block timers, no scans. Matching reuses BlockIndex (engine ids = sequence hashes).
// Not thread-safe: the service guards it with its routing mutex, so a prediction is visible to
// every request routed after the reply that made it.
//
//   ApproxIndex a(std::chrono::seconds(120), 1 << 20, 0.8);
//   a.Record({7, 0}, local, seq, now);  a.Expire(now);  a.FindMatches(seq, scores);
#pragma once

#include <chrono>
#include <cstdint>
#include <list>
#include <span>
#include <unordered_map>
#include <vector>

#include "router/active_load.h"
#include "router/block_index.h"

namespace kvrouter {

class ApproxIndex {
 public:
  ApproxIndex(std::chrono::milliseconds ttl, std::uint64_t max_blocks, double prune_target_ratio);

  // The worker now holds the prompt's blocks (local and sequence hashes of its full blocks).
  // Prunes to prune_target_ratio * max_blocks when the total passes max_blocks.
  void Record(WorkerKey worker, std::span<const LocalHash> local, std::span<const SequenceHash> seq,
              SteadyTime now);
  // Drops blocks whose last use is at least ttl ago; returns how many.
  std::size_t Expire(SteadyTime now);
  // Forgets every prediction for worker_id (all dp ranks); cost proportional to its blocks.
  void RemoveWorker(std::uint64_t worker_id);

  void FindMatches(std::span<const SequenceHash> seq, OverlapScores& out) const { index_.FindMatches(seq, out); }
  std::size_t TreeSize(WorkerKey worker) const { return index_.TreeSize(worker); }
  std::size_t size() const { return lru_.size(); }
  std::uint64_t pruned() const { return pruned_; }
  std::uint64_t expired() const { return expired_; }

 private:
  struct Held {
    WorkerKey worker;
    SequenceHash seq;
    SteadyTime last_use;
  };
  using Lru = std::list<Held>;
  void Drop(Lru::iterator it);

  const std::chrono::milliseconds ttl_;
  const std::uint64_t max_blocks_;
  const std::uint64_t prune_to_;
  Lru lru_;  // front = earliest expiring
  std::unordered_map<WorkerKey, std::unordered_map<SequenceHash, Lru::iterator>, WorkerKeyHash> where_;
  BlockIndex index_;
  std::uint64_t pruned_ = 0;
  std::uint64_t expired_ = 0;
};

}  // namespace kvrouter
