#pragma once

#include <concurrentqueue/blockingconcurrentqueue.h>

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
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
#include "router/index/shard_lock.h"
#include "router/index/sharded_index.h"
#include "router/index/spare_batches.h"
#include "router/index/worker_key.h"

namespace kvrouter {

// A write-lock slice: after this many blocks the shard thread lets readers in.
constexpr std::size_t kMaxBlocksPerLock = 64;

// Single-writer counter: the owner thread adds without a locked instruction; readers load.
struct OwnerCounter {
  std::atomic<std::uint64_t> v{0};
  void Add(std::uint64_t n) { v.store(v.load(std::memory_order_relaxed) + n, std::memory_order_relaxed); }
  void Set(std::uint64_t n) { v.store(n, std::memory_order_relaxed); }
  std::uint64_t Get() const { return v.load(std::memory_order_relaxed); }
};

inline std::size_t BlocksIn(const KvEventBatch& b) {
  std::size_t n = 0;
  for (const KvOp& op : b.ops) {
    if (auto* s = std::get_if<KvStored>(&op.data)) n += s->blocks.size();
    else if (auto* r = std::get_if<KvRemoved>(&op.data)) n += r->block_hashes.size();
    else n += 1;
  }
  return n;
}

class ShardedIndex::Shard {
 public:
  Shard(const ShardedIndexOptions& o, SpareBatches& spares, std::size_t number)
      : spares_(spares),
        number_(number),
        capacity_(o.queue_capacity),
        max_bulk_(o.max_bulk),
        read_patience_(o.read_patience),
        shrink_after_(o.shrink_after),
        default_capacity_(o.default_capacity),
        recover_(static_cast<bool>(o.on_recovery)),
        on_recovery_(o.on_recovery),
        // Asks are collected under the write lock and made after it is released (MakeAsks): a
        // publish may block, and readers wait on this lock.
        streams_({.recover = recover_, .max_held = o.max_held},
                 [this](WorkerKey w, SequenceKind k, std::optional<std::uint64_t> start, std::uint64_t generation) {
                   AskLater({w, k, start, generation});
                 }),
        thread_([this] { Run(); }) {
    SetConcurrentReaders();
  }

  ~Shard() {
    stop_.store(true);
    queue_.enqueue(Item{Item::kWake, {}, 0});
    thread_.join();
  }

  bool Submit(KvEventBatch&& batch) {
    if (!TakeRoom(batch)) return false;
    submitted_.fetch_add(1, std::memory_order_relaxed);
    queue_.enqueue(Item{Item::kBatch, std::move(batch), 0});
    return true;
  }

  // Submit for each batch, enqueued together; a refused batch's worker goes to `refused`.
  void SubmitMany(std::span<KvEventBatch* const> batches, std::vector<std::uint64_t>& refused) {
    thread_local std::vector<Item> items;
    for (KvEventBatch* b : batches) {
      if (TakeRoom(*b)) {
        items.push_back(Item{Item::kBatch, std::move(*b), 0});
      } else {
        refused.push_back(b->worker_id);
      }
    }
    if (items.empty()) return;
    submitted_.fetch_add(items.size(), std::memory_order_relaxed);
    queue_.enqueue_bulk(std::make_move_iterator(items.begin()), items.size());
    items.clear();
  }

  // Applies `batches` on the calling thread, when that cannot put any event behind a later
  // one: nothing is queued for the shard or being applied by its thread, and its lock is free.
  // False: nothing was applied (the caller queues them).
  bool ApplyHere(std::span<KvEventBatch* const> batches) {
    if (!Idle() || !mu_.try_lock()) return false;
    if (!Idle()) {
      mu_.unlock();
      return false;
    }
    for (std::size_t i = 0; i < batches.size(); ++i) {
      // Decoded on this thread just now: only the table slots are worth loading ahead.
      if (i + 1 < batches.size()) PrefetchSlots(*batches[i + 1]);
      gate_.BeginWrite();
      ApplyBatch(*batches[i]);
      if (gate_.EndWrite() && index_.HasRetired()) index_.FreeRetired();
      spares_.GiveHere(std::move(*batches[i]));
      if (asks_.empty()) mu_.YieldToReaders();  // see asks_
    }
    if (index_.HasRetired() && gate_.Quiet()) index_.FreeRetired();
    std::vector<Ask> asks = TakeAsks();
    mu_.unlock();
    MakeAsks(asks);
    return true;
  }

  void Control(bool remove, std::uint64_t worker_id) {
    submitted_.fetch_add(1, std::memory_order_relaxed);
    queue_.enqueue(Item{remove ? Item::kRemoveWorker : Item::kClearWorker, {}, worker_id});
  }

  void SetCapacity(std::uint64_t worker_id, std::uint64_t blocks) {
    submitted_.fetch_add(1, std::memory_order_relaxed);
    Item it{Item::kSetCapacity, {}, worker_id, std::make_unique<RecoveryPart>()};
    it.part->last_event_id = blocks;
    queue_.enqueue(std::move(it));
  }

  void RequestDump(WorkerKey worker, SequenceKind numbering) {
    submitted_.fetch_add(1, std::memory_order_relaxed);
    Item it{Item::kRequestDump, {}, worker.worker_id, std::make_unique<RecoveryPart>()};
    it.part->worker = worker;
    it.part->numbering = numbering;
    queue_.enqueue(std::move(it));
  }

  void Recovered(RecoveryPart part) {
    submitted_.fetch_add(1, std::memory_order_relaxed);
    const std::uint64_t worker_id = part.worker.worker_id;
    queue_.enqueue(Item{Item::kRecovered, {}, worker_id, std::make_unique<RecoveryPart>(std::move(part))});
  }

  // Waits until the shard is quiet: everything submitted, including what applying it submitted
  // in turn (a recovery answered on a synchronous bus), has been applied.
  void Flush() {
    KvMutexLock g(flush_mu_);
    ++flush_waiters_;
    flush_cv_.wait(flush_mu_, [&] { return applied_.load() >= submitted_.load(); });
    --flush_waiters_;
  }

  // Without the shard's lock: through the read gate (router/index/read_gate.h), so a route never
  // sleeps behind the shard thread, even when that thread loses its CPU in the middle of an event.
  void FindMatches(std::span<const SequenceHash> hashes, OverlapScores& out) const {
    ReadGate::Reader r(gate_, read_patience_);
    GatedIndex().FindMatches(hashes, out, r.tolerant());
  }


  void TreeSizes(std::vector<WorkerTreeSize>& out) const {
    KvReaderLock lk(mu_);
    index_.ForEachWorker([&](WorkerKey k, std::size_t n) { out.push_back({k, n}); });
  }

  std::size_t TreeSize(WorkerKey worker) const {
    KvReaderLock lk(mu_);
    return index_.TreeSize(worker);
  }

  IndexMemory Memory() const {
    KvReaderLock lk(mu_);
    return index_.Memory();
  }

  std::uint64_t upkeeps() const { return upkeeps_.load(std::memory_order_relaxed); }

  void AddCounters(IndexCounters& c) const {
    c.batches_applied += batches_applied_.Get();
    c.ops_applied += ops_applied_.Get();
    c.blocks_stored += blocks_stored_.Get();
    c.blocks_removed += blocks_removed_.Get();
    c.non_device_ops += non_device_ops_.Get();
    c.gaps += gaps_.Get();
    c.restarts += restarts_.Get();
    c.events_recovered += events_recovered_.Get();
    c.held_dropped += held_dropped_.Get();
    c.parent_block_not_found += parent_block_not_found_.Get();
    c.block_not_found += block_not_found_.Get();
    c.duplicate += duplicate_.Get();
    c.over_capacity += over_capacity_.Get();
    c.queue_full += queue_full_.load(std::memory_order_relaxed);
    c.tolerant_reads += gate_.tolerant_reads();
  }

  void TakeStale(std::vector<WorkerKey>& out) {
    KvMutexLock g(stale_mu_);
    out.insert(out.end(), stale_.begin(), stale_.end());
    stale_.clear();
  }

 private:
  struct Item {
    enum Kind : std::uint8_t {
      kBatch, kClearWorker, kRemoveWorker, kRequestDump, kRecovered, kSetCapacity, kWake
    } kind = kWake;
    KvEventBatch batch;
    std::uint64_t worker_id = 0;
    // Out of line, so the queue moves small items: kRequestDump (its worker, numbering),
    // kRecovered; kSetCapacity: last_event_id.
    std::unique_ptr<RecoveryPart> part;
  };

  // Counts a batch into the queue's depth; a full queue refuses it (counted, worker flagged).
  bool TakeRoom(const KvEventBatch& batch) {
    if (depth_.fetch_add(1, std::memory_order_relaxed) < capacity_) return true;
    depth_.fetch_sub(1, std::memory_order_relaxed);
    queue_full_.fetch_add(1, std::memory_order_relaxed);
    MarkStale({batch.worker_id, batch.dp_rank});
    return false;
  }

  void MarkStale(WorkerKey w) {
    KvMutexLock g(stale_mu_);
    stale_.insert(w);
  }

  void Run() {
    const std::string name = "kv-shard-" + std::to_string(number_);
    pthread_setname_np(pthread_self(), name.c_str());  // for top -H and perf
    MarkIngestThread();
    std::vector<Item> items(max_bulk_);
    std::vector<KvEventBatch> giving;  // applied batches, given back after each bulk
    giving.reserve(max_bulk_);
    while (true) {
      const std::size_t n =
          queue_.wait_dequeue_bulk_timed(items.begin(), max_bulk_, std::chrono::milliseconds(100));
      std::size_t batches = 0;
      std::size_t done = 0;
      {
        mu_.lock();  // explicit lock / unlock: the thread-safety analysis follows them
        std::size_t slice = 0;
        for (std::size_t i = 0; i < n; ++i) {
          Item& it = items[i];
          if (i + 3 < n) PrefetchOps(items[i + 3]);
          if (i + 2 < n) PrefetchBlocks(items[i + 2]);
          if (i + 1 < n) PrefetchSlots(items[i + 1]);
          const bool writes = it.kind != Item::kWake;
          if (writes) gate_.BeginWrite();
          switch (it.kind) {
            case Item::kBatch:
              slice += BlocksIn(it.batch);
              ApplyBatch(it.batch);
              ++batches;
              ++done;
              break;
            case Item::kClearWorker:
              index_.ClearWorker(it.worker_id);
              ++done;
              break;
            case Item::kRemoveWorker:
              index_.RemoveWorker(it.worker_id);
              streams_.RemoveWorker(it.worker_id);
              capacity_of_.erase(it.worker_id);
              ++done;
              break;
            case Item::kSetCapacity:
              capacity_of_[it.worker_id] = it.part->last_event_id;
              ++done;
              break;
            case Item::kRequestDump:
              streams_.RequestDump(it.part->worker, it.part->numbering);
              ++done;
              break;
            case Item::kRecovered:
              slice += ApplyRecovered(*it.part);
              ++done;
              break;
            case Item::kWake:
              break;
          }
          if (writes && gate_.EndWrite() && index_.HasRetired()) index_.FreeRetired();
          if (it.kind == Item::kBatch && SpareBatches::Keep(it.batch)) giving.push_back(std::move(it.batch));
          it.batch = {};
          it.part.reset();
          if (slice >= kMaxBlocksPerLock) {  // let waiting readers in
            std::vector<Ask> asks = TakeAsks();
            mu_.unlock();
            MakeAsks(asks);
            slice = 0;
            mu_.lock();
          } else {
            if (asks_.empty()) mu_.YieldToReaders();  // a stats reader waiting gets in now (see asks_)
          }
        }
        // A reader was inside when the last event ended: free what was replaced once none is
        // (tolerant readers are not waited for; an idle shard asks again on its 100 ms wake-up).
        if (index_.HasRetired() && gate_.Quiet()) index_.FreeRetired();
        std::vector<Ask> asks = TakeAsks();
        mu_.unlock();
        // Before this bulk counts as applied: a synchronous bus answers at once, and Flush must
        // see the answer as submitted.
        MakeAsks(asks);
      }
      spares_.GiveAll(giving);
      if (batches > 0) depth_.fetch_sub(batches, std::memory_order_relaxed);
      if (done > 0) {
        applied_.fetch_add(done);
        KvMutexLock g(flush_mu_);
        if (flush_waiters_ > 0) flush_cv_.notify_all();
      }
      if (stop_.load() && n == 0) return;
      // Every 100 ms, busy or not (an idle dequeue returns after 100 ms).
      if (const auto now = std::chrono::steady_clock::now(); now - last_upkeep_ >= kUpkeepEvery) {
        last_upkeep_ = now;
        Upkeep(now);
      }
      if (stop_.load() && queue_.size_approx() == 0) return;
    }
  }

  // The shard thread's upkeep, every kUpkeepEvery: the free nodes are put in order
  // (BlockIndex::TidyFreeNodes), and the sequence-hash table gives memory back once it has been
  // under an eighth full at every upkeep for shrink_after_ (see ShardedIndexOptions).
  void Upkeep(SteadyTime now) {
    mu_.lock();
    index_.TidyFreeNodes();
    if (!index_.TablesUnderfull()) {
      underfull_since_.reset();
    } else {
      if (!underfull_since_) underfull_since_ = now;
      if (now - *underfull_since_ >= shrink_after_) {
        gate_.BeginWrite();
        index_.ShrinkTables();
        if (gate_.EndWrite() && index_.HasRetired()) index_.FreeRetired();
        underfull_since_.reset();
      }
    }
    mu_.unlock();
    upkeeps_.fetch_add(1, std::memory_order_relaxed);
  }

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
  std::vector<Ask> TakeAsks() KV_REQUIRES(mu_) {
    std::vector<Ask> asks;
    asks.swap(asks_);
    return asks;
  }
  // No lock held (asking may publish, and a synchronous bus answers at once).
  void MakeAsks(const std::vector<Ask>& asks) {
    for (const Ask& a : asks) on_recovery_(a.worker, a.numbering, a.start, a.generation);
  }

  // Applying a batch reads its ops, then its blocks, then the index's hash-table slots: each a
  // cache miss (the batch was written on another core), and each needs the one before. The
  // shard thread starts loading them a few items ahead, one stage per item, so that the misses
  // overlap the events applied meanwhile.
  static const KvStored* FirstStored(const KvEventBatch& b) {
    return b.ops.empty() ? nullptr : std::get_if<KvStored>(&b.ops.front().data);
  }
  static const KvStored* FirstStored(const Item& it) { return it.kind == Item::kBatch ? FirstStored(it.batch) : nullptr; }
  static void PrefetchOps(const Item& it) {
    if (it.kind == Item::kBatch && !it.batch.ops.empty()) PrefetchLine(it.batch.ops.data());
  }
  static void PrefetchBlocks(const Item& it) {
    const KvStored* st = FirstStored(it);
    if (st == nullptr || st->blocks.empty()) return;
    PrefetchLine(st->blocks.data());
    PrefetchLine(&st->blocks.back());
  }
  void PrefetchSlots(const KvEventBatch& b) const KV_REQUIRES(mu_) {
    if (const KvStored* st = FirstStored(b)) index_.PrefetchStored(st->parent_hash, st->blocks);
  }
  void PrefetchSlots(const Item& it) const KV_REQUIRES(mu_) {
    if (it.kind == Item::kBatch) PrefetchSlots(it.batch);
  }

  // Nothing queued or being applied by the shard thread.
  bool Idle() const { return applied_.load() == submitted_.load(); }

  // Owner thread, write lock held: a live batch, judged by the rank's stream first.
  void ApplyBatch(KvEventBatch& b) KV_REQUIRES(mu_) {
    batches_applied_.Add(1);
    const WorkerKey key{b.worker_id, b.dp_rank};
    const std::uint64_t gaps_before = streams_.counters().gaps;
    const EventStreams::Verdict verdict = streams_.Live(b);
    // Without recovery a gap leaves the rank wrong: flag it (with recovery it is being asked).
    if (!recover_ && streams_.counters().gaps > gaps_before) MarkStale(key);
    switch (verdict) {
      case EventStreams::Verdict::kApply:
        ApplyOps(key, b);
        break;
      case EventStreams::Verdict::kClearThenApply:
        index_.ClearRank(key);
        ApplyOps(key, b);
        break;
      case EventStreams::Verdict::kHeld:
      case EventStreams::Verdict::kDrop:
        break;
    }
    PublishStreamCounters();
  }

  // Owner thread, write lock held: a recovery reply part; returns the blocks it touched.
  std::size_t ApplyRecovered(RecoveryPart& part) KV_REQUIRES(mu_) {
    EventStreams::Outcome o = streams_.Recovered(part);
    if (o.clear_first) index_.ClearRank(part.worker);
    std::size_t blocks = 0;
    for (const KvEventBatch& b : part.events) {
      ApplyOps(part.worker, b);
      blocks += BlocksIn(b);
    }
    events_recovered_.Add(part.events.size());
    for (const KvEventBatch& b : o.apply) {
      ApplyOps(part.worker, b);
      blocks += BlocksIn(b);
    }
    for (KvEventBatch& b : o.rejudge) {
      blocks += BlocksIn(b);
      ApplyBatch(b);
    }
    PublishStreamCounters();
    return blocks;
  }

  void PublishStreamCounters() {
    const StreamCounters& c = streams_.counters();
    gaps_.Set(c.gaps);
    restarts_.Set(c.restarts);
    duplicate_.Set(c.duplicates);
    held_dropped_.Set(c.held_dropped);
  }

  // Owner thread, write lock held: the ops of one batch, on `key`'s index.
  void ApplyOps(WorkerKey key, const KvEventBatch& b) KV_REQUIRES(mu_) {
    for (const KvOp& op : b.ops) {
      if (op.tier != StorageTier::kDevice) {
        non_device_ops_.Add(1);
        continue;
      }
      ApplyOutcome r;
      if (auto* s = std::get_if<KvStored>(&op.data)) {
        auto cap = capacity_of_.find(key.worker_id);
        const std::uint64_t limit = cap == capacity_of_.end() ? default_capacity_ : cap->second;
        r = index_.ApplyStored(key, s->parent_hash, s->blocks, limit);
        if (r.over_capacity) {
          over_capacity_.Add(1);
          continue;
        }
      } else if (auto* rm = std::get_if<KvRemoved>(&op.data)) {
        r = index_.ApplyRemoved(key, rm->block_hashes);
      } else {
        index_.ClearWorker(key.worker_id);
      }
      ops_applied_.Add(1);
      blocks_stored_.Add(r.blocks_stored);
      blocks_removed_.Add(r.blocks_removed);
      if (r.parent_not_found) parent_block_not_found_.Add(1);
      block_not_found_.Add(r.blocks_not_found);
    }
  }

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
  void SetConcurrentReaders() {
    mu_.lock();
    index_.SetConcurrentReaders(true);
    index_.ShrinkTablesLater(true);  // Upkeep gives the memory back
    mu_.unlock();
  }
  // FindMatches' way in without mu_: the gate orders it with the writes instead (BlockIndex's
  // thread contract), which the lock analysis cannot follow.
  const BlockIndex& GatedIndex() const KV_NO_THREAD_SAFETY_ANALYSIS { return index_; }

  // mu_ orders the shard thread with the bookkeeping readers (TreeSizes, Memory); gate_ orders
  // it with FindMatches, which reads the tree without mu_. The shard thread writes under both.
  mutable ShardLock mu_;
  BlockIndex index_ KV_GUARDED_BY(mu_);  // written only by thread_, under the write lock
  mutable ReadGate gate_;
  const std::chrono::nanoseconds read_patience_;
  const std::chrono::milliseconds shrink_after_;
  static constexpr std::chrono::milliseconds kUpkeepEvery{100};
  SteadyTime last_upkeep_{};                    // thread_ only
  std::optional<SteadyTime> underfull_since_;  // thread_ only
  std::atomic<std::uint64_t> upkeeps_{0};
  const std::uint64_t default_capacity_;
  std::unordered_map<std::uint64_t, std::uint64_t> capacity_of_;  // thread_ only: worker_id -> blocks per rank
  const bool recover_;
  const EventStreams::RecoveryNeeded on_recovery_;
  // Recoveries asked while applying, made once the write lock is released. Empty whenever a
  // writer releases the lock (each release takes them first, and a writer with asks pending
  // does not yield to readers), so each writer makes the asks its own events raised before it
  // counts them applied or returns from Submit: Flush sees them submitted.
  std::vector<Ask> asks_ KV_GUARDED_BY(mu_);
  EventStreams streams_;   // thread_ only

  KvMutex flush_mu_;
  std::condition_variable_any flush_cv_;
  int flush_waiters_ KV_GUARDED_BY(flush_mu_) = 0;

  KvMutex stale_mu_;
  std::unordered_set<WorkerKey, WorkerKeyHash> stale_ KV_GUARDED_BY(stale_mu_);

  OwnerCounter batches_applied_, ops_applied_, blocks_stored_, blocks_removed_, non_device_ops_,
      gaps_, restarts_, parent_block_not_found_, block_not_found_, duplicate_, events_recovered_, held_dropped_,
      over_capacity_;
  std::atomic<std::uint64_t> queue_full_{0};

  std::thread thread_;  // last: starts after every member above is constructed
};

}  // namespace kvrouter
