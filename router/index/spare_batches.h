// SpareBatches: applied batches, handed back by the shard threads for their memory
// (ShardedIndex::Spare). Both sides move them in bulk: a shard thread gives a bulk's worth at
// once, and a taking thread keeps a few dozen of its own, so the queue and the shared count are
// touched once per bulk rather than once per event: each touch moves the count's cache line
// between the cores.
// Thread contract: every method from any thread. Ownership: the ShardedIndex owns it and its
// shards borrow it (declared before them, so it outlives their threads).
//
//   spares.GiveAll(applied);  KvEventBatch b = spares.Take();  // b: empty, or with memory to reuse
#pragma once

#include <concurrentqueue/concurrentqueue.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <vector>

#include "events/kv_event.h"

namespace kvrouter {

class SpareBatches {
 public:
  static constexpr std::size_t kMaxSpares = 4096;  // in the queue
  static constexpr std::size_t kMaxOps = 4;
  static constexpr std::size_t kMaxBlocks = 64;
  static constexpr std::size_t kTakeBulk = 64;      // taken from the queue at once
  static constexpr std::size_t kMaxKeptHere = 256;  // kept by a thread that applied them

  // Worth keeping: small (one or a few ops of up to 64 blocks). Others are freed.
  static bool Keep(const KvEventBatch& b) {
    if (b.ops.empty() || b.ops.capacity() > kMaxOps) return false;
    for (const KvOp& op : b.ops) {
      if (auto* st = std::get_if<KvStored>(&op.data); st != nullptr && st->blocks.capacity() > kMaxBlocks) return false;
      if (auto* rm = std::get_if<KvRemoved>(&op.data); rm != nullptr && rm->block_hashes.capacity() > kMaxBlocks) {
        return false;
      }
    }
    return true;
  }

  // Shard thread: kept batches of one bulk, queued while there is room; `batches` is emptied.
  void GiveAll(std::vector<KvEventBatch>& batches) {
    const std::size_t offered = batches.size();
    if (offered == 0) return;
    const std::size_t before = count_.fetch_add(offered, std::memory_order_relaxed);
    const std::size_t room = before >= kMaxSpares ? 0 : std::min(offered, kMaxSpares - before);
    if (room < offered) count_.fetch_sub(offered - room, std::memory_order_relaxed);
    if (room > 0) queue_.enqueue_bulk(std::make_move_iterator(batches.begin()), room);
    batches.clear();
  }

  // A thread that applied a batch itself keeps it for its next Take (up to a bulk's worth: the
  // service gathers up to 256 events before applying them).
  void GiveHere(KvEventBatch&& b) {
    std::vector<KvEventBatch>& stash = MyStash();
    if (stash.size() < kMaxKeptHere && Keep(b)) stash.push_back(std::move(b));
  }

  KvEventBatch Take() {
    std::vector<KvEventBatch>& stash = MyStash();
    if (stash.empty() && count_.load(std::memory_order_relaxed) > 0) {
      stash.resize(kTakeBulk);
      const std::size_t n = queue_.try_dequeue_bulk(stash.begin(), kTakeBulk);
      stash.resize(n);
      if (n > 0) count_.fetch_sub(n, std::memory_order_relaxed);
    }
    if (stash.empty()) return {};
    KvEventBatch b = std::move(stash.back());
    stash.pop_back();
    return b;
  }

 private:
  // This thread's batches, taken from this object's queue (another index's are dropped).
  std::vector<KvEventBatch>& MyStash() {
    struct Stash {
      std::uint64_t owner = 0;
      std::vector<KvEventBatch> batches;
    };
    thread_local Stash stash;
    if (stash.owner != id_) {
      stash.batches.clear();
      stash.owner = id_;
    }
    return stash.batches;
  }

  static std::uint64_t NextId() {
    static std::atomic<std::uint64_t> next{1};
    return next.fetch_add(1, std::memory_order_relaxed);
  }

  const std::uint64_t id_ = NextId();
  moodycamel::ConcurrentQueue<KvEventBatch> queue_;
  std::atomic<std::size_t> count_{0};  // batches in the queue (bounds it)
};

}  // namespace kvrouter
