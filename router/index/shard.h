// IndexShard: one shard of the ShardedIndex: a BlockIndex, the EventStreams of its ranks, a
// bounded queue of work items and the owner thread that drains it in bulk, applies each event
// through the ReadGate under the ShardLock, makes the recovery asks and runs the upkeep (terms:
// docs/design.md "Glossary").
// Thread contract: every public method from any thread; ApplyHere applies on the calling
// thread only while the shard is idle; FindMatches and TranslateMatches read without the lock,
// the stats (TreeSizes, TreeSize, Memory) and the dumps (DumpableRanks, DumpRank) take it.
// Ownership: ShardedIndex owns the shards; a shard borrows its owner and the SpareBatches it
// gives applied batches to. Destruction applies what is queued, then joins the thread.
//
//   IndexShard shard(options, index, spares, 0);  shard.Submit(std::move(batch));  shard.Flush();
#pragma once

#include <concurrentqueue/blockingconcurrentqueue.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <latch>
#include <memory>
#include <optional>
#include <span>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "events/base/clock.h"
#include "events/base/thread_annotations.h"
#include "events/kv_event.h"
#include "router/index/block_index.h"
#include "router/index/event_stream.h"
#include "router/index/read_gate.h"
#include "router/index/recovery_part.h"
#include "router/index/shard_lock.h"
#include "router/index/sharded_index.h"
#include "router/index/spare_batches.h"
#include "router/index/worker_key.h"

namespace kvrouter {

class IndexShard {
 public:
  // `owner`: the index the shard belongs to (its on_recovery is the owner's).
  IndexShard(const ShardedIndexOptions& o, const ShardedIndex& owner, SpareBatches& spares, std::size_t number);
  ~IndexShard();
  IndexShard(const IndexShard&) = delete;
  IndexShard& operator=(const IndexShard&) = delete;

  // Queues a batch; false when the queue is full (counted as queue_full, the worker flagged).
  bool Submit(KvEventBatch&& batch);
  // Submit for each batch, enqueued together; a refused batch's worker goes to `refused`.
  void SubmitMany(std::span<KvEventBatch* const> batches, std::vector<std::uint64_t>& refused);

  // Applies `batches` on the calling thread, when that cannot put any event behind a later
  // one: nothing is queued for the shard or being applied by its thread, and its lock is free.
  // False: nothing was applied (the caller queues them).
  bool ApplyHere(std::span<KvEventBatch* const> batches);
  // Work items applied in order with the batches queued before them (never refused).
  // Control: kClear drops the worker's blocks (every rank) and keeps its streams' cursors;
  // kRemove drops its blocks, its streams and its capacity.
  enum class WorkerControl : std::uint8_t { kClear, kRemove };
  void Control(WorkerControl what, std::uint64_t worker_id);
  void SetCapacity(std::uint64_t worker_id, std::uint64_t blocks);
  void RequestDump(WorkerKey worker, SequenceKind numbering, bool first_sight);
  void Recovered(RecoveryPart part);
  // Waits until the shard is quiet: everything submitted, including what applying it submitted
  // in turn (a recovery answered on a synchronous bus), has been applied. From inside
  // on_recovery it returns at once (InRecoveryAsk): the caller is a thread that applies, and what
  // is left is applied after on_recovery returns, so waiting would wait for itself.
  void Flush();
  // Whether the calling thread is inside `index`'s on_recovery (making the asks of one of its
  // shards). Another index's Flush on that thread still waits.
  static bool InRecoveryAsk(const ShardedIndex& index);
  // Queues `barrier`, counted down once what this thread queued before it has been applied
  // (however much other threads queue meanwhile).
  void Barrier(std::shared_ptr<std::latch> barrier);

  // Without the shard's lock: through the read gate (router/index/read_gate.h), so a route never
  // sleeps behind the shard thread, even when that thread loses its CPU in the middle of an event.
  void FindMatches(std::span<const SequenceHash> hashes, OverlapScores& out) const;
  void FindMatches(std::span<const SequenceHash> hashes, MatchRuns& out,
                   std::span<const std::uint64_t> known = {}) const;
  bool TranslateMatches(const MatchRuns& runs, OverlapScores& out) const;  // BlockIndex's
  // Under the read lock (ShardLock lets a waiting reader in between the writer's steps).
  void TreeSizes(std::vector<WorkerTreeSize>& out) const;  // appends
  std::size_t TreeSize(WorkerKey worker) const;
  IndexMemory Memory() const;
  // Real ranks (tier bits clear) its index or streams know: appends.
  void DumpableRanks(std::vector<WorkerKey>& out) const;
  // The rank's chains and position (ShardedIndex::DumpRank).
  std::optional<RankDump> DumpRank(WorkerKey rank) const;
  // Appends the asks (worker, generation) peers' dumps took the place of since the last call.
  void TakeSuperseded(std::vector<std::pair<WorkerKey, std::uint64_t>>& out);
  std::uint64_t upkeeps() const { return upkeeps_.load(std::memory_order_relaxed); }
  // Adds this shard's counters to `c`. Reads them without mu_ (they are atomics written by one
  // writer at a time; see the counters), which the lock analysis cannot follow.
  void AddCounters(IndexCounters& c) const KV_NO_THREAD_SAFETY_ANALYSIS;
  // Appends the workers flagged stale since the last call and forgets them.
  void TakeStale(std::vector<WorkerKey>& out);

 private:
  // A counter with one writer at a time (the shard's writer, see mu_): Add is a load and a
  // store, no locked instruction; any thread may Get.
  struct OwnerCounter {
    std::atomic<std::uint64_t> v{0};
    void Add(std::uint64_t n) { v.store(v.load(std::memory_order_relaxed) + n, std::memory_order_relaxed); }
    void Set(std::uint64_t n) { v.store(n, std::memory_order_relaxed); }
    std::uint64_t Get() const { return v.load(std::memory_order_relaxed); }
  };

  struct Item {
    enum Kind : std::uint8_t {
      kBatch,
      kClearWorker,
      kRemoveWorker,
      kRequestDump,
      kRecovered,
      kSetCapacity,
      kBarrier,
      kWake
    } kind = kWake;
    SequenceKind numbering = SequenceKind::kEventId;  // kRequestDump (beside kind, in its padding)
    bool first_sight = false;                         // kRequestDump
    std::uint32_t dp_rank = 0;                        // kRequestDump
    KvEventBatch batch;
    std::uint64_t worker_id = 0;
    std::uint64_t blocks_per_rank = 0;    // kSetCapacity
    std::unique_ptr<RecoveryPart> part;   // kRecovered: out of line, so the queue moves small items
    std::shared_ptr<std::latch> barrier;  // kBarrier: counted down when the shard reaches it
  };

  // Counts a batch into the queue's depth; a full queue refuses it (counted, worker flagged).
  bool TakeRoom(const KvEventBatch& batch);

  void MarkStale(WorkerKey w);

  void Run();

  // The shard thread's upkeep, every kUpkeepEvery: the free nodes are put in order
  // (BlockIndex::TidyFreeNodes), and the sequence-hash table gives memory back once it has been
  // under an eighth full at every upkeep for shrink_after_ (see ShardedIndexOptions).
  void Upkeep(SteadyTime now);

  struct Ask {
    WorkerKey worker;
    SequenceKind numbering;
    std::optional<std::uint64_t> start;
    std::uint64_t generation;
  };
  // From streams_, which only runs under the write lock (the analysis cannot see through its
  // callback).
  void AskLater(const Ask& a) KV_NO_THREAD_SAFETY_ANALYSIS { asks_.push_back(a); }
  // Write lock held: the recoveries the streams asked for, to be made once it is released.
  std::vector<Ask> TakeAsks() KV_REQUIRES(mu_);
  // No lock held (asking may publish, and a synchronous bus answers at once).
  void MakeAsks(const std::vector<Ask>& asks);

  // Applying a batch reads its ops, then its blocks, then the index's hash-table slots: each a
  // cache miss (the batch was written on another core), and each needs the one before. The
  // shard thread starts loading them a few items ahead, one stage per item, so that the misses
  // overlap the events applied meanwhile.
  static const KvStored* FirstStored(const KvEventBatch& b);
  static const KvStored* FirstStored(const Item& it);
  static void PrefetchOps(const Item& it);
  static void PrefetchBlocks(const Item& it);
  void PrefetchSlots(const KvEventBatch& b) const KV_REQUIRES(mu_);
  void PrefetchSlots(const Item& it) const KV_REQUIRES(mu_);

  // Nothing queued or being applied by the shard thread.
  bool Idle() const { return applied_.load() == submitted_.load(); }

  // The writer (see mu_): a live batch, judged by the rank's stream first (rejudged: again, after
  // the recovery that held it).
  void ApplyBatch(KvEventBatch& b, bool rejudged = false) KV_REQUIRES(mu_);

  // The writer: a recovery reply part; returns the blocks it touched.
  std::size_t ApplyRecovered(RecoveryPart& part) KV_REQUIRES(mu_);

  // The writer: the streams' counters into the shard's.
  void PublishStreamCounters() KV_REQUIRES(mu_);

  // The writer: the ops of one batch, on `key`'s index.
  void ApplyOps(WorkerKey key, const KvEventBatch& b) KV_REQUIRES(mu_);

  const ShardedIndex& owner_;
  SpareBatches& spares_;
  const std::size_t number_;  // of the shard, in its thread's name
  const std::size_t capacity_;
  const std::size_t max_bulk_;

  moodycamel::BlockingConcurrentQueue<Item> queue_;
  std::atomic<std::size_t> depth_{0};        // batches queued, bounded by capacity_
  std::atomic<std::uint64_t> submitted_{0};  // items enqueued (for Flush)
  std::atomic<std::uint64_t> applied_{0};    // items applied (for Flush)
  std::atomic<bool> stop_{false};

  // Constructor, before any event: the index keeps replaced memory until readers are gone.
  void SetConcurrentReaders();
  // FindMatches' way in without mu_: the gate orders it with the writes instead (BlockIndex's
  // thread contract), which the lock analysis cannot follow.
  const BlockIndex& GatedIndex() const KV_NO_THREAD_SAFETY_ANALYSIS { return index_; }

  // The writer is the thread holding mu_ exclusively: the shard thread (Run, Upkeep), or a
  // delivery thread applying its own batches while the shard is idle (ApplyHere). mu_ orders
  // writers with each other and with the bookkeeping readers (TreeSizes, Memory); gate_ orders
  // the writer with FindMatches, which reads the tree without mu_. Each event is written under
  // both.
  mutable ShardLock mu_;
  BlockIndex index_ KV_GUARDED_BY(mu_);  // written by the writer; FindMatches: GatedIndex()
  mutable ReadGate gate_;
  const std::chrono::nanoseconds read_patience_;
  const std::chrono::milliseconds shrink_after_;
  static constexpr std::chrono::milliseconds kUpkeepEvery{100};
  SteadyTime last_upkeep_{};                                      // the shard thread only (Run), no lock
  std::optional<SteadyTime> underfull_since_ KV_GUARDED_BY(mu_);  // the shard thread (Upkeep)
  std::atomic<std::uint64_t> upkeeps_{0};
  const std::uint64_t default_capacity_;
  // worker_id -> blocks per rank: set and erased by the shard thread (its work items), read by
  // either writer (ApplyOps).
  std::unordered_map<std::uint64_t, std::uint64_t> capacity_of_ KV_GUARDED_BY(mu_);
  const bool recover_;
  const RecoveryNeeded on_recovery_;
  // Recoveries asked while applying, made once the write lock is released. Empty whenever a
  // writer releases the lock (each release takes them first, and a writer with asks pending
  // does not yield to readers), so each writer makes the asks its own events raised before it
  // counts them applied or returns from Submit: Flush sees them submitted.
  std::vector<Ask> asks_ KV_GUARDED_BY(mu_);
  EventStreams streams_ KV_GUARDED_BY(mu_);  // used by either writer (EventStreams' contract)

  KvMutex flush_mu_;
  std::condition_variable_any flush_cv_;
  int flush_waiters_ KV_GUARDED_BY(flush_mu_) = 0;

  KvMutex superseded_mu_;
  std::vector<std::pair<WorkerKey, std::uint64_t>> superseded_ KV_GUARDED_BY(superseded_mu_);

  KvMutex stale_mu_;
  std::unordered_set<WorkerKey, WorkerKeyHash> stale_ KV_GUARDED_BY(stale_mu_);

  // Written only by the writer, one writer at a time (so OwnerCounter::Add needs no locked
  // instruction, and mu_ hands the values from one writer to the next); AddCounters reads them
  // on any thread without mu_.
  OwnerCounter batches_applied_ KV_GUARDED_BY(mu_), ops_applied_ KV_GUARDED_BY(mu_), blocks_stored_ KV_GUARDED_BY(mu_),
      blocks_removed_ KV_GUARDED_BY(mu_),
      non_device_ops_ KV_GUARDED_BY(mu_), gaps_ KV_GUARDED_BY(mu_), restarts_ KV_GUARDED_BY(mu_),
      parent_block_not_found_ KV_GUARDED_BY(mu_), block_not_found_ KV_GUARDED_BY(mu_), duplicate_ KV_GUARDED_BY(mu_),
      events_recovered_ KV_GUARDED_BY(mu_), held_dropped_ KV_GUARDED_BY(mu_), over_capacity_ KV_GUARDED_BY(mu_);
  std::atomic<std::uint64_t> queue_full_{0};  // any thread (TakeRoom)

  std::thread thread_;  // last: starts after every member above is constructed
};

}  // namespace kvrouter
