#include "router/index/shard.h"

#include <pthread.h>

#include <algorithm>

#include <string>
#include <utility>

namespace kvrouter {
namespace {

// A write-lock slice: after this many blocks the shard thread lets readers in.
constexpr std::size_t kMaxBlocksPerLock = 64;

std::size_t BlocksIn(const KvEventBatch& b) {
  std::size_t n = 0;
  for (const KvOp& op : b.ops) {
    if (auto* s = std::get_if<KvStored>(&op.data))
      n += s->blocks.size();
    else if (auto* r = std::get_if<KvRemoved>(&op.data))
      n += r->block_hashes.size();
    else
      n += 1;
  }
  return n;
}

}  // namespace

IndexShard::IndexShard(const ShardedIndexOptions& o, const ShardedIndex& owner, SpareBatches& spares,
                       std::size_t number)
    : owner_(owner),
      spares_(spares),
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

IndexShard::~IndexShard() {
  stop_.store(true);
  queue_.enqueue(Item{.kind = Item::kWake});
  thread_.join();
}

bool IndexShard::Submit(KvEventBatch&& batch) {
  if (!TakeRoom(batch)) return false;
  submitted_.fetch_add(1, std::memory_order_relaxed);
  queue_.enqueue(Item{.kind = Item::kBatch, .batch = std::move(batch)});
  return true;
}

void IndexShard::SubmitMany(std::span<KvEventBatch* const> batches, std::vector<std::uint64_t>& refused) {
  thread_local std::vector<Item> items;
  for (KvEventBatch* b : batches) {
    if (TakeRoom(*b)) {
      items.push_back(Item{.kind = Item::kBatch, .batch = std::move(*b)});
    } else {
      refused.push_back(b->worker_id);
    }
  }
  if (items.empty()) return;
  submitted_.fetch_add(items.size(), std::memory_order_relaxed);
  queue_.enqueue_bulk(std::make_move_iterator(items.begin()), items.size());
  items.clear();
}

bool IndexShard::ApplyHere(std::span<KvEventBatch* const> batches) {
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

void IndexShard::Control(WorkerControl what, std::uint64_t worker_id) {
  submitted_.fetch_add(1, std::memory_order_relaxed);
  const Item::Kind kind = what == WorkerControl::kRemove ? Item::kRemoveWorker : Item::kClearWorker;
  queue_.enqueue(Item{.kind = kind, .worker_id = worker_id});
}

void IndexShard::SetCapacity(std::uint64_t worker_id, std::uint64_t blocks) {
  submitted_.fetch_add(1, std::memory_order_relaxed);
  queue_.enqueue(Item{.kind = Item::kSetCapacity, .worker_id = worker_id, .blocks_per_rank = blocks});
}

void IndexShard::RequestDump(WorkerKey worker, SequenceKind numbering, bool first_sight) {
  submitted_.fetch_add(1, std::memory_order_relaxed);
  queue_.enqueue(Item{.kind = Item::kRequestDump,
                      .numbering = numbering,
                      .first_sight = first_sight,
                      .dp_rank = worker.dp_rank,
                      .worker_id = worker.worker_id});
}

void IndexShard::Barrier(std::shared_ptr<std::latch> barrier) {
  submitted_.fetch_add(1, std::memory_order_relaxed);
  queue_.enqueue(Item{.kind = Item::kBarrier, .barrier = std::move(barrier)});
}

void IndexShard::Recovered(RecoveryPart part) {
  submitted_.fetch_add(1, std::memory_order_relaxed);
  const std::uint64_t worker_id = part.worker.worker_id;
  queue_.enqueue(
      Item{.kind = Item::kRecovered, .worker_id = worker_id, .part = std::make_unique<RecoveryPart>(std::move(part))});
}

void IndexShard::Flush() {
  if (InRecoveryAsk(owner_)) return;
  KvMutexLock g(flush_mu_);
  ++flush_waiters_;
  flush_cv_.wait(flush_mu_, [&] { return applied_.load() >= submitted_.load(); });
  --flush_waiters_;
}

void IndexShard::FindMatches(std::span<const SequenceHash> hashes, OverlapScores& out) const {
  ReadGate::Reader r(gate_, read_patience_);
  GatedIndex().FindMatches(hashes, out, r.tolerant());
}

void IndexShard::FindMatches(std::span<const SequenceHash> hashes, MatchRuns& out,
                             std::span<const std::uint64_t> known) const {
  ReadGate::Reader r(gate_, read_patience_);
  GatedIndex().FindMatches(hashes, out, r.tolerant(), known);
}

bool IndexShard::TranslateMatches(const MatchRuns& runs, OverlapScores& out) const {
  ReadGate::Reader r(gate_, read_patience_);
  return GatedIndex().TranslateMatches(runs, out, r.tolerant());
}

void IndexShard::TreeSizes(std::vector<WorkerTreeSize>& out) const {
  KvReaderLock lk(mu_);
  index_.ForEachWorker([&](WorkerKey k, std::size_t n) { out.push_back({k, n}); });
}

std::size_t IndexShard::TreeSize(WorkerKey worker) const {
  KvReaderLock lk(mu_);
  return index_.TreeSize(worker);
}

IndexMemory IndexShard::Memory() const {
  KvReaderLock lk(mu_);
  return index_.Memory();
}

void IndexShard::AddCounters(IndexCounters& c) const {
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

void IndexShard::DumpableRanks(std::vector<WorkerKey>& out) const {
  KvReaderLock lk(mu_);
  const std::size_t first = out.size();
  index_.ForEachWorker([&](WorkerKey k, std::size_t) { out.push_back({k.worker_id, k.dp_rank & ~kTierRankBits}); });
  streams_.ForEachRank([&](WorkerKey k) { out.push_back(k); });
  std::sort(out.begin() + static_cast<std::ptrdiff_t>(first), out.end());
  out.erase(std::unique(out.begin() + static_cast<std::ptrdiff_t>(first), out.end()), out.end());
}

std::optional<RankDump> IndexShard::DumpRank(WorkerKey rank) const {
  KvReaderLock lk(mu_);
  RankDump d{.rank = rank};
  if (streams_.Known(rank)) {
    const std::optional<EventStreams::Position> p = streams_.PositionOf(rank);
    if (!p) return std::nullopt;  // recovering: its worker's answer is still to come
    d.numbering = p->numbering;
    d.last_event_id = p->last_event_id;
  }
  index_.DumpRank(rank, d.chains);
  return d;
}

void IndexShard::TakeSuperseded(std::vector<std::pair<WorkerKey, std::uint64_t>>& out) {
  KvMutexLock g(superseded_mu_);
  out.insert(out.end(), superseded_.begin(), superseded_.end());
  superseded_.clear();
}

void IndexShard::TakeStale(std::vector<WorkerKey>& out) {
  KvMutexLock g(stale_mu_);
  out.insert(out.end(), stale_.begin(), stale_.end());
  stale_.clear();
}

bool IndexShard::TakeRoom(const KvEventBatch& batch) {
  if (depth_.fetch_add(1, std::memory_order_relaxed) < capacity_) return true;
  depth_.fetch_sub(1, std::memory_order_relaxed);
  queue_full_.fetch_add(1, std::memory_order_relaxed);
  MarkStale({batch.worker_id, batch.dp_rank});
  return false;
}

void IndexShard::MarkStale(WorkerKey w) {
  KvMutexLock g(stale_mu_);
  stale_.insert(w);
}

void IndexShard::Run() {
  const std::string name = "kv-shard-" + std::to_string(number_);
  pthread_setname_np(pthread_self(), name.c_str());  // for top -H and perf
  ShardedIndex::MarkIngestThread();
  std::vector<Item> items(max_bulk_);
  std::vector<KvEventBatch> giving;  // applied batches, given back after each bulk
  giving.reserve(max_bulk_);
  while (true) {
    const std::size_t n = queue_.wait_dequeue_bulk_timed(items.begin(), max_bulk_, std::chrono::milliseconds(100));
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
        const bool writes = it.kind != Item::kWake && it.kind != Item::kBarrier;
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
            capacity_of_[it.worker_id] = it.blocks_per_rank;
            ++done;
            break;
          case Item::kRequestDump:
            streams_.RequestDump({it.worker_id, it.dp_rank}, it.numbering, it.first_sight);
            ++done;
            break;
          case Item::kRecovered:
            slice += ApplyRecovered(*it.part);
            ++done;
            break;
          case Item::kBarrier:
            it.barrier->count_down();
            ++done;
            break;
          case Item::kWake: break;
        }
        if (writes && gate_.EndWrite() && index_.HasRetired()) index_.FreeRetired();
        if (it.kind == Item::kBatch && SpareBatches::Keep(it.batch)) giving.push_back(std::move(it.batch));
        it.batch = {};
        it.part.reset();
        it.barrier.reset();
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

void IndexShard::Upkeep(SteadyTime now) {
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

std::vector<IndexShard::Ask> IndexShard::TakeAsks() {
  std::vector<Ask> asks;
  asks.swap(asks_);
  return asks;
}

namespace {
// The index whose on_recovery the calling thread is in, else null (IndexShard::InRecoveryAsk).
thread_local const ShardedIndex* t_recovering_index = nullptr;

// Sets t_recovering_index for a scope, and restores what it was however the scope ends.
class RecoveryAskScope {
 public:
  explicit RecoveryAskScope(const ShardedIndex& index) : outer_(std::exchange(t_recovering_index, &index)) {}
  ~RecoveryAskScope() { t_recovering_index = outer_; }
  RecoveryAskScope(const RecoveryAskScope&) = delete;
  RecoveryAskScope& operator=(const RecoveryAskScope&) = delete;

 private:
  const ShardedIndex* const outer_;
};
}  // namespace

bool IndexShard::InRecoveryAsk(const ShardedIndex& index) { return t_recovering_index == &index; }

void IndexShard::MakeAsks(const std::vector<Ask>& asks) {
  if (asks.empty()) return;
  const RecoveryAskScope scope(owner_);
  for (const Ask& a : asks) on_recovery_(a.worker, a.numbering, a.start, a.generation);
}

const KvStored* IndexShard::FirstStored(const KvEventBatch& b) {
  return b.ops.empty() ? nullptr : std::get_if<KvStored>(&b.ops.front().data);
}

const KvStored* IndexShard::FirstStored(const Item& it) {
  return it.kind == Item::kBatch ? FirstStored(it.batch) : nullptr;
}

void IndexShard::PrefetchOps(const Item& it) {
  if (it.kind == Item::kBatch && !it.batch.ops.empty()) PrefetchLine(it.batch.ops.data());
}

void IndexShard::PrefetchBlocks(const Item& it) {
  if (const KvStored* st = FirstStored(it)) {
    if (st->blocks.empty()) return;
    PrefetchLine(st->blocks.data());
    PrefetchLine(&st->blocks.back());
  } else if (it.kind == Item::kBatch && !it.batch.ops.empty()) {
    const auto* rm = std::get_if<KvRemoved>(&it.batch.ops.front().data);
    if (rm == nullptr || rm->block_hashes.empty()) return;
    PrefetchLine(rm->block_hashes.data());
  }
}

void IndexShard::PrefetchSlots(const KvEventBatch& b) const {
  if (b.ops.empty()) return;
  const WorkerKey rank = TierRank({b.worker_id, b.dp_rank}, b.ops.front().tier);
  if (const KvStored* st = FirstStored(b)) {
    index_.PrefetchStored(rank, st->parent_hash, st->blocks);
  } else if (const auto* rm = std::get_if<KvRemoved>(&b.ops.front().data)) {
    index_.PrefetchRemoved(rank, rm->block_hashes);
  }
}

void IndexShard::PrefetchSlots(const Item& it) const {
  if (it.kind == Item::kBatch) PrefetchSlots(it.batch);
}

void IndexShard::ApplyBatch(KvEventBatch& b, bool rejudged) {
  if (!rejudged) batches_applied_.Add(1);  // a held batch judged again was counted when it came
  const WorkerKey key{b.worker_id, b.dp_rank};
  const std::uint64_t gaps_before = streams_.counters().gaps;
  const EventStreams::Verdict verdict = streams_.Live(b);
  // Without recovery a gap leaves the rank wrong: flag it (with recovery it is being asked).
  if (!recover_ && streams_.counters().gaps > gaps_before) MarkStale(key);
  switch (verdict) {
    case EventStreams::Verdict::kApply: ApplyOps(key, b); break;
    case EventStreams::Verdict::kClearThenApply:
      index_.ClearRank(key);
      ApplyOps(key, b);
      break;
    case EventStreams::Verdict::kHeld:
    case EventStreams::Verdict::kDrop: break;
  }
  PublishStreamCounters();
}

std::size_t IndexShard::ApplyRecovered(RecoveryPart& part) {
  EventStreams::Outcome o = streams_.Recovered(part);
  if (o.superseded) {
    KvMutexLock g(superseded_mu_);
    superseded_.emplace_back(part.worker, *o.superseded);
  }
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
    ApplyBatch(b, /*rejudged=*/true);
  }
  PublishStreamCounters();
  return blocks;
}

void IndexShard::PublishStreamCounters() {
  const StreamCounters& c = streams_.counters();
  gaps_.Set(c.gaps);
  restarts_.Set(c.restarts);
  duplicate_.Set(c.duplicates);
  held_dropped_.Set(c.held_dropped);
}

void IndexShard::ApplyOps(WorkerKey rank, const KvEventBatch& b) {
  for (const KvOp& op : b.ops) {
    if (op.tier != StorageTier::kDevice) non_device_ops_.Add(1);
    const WorkerKey key = TierRank(rank, op.tier);
    ApplyOutcome r;
    if (auto* s = std::get_if<KvStored>(&op.data)) {
      // A registration's capacity is its GPU cache's; host and disk tiers are larger, so their
      // ranks take only the router's own bound per rank (--router-max-worker-blocks).
      auto cap = capacity_of_.find(key.worker_id);
      const std::uint64_t limit =
          cap == capacity_of_.end() || key.dp_rank != rank.dp_rank ? default_capacity_ : cap->second;
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

void IndexShard::SetConcurrentReaders() {
  mu_.lock();
  index_.SetConcurrentReaders(true);
  index_.ShrinkTablesLater(true);  // Upkeep gives the memory back
  mu_.unlock();
}

}  // namespace kvrouter
