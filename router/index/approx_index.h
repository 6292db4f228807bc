// ApproxIndex: approximate mode's prediction of worker caches (docs/design.md "Approximate mode").
// Without KV events, every booked routing decision records the request's blocks as held by the
// chosen (worker, dp_rank); a block expires `ttl` after its last use, and routing the same
// prefix again refreshes it. Blocks live in one LRU list ordered by expiry (all share one ttl,
// so least recently used = earliest expiring); a prefix is refreshed leaf first, so among
// blocks of equal age the deepest sits nearest the front. Expiry and pruning pop the front:
// no per-block timers, no scans. Matching reuses BlockIndex (engine ids = sequence hashes, so
// its workers are canonical, docs/design.md "Glossary": no per-worker map there).
// Memory beside the index: one 24-byte entry per predicted (worker, block) in fixed chunks, the
// LRU links inside it as entry numbers, and a hash table of 4-byte entry numbers (the key is
// read from the entry) to find a prediction again.
// Not thread-safe: the service guards it with its routing mutex, so a prediction is visible to
// every request routed after the reply that made it.
//
//   ApproxIndex a(std::chrono::seconds(120), 1 << 20, 0.8);
//   a.Record({7, 0}, local, seq, now);  a.Expire(now);  a.FindMatches(seq, scores);
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "events/base/clock.h"
#include "router/index/block_index.h"
#include "router/index/flat_table.h"

namespace kvrouter {

class ApproxIndex {
 public:
  ApproxIndex(std::chrono::milliseconds ttl, std::uint64_t max_blocks, double prune_target_ratio);
  ApproxIndex(const ApproxIndex&) = delete;  // its table points at its own entries
  ApproxIndex& operator=(const ApproxIndex&) = delete;

  // The worker now holds the prompt's blocks (local and sequence hashes of its full blocks).
  // Prunes to prune_target_ratio * max_blocks when the total passes max_blocks.
  void Record(WorkerKey worker, std::span<const LocalHash> local, std::span<const SequenceHash> seq, SteadyTime now);
  // Drops blocks whose last use is at least ttl ago; returns how many.
  std::size_t Expire(SteadyTime now);
  // Forgets every prediction for worker_id (all dp ranks); walks every prediction (rare: a
  // worker's lease ended or it left).
  void RemoveWorker(std::uint64_t worker_id);

  void FindMatches(std::span<const SequenceHash> seq, OverlapScores& out) const { index_.FindMatches(seq, out); }
  std::size_t TreeSize(WorkerKey worker) const { return index_.TreeSize(worker); }
  std::size_t size() const { return live_; }
  std::uint64_t pruned() const { return pruned_; }
  std::uint64_t expired() const { return expired_; }
  // Bytes of the predictions themselves (entries and their table), and the index's.
  std::size_t OwnBytes() const;
  IndexMemory IndexBytes() const { return index_.Memory(); }

 private:
  static constexpr std::uint32_t kNil = kFlatEmpty;
  struct Entry {
    SequenceHash seq = 0;
    std::uint32_t worker = 0;    // number in workers_
    std::uint32_t last_use = 0;  // ms since base_
    std::uint32_t prev = kNil;   // LRU neighbours; `next` links the free list while free
    std::uint32_t next = kNil;
  };
  static_assert(sizeof(Entry) == 24);
  static constexpr std::uint32_t kChunkBits = 12;

  struct Key {
    std::uint32_t worker;
    SequenceHash seq;
    bool operator==(const Key&) const = default;
  };
  // The table holds entry numbers only; an entry's key is read from the entry.
  struct LookupTraits {
    using Key = ApproxIndex::Key;
    struct Entry {
      std::uint32_t value;
    };
    const ApproxIndex* owner = nullptr;
    Key KeyOf(const Entry& e) const {
      const ApproxIndex::Entry& x = owner->at(e.value);
      return {x.worker, x.seq};
    }
    static void Set(Entry& e, const Key&, std::uint32_t v) { e.value = v; }
    static std::uint64_t Hash(const Key& k) { return Mix64(k.seq ^ (std::uint64_t{k.worker} * 0x9e3779b97f4a7c15ULL)); }
  };

  Entry& at(std::uint32_t i) { return chunks_[i >> kChunkBits][i & ((1u << kChunkBits) - 1)]; }
  const Entry& at(std::uint32_t i) const { return chunks_[i >> kChunkBits][i & ((1u << kChunkBits) - 1)]; }
  std::uint32_t Allocate();
  void Unlink(std::uint32_t i);
  void PushBack(std::uint32_t i);
  // Forgets entry i; kRemove also removes its block from the index, kLeave leaves the index
  // to the caller.
  enum class IndexBlock : std::uint8_t { kRemove, kLeave };
  void Drop(std::uint32_t i, IndexBlock block);
  std::uint32_t WorkerNumber(WorkerKey worker);
  // ms since base_; moves base_ (and every entry) forward before the count could overflow.
  std::uint32_t Tick(SteadyTime now);

  const std::uint64_t ttl_ms_;
  const std::uint64_t max_blocks_;
  const std::uint64_t prune_to_;
  std::vector<std::unique_ptr<Entry[]>> chunks_;
  std::uint32_t slots_used_ = 0;
  std::uint32_t free_ = kNil;
  std::uint32_t head_ = kNil;  // earliest expiring
  std::uint32_t tail_ = kNil;
  std::size_t live_ = 0;
  FlatTable<LookupTraits> lookup_{LookupTraits{this}};
  std::vector<WorkerKey> workers_;
  std::unordered_map<WorkerKey, std::uint32_t, WorkerKeyHash> worker_number_;
  bool has_base_ = false;
  SteadyTime base_{};
  BlockIndex index_;
  std::uint64_t pruned_ = 0;
  std::uint64_t expired_ = 0;
};

}  // namespace kvrouter
