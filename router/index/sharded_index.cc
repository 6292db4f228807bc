#include "router/index/sharded_index.h"

#include <sched.h>

#include <algorithm>
#include <latch>
#include <limits>
#include <memory>

#include "router/index/shard.h"
#include "router/index/spare_batches.h"

namespace kvrouter {

ShardedIndex::ShardedIndex(ShardedIndexOptions options)
    : spares_(std::make_unique<SpareBatches>()), apply_on_submit_(options.apply_on_submit) {
  const std::size_t n = options.num_shards == 0 ? 1 : options.num_shards;
  for (std::size_t i = 0; i < n; ++i) shards_.push_back(std::make_unique<IndexShard>(options, *this, *spares_, i));
}

ShardedIndex::~ShardedIndex() = default;

std::size_t ShardedIndex::ShardOf(std::uint64_t worker_id) const { return Mix64(worker_id) % shards_.size(); }

bool ShardedIndex::Submit(KvEventBatch&& batch) {
  IndexShard& shard = *shards_[ShardOf(batch.worker_id)];
  KvEventBatch* const one[] = {&batch};
  if (apply_on_submit_ && shard.ApplyHere(one)) return true;
  return shard.Submit(std::move(batch));
}

void ShardedIndex::ClearWorker(std::uint64_t worker_id) {
  shards_[ShardOf(worker_id)]->Control(IndexShard::WorkerControl::kClear, worker_id);
}

void ShardedIndex::RemoveWorker(std::uint64_t worker_id) {
  shards_[ShardOf(worker_id)]->Control(IndexShard::WorkerControl::kRemove, worker_id);
}

void ShardedIndex::SubmitAll(std::vector<KvEventBatch>& batches, std::vector<std::uint64_t>& refused) {
  thread_local std::vector<std::vector<KvEventBatch*>> by_shard;
  by_shard.resize(shards_.size());
  for (KvEventBatch& b : batches) by_shard[ShardOf(b.worker_id)].push_back(&b);
  for (std::size_t s = 0; s < shards_.size(); ++s) {
    if (by_shard[s].empty()) continue;
    if (!apply_on_submit_ || !shards_[s]->ApplyHere(by_shard[s])) shards_[s]->SubmitMany(by_shard[s], refused);
    by_shard[s].clear();
  }
}

KvEventBatch ShardedIndex::Spare() { return spares_->Take(); }

bool ShardedIndex::ApplyOnSubmitPays(std::size_t num_shards) {
  cpu_set_t cpus;
  if (sched_getaffinity(0, sizeof cpus, &cpus) != 0) return false;
  return static_cast<std::size_t>(CPU_COUNT(&cpus)) < num_shards + 2;
}

bool ShardedIndex::MarkIngestThread(int tid) {
  const sched_param none{};
  return sched_setscheduler(tid, SCHED_BATCH, &none) == 0;
}

OverlapScores ShardedIndex::FindMatches(std::span<const SequenceHash> seq_hashes) const {
  OverlapScores out;
  FindMatches(seq_hashes, out);
  return out;
}

void ShardedIndex::FindMatches(std::span<const SequenceHash> seq_hashes, OverlapScores& out) const {
  out.clear();
  // Room for as many scores as last time, so the second shard's scores rarely move the first's.
  out.reserve(last_matches_.load(std::memory_order_relaxed));
  for (const auto& s : shards_) s->FindMatches(seq_hashes, out);
  last_matches_.store(out.size(), std::memory_order_relaxed);
}

void ShardedIndex::FindMatches(std::span<const SequenceHash> seq_hashes, IndexMatches& out,
                               std::span<const std::uint64_t> known) const {
  out.shards.resize(shards_.size());
  for (std::size_t s = 0; s < shards_.size(); ++s) shards_[s]->FindMatches(seq_hashes, out.shards[s], known);
}

bool ShardedIndex::TranslateMatches(const IndexMatches& matches, OverlapScores& out) const {
  const std::size_t base = out.size();
  for (std::size_t s = 0; s < shards_.size() && s < matches.shards.size(); ++s) {
    if (!shards_[s]->TranslateMatches(matches.shards[s], out)) {
      out.resize(base);
      return false;
    }
  }
  return true;
}

std::vector<WorkerTreeSize> ShardedIndex::TreeSizes() const {
  std::vector<WorkerTreeSize> out;
  for (const auto& s : shards_) s->TreeSizes(out);
  return out;
}

void ShardedIndex::SetCapacity(std::uint64_t worker_id, std::uint64_t blocks_per_rank) {
  shards_[ShardOf(worker_id)]->SetCapacity(worker_id, blocks_per_rank);
}

void ShardedIndex::RequestDump(WorkerKey worker, SequenceKind numbering, bool first_sight) {
  shards_[ShardOf(worker.worker_id)]->RequestDump(worker, numbering, first_sight);
}

std::vector<WorkerKey> ShardedIndex::DumpableRanks() const {
  std::vector<WorkerKey> out;
  for (const auto& s : shards_) s->DumpableRanks(out);
  std::sort(out.begin(), out.end());  // each shard's are unique, and a worker is in one shard
  return out;
}

std::optional<RankDump> ShardedIndex::DumpRank(WorkerKey rank) const {
  return shards_[ShardOf(rank.worker_id)]->DumpRank(rank);
}

std::vector<std::pair<WorkerKey, std::uint64_t>> ShardedIndex::TakeSuperseded() {
  std::vector<std::pair<WorkerKey, std::uint64_t>> out;
  for (const auto& s : shards_) s->TakeSuperseded(out);
  return out;
}

void ShardedIndex::Recovered(RecoveryPart part) {
  const std::size_t shard = ShardOf(part.worker.worker_id);
  shards_[shard]->Recovered(std::move(part));
}

std::size_t ShardedIndex::TreeSize(WorkerKey worker) const {
  return shards_[ShardOf(worker.worker_id)]->TreeSize(worker);
}

IndexCounters ShardedIndex::Counters() const {
  IndexCounters c;
  for (const auto& s : shards_) s->AddCounters(c);
  return c;
}

std::uint64_t ShardedIndex::UpkeepPasses() const {
  std::uint64_t fewest = std::numeric_limits<std::uint64_t>::max();
  for (const auto& s : shards_) fewest = std::min(fewest, s->upkeeps());
  return fewest;
}

IndexMemory ShardedIndex::Memory() const {
  IndexMemory m;
  for (const auto& s : shards_) {
    IndexMemory x = s->Memory();
    m.bytes += x.bytes;
    m.nodes += x.nodes;
    m.holdings += x.holdings;
    m.table_bytes += x.table_bytes;
  }
  return m;
}

std::vector<WorkerKey> ShardedIndex::TakeStaleWorkers() {
  std::vector<WorkerKey> out;
  for (const auto& s : shards_) s->TakeStale(out);
  return out;
}

void ShardedIndex::AwaitOwnSubmissions() {
  if (IndexShard::InRecoveryAsk(*this)) return;  // as Flush: it would wait for this very thread
  auto barrier = std::make_shared<std::latch>(static_cast<std::ptrdiff_t>(shards_.size()));
  for (const auto& s : shards_) s->Barrier(barrier);
  barrier->wait();
}

void ShardedIndex::Flush() {
  for (const auto& s : shards_) s->Flush();
}

}  // namespace kvrouter
