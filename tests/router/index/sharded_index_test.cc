#include "router/index/sharded_index.h"

#include <gtest/gtest.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <future>
#include <fstream>
#include <set>
#include <string>
#include <thread>

#include "tests/await.h"

namespace kvrouter {
namespace {

KvEventBatch StoredBatch(std::uint64_t worker, std::uint32_t rank, std::uint64_t event_id,
                         std::optional<BlockHash> parent, std::vector<StoredBlock> blocks,
                         StorageTier tier = StorageTier::kDevice) {
  KvEventBatch b;
  b.worker_id = worker;
  b.dp_rank = rank;
  b.sequence = {SequenceKind::kEventId, event_id};
  b.ops.push_back({tier, KvStored{parent, std::move(blocks)}});
  return b;
}

KvEventBatch RemovedBatch(std::uint64_t worker, std::uint64_t event_id, std::vector<BlockHash> hs) {
  KvEventBatch b;
  b.worker_id = worker;
  b.sequence = {SequenceKind::kEventId, event_id};
  b.ops.push_back({StorageTier::kDevice, KvRemoved{std::move(hs)}});
  return b;
}

std::uint32_t OverlapOf(const OverlapScores& s, WorkerKey w) {
  for (const auto& e : s)
    if (e.worker == w) return e.blocks;
  return 0;
}

// Names of this process's threads.
std::multiset<std::string> ThreadNames() {
  std::multiset<std::string> names;
  for (const auto& t : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream in(t.path() / "comm");
    std::string name;
    if (std::getline(in, name)) names.insert(name);
  }
  return names;
}

// Threads of this process in the batch scheduling class.
std::size_t BatchThreads() {
  std::size_t n = 0;
  for (const auto& t : std::filesystem::directory_iterator("/proc/self/task")) {
    if (sched_getscheduler(std::stoi(t.path().filename().string())) == SCHED_BATCH) ++n;
  }
  return n;
}

// Ingestion yields to routes on a busy machine: every shard thread (named kv-shard-N) runs in
// the batch class, and so does a thread that marks itself; other threads keep theirs.
TEST(ShardedIndex, ShardThreadsAndMarkedThreadsRunAsBatch) {
  const std::size_t before = BatchThreads();
  {
    ShardedIndex index({.num_shards = 3});
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (BatchThreads() < before + 3 && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
    EXPECT_EQ(BatchThreads(), before + 3);
    // Named before they join the batch class: one name per shard, for top -H and perf.
    const auto names = ThreadNames();
    for (const char* n : {"kv-shard-0", "kv-shard-1", "kv-shard-2"}) EXPECT_EQ(names.count(n), 1u) << n;
  }
  int marked = -1;
  bool ok = false;
  std::thread([&] {
    const sched_param none{};
    ASSERT_EQ(sched_setscheduler(0, SCHED_OTHER, &none), 0);  // not inherited from this one
    ok = ShardedIndex::MarkIngestThread();
    marked = sched_getscheduler(0);
  }).join();
  EXPECT_TRUE(ok);
  EXPECT_EQ(marked, SCHED_BATCH);
}

TEST(ShardedIndex, MatchesMergeAcrossShards) {
  ShardedIndex idx({.num_shards = 4});
  for (std::uint64_t w = 0; w < 16; ++w) {
    std::vector<StoredBlock> chain;
    for (std::uint64_t i = 0; i <= w % 4; ++i) chain.push_back({100 + i, 1 + i});
    ASSERT_TRUE(idx.Submit(StoredBatch(w, 0, 1, std::nullopt, chain)));
  }
  idx.Flush();
  const std::vector<LocalHash> q = {1, 2, 3, 4};
  auto s = idx.FindMatches(ComputeSequenceHashes(q));
  ASSERT_EQ(s.size(), 16u);
  for (std::uint64_t w = 0; w < 16; ++w) EXPECT_EQ(OverlapOf(s, {w, 0}), w % 4 + 1);
  EXPECT_EQ(idx.Counters().blocks_stored, 4u * (1 + 2 + 3 + 4));
  // Read as runs of slots per shard, then turned into the same scores.
  IndexMatches runs;
  idx.FindMatches(ComputeSequenceHashes(q), runs);
  EXPECT_EQ(runs.shards.size(), 4u);
  EXPECT_EQ(runs.max_depth(), 4u);
  OverlapScores t;
  ASSERT_TRUE(idx.TranslateMatches(runs, t));
  ASSERT_EQ(t.size(), 16u);
  for (std::uint64_t w = 0; w < 16; ++w) EXPECT_EQ(OverlapOf(t, {w, 0}), w % 4 + 1);
}

TEST(ShardedIndex, RunsWhoseSlotPassedToAnotherWorkerAreNotTranslated) {
  ShardedIndex idx({.num_shards = 2});
  const std::uint64_t a = 1;
  std::uint64_t b = 2;
  while (idx.ShardOf(b) != idx.ShardOf(a)) ++b;  // the same shard: b can take a's slot
  const std::uint64_t other = idx.ShardOf(3) != idx.ShardOf(a) ? 3 : 4;
  ASSERT_TRUE(idx.Submit(StoredBatch(a, 0, 1, std::nullopt, {{100, 1}, {101, 2}})));
  ASSERT_TRUE(idx.Submit(StoredBatch(other, 0, 1, std::nullopt, {{100, 1}})));
  idx.Flush();
  const auto seq = ComputeSequenceHashes(std::vector<LocalHash>{1, 2});
  IndexMatches runs;
  idx.FindMatches(seq, runs);
  idx.RemoveWorker(a);
  ASSERT_TRUE(idx.Submit(StoredBatch(b, 0, 1, std::nullopt, {{200, 9}})));
  idx.Flush();
  OverlapScores out = {{{77, 0}, 3}};  // what the caller had: kept as it was
  EXPECT_FALSE(idx.TranslateMatches(runs, out));
  EXPECT_EQ(std::vector<OverlapScore>(out.begin(), out.end()), (std::vector<OverlapScore>{{{77, 0}, 3}}));
  idx.FindMatches(seq, runs);
  ASSERT_TRUE(idx.TranslateMatches(runs, out));
  EXPECT_EQ(out.size(), 2u);
  EXPECT_EQ(OverlapOf(out, {other, 0}), 1u);
  EXPECT_EQ(OverlapOf(out, {b, 0}), 0u);
}

// Applied batches come back for their memory (the delivery thread decodes into them): small
// ones only, at most 4,096 of them, and the index they were applied to is not changed by it.
TEST(ShardedIndex, AppliedBatchesComeBackAsSpares) {
  ShardedIndex idx({.num_shards = 2});
  EXPECT_TRUE(idx.Spare().ops.empty());  // nothing applied yet: an empty batch
  KvEventBatch small = StoredBatch(1, 0, 1, std::nullopt, {{10, 1}, {11, 2}});
  const StoredBlock* blocks = std::get<KvStored>(small.ops[0].data).blocks.data();
  std::vector<StoredBlock> long_chain;
  for (std::uint64_t i = 0; i < 65; ++i) long_chain.push_back({200 + i, 100 + i});
  ASSERT_TRUE(idx.Submit(std::move(small)));
  ASSERT_TRUE(idx.Submit(StoredBatch(2, 0, 1, std::nullopt, long_chain)));
  idx.Flush();
  KvEventBatch spare = idx.Spare();
  ASSERT_EQ(spare.ops.size(), 1u);
  EXPECT_EQ(std::get<KvStored>(spare.ops[0].data).blocks.data(), blocks);  // the same memory
  EXPECT_TRUE(idx.Spare().ops.empty());                                    // the 65-block batch was freed, not kept
  spare.ops.clear();                                                       // reusing it changes nothing indexed
  const std::vector<LocalHash> q = {1, 2};
  EXPECT_EQ(OverlapOf(idx.FindMatches(ComputeSequenceHashes(q)), {1, 0}), 2u);

  for (std::uint64_t e = 2; e < 2 + 5000; ++e) {
    ASSERT_TRUE(idx.Submit(StoredBatch(1, 0, e, std::nullopt, {{1000 + e, 1000 + e}})));
  }
  idx.Flush();
  std::size_t spares = 0;
  while (!idx.Spare().ops.empty()) ++spares;
  EXPECT_EQ(spares, 4096u);
}

// A thread takes spares several at a time and keeps the rest: only for the index they came from.
TEST(ShardedIndex, SparesTakenFromOneIndexAreNotHandedOutByAnother) {
  ShardedIndex first({.num_shards = 1});
  for (std::uint64_t e = 1; e <= 3; ++e) ASSERT_TRUE(first.Submit(StoredBatch(1, 0, e, std::nullopt, {{e, e}})));
  first.Flush();
  EXPECT_FALSE(first.Spare().ops.empty());  // one of three; this thread holds the other two
  ShardedIndex second({.num_shards = 1});
  EXPECT_TRUE(second.Spare().ops.empty());  // nothing applied here
}

// A shard's sequence-hash table keeps its capacity when a fleet clears (the refill then does not
// rehash), and gives the memory back once it has stayed under an eighth full for shrink_after.
TEST(ShardedIndex, AClearedFleetKeepsTheTableUntilItHasStayedSmallForShrinkAfter) {
  auto fill = [](ShardedIndex& idx, std::uint64_t first_event) {
    for (std::uint64_t b = 1; b <= 20000; ++b) {
      ASSERT_TRUE(idx.Submit(StoredBatch(1 + b % 4, 0, first_event + b / 4, std::nullopt, {{b, b}})));
    }
    idx.Flush();
  };
  auto clear = [](ShardedIndex& idx) {
    for (std::uint64_t w = 1; w <= 4; ++w) idx.ClearWorker(w);
    idx.Flush();
  };
  // 20,000 entries of 12 bytes: 32,768 slots.
  constexpr std::size_t kTable = 32768 * 12;
  ShardedIndex kept({.num_shards = 1, .shrink_after = std::chrono::hours(1)});
  fill(kept, 1);
  ASSERT_EQ(kept.Memory().table_bytes, kTable);
  clear(kept);
  EXPECT_EQ(kept.Memory().nodes, 0u);
  const std::uint64_t passes = kept.UpkeepPasses();
  ASSERT_TRUE(AwaitTrue([&] { return kept.UpkeepPasses() >= passes + 3; }));
  EXPECT_EQ(kept.Memory().table_bytes, kTable);  // kept through three upkeeps

  ShardedIndex given_back({.num_shards = 1, .shrink_after = std::chrono::milliseconds(0)});
  fill(given_back, 1);
  clear(given_back);
  EXPECT_TRUE(AwaitTrue([&] { return given_back.Memory().table_bytes == 0; }));
  fill(given_back, 10000);  // and it grows again
  EXPECT_EQ(given_back.Memory().nodes, 20000u);
  EXPECT_EQ(given_back.Memory().table_bytes, kTable);
  const std::vector<LocalHash> q = {20000};
  EXPECT_EQ(given_back.FindMatches(ComputeSequenceHashes(q)).size(), 1u);
}

// The table is not given back while a busy shard keeps it above an eighth full between upkeeps:
// being underfull is sampled at every upkeep, not only when the shard is idle.
TEST(ShardedIndex, ARefilledTableIsNotShrunkByAnEarlierEmptySpell) {
  ShardedIndex idx({.num_shards = 1, .shrink_after = std::chrono::seconds(1)});
  std::uint64_t event = 1;
  auto store = [&](std::uint64_t from, std::uint64_t to) {
    for (std::uint64_t b = from; b < to; ++b)
      ASSERT_TRUE(idx.Submit(StoredBatch(1, 0, event++, std::nullopt, {{b, b}})));
    idx.Flush();
  };
  store(1, 20001);
  idx.ClearWorker(1);
  idx.Flush();
  std::uint64_t passes = idx.UpkeepPasses();
  ASSERT_TRUE(AwaitTrue([&] { return idx.UpkeepPasses() >= passes + 1; }));  // seen underfull
  store(20001, 40001);  // refilled, and kept full for a shrink_after's worth of upkeeps
  passes = idx.UpkeepPasses();
  ASSERT_TRUE(AwaitTrue([&] { return idx.UpkeepPasses() >= passes + 10; }));
  idx.ClearWorker(1);  // empty again, past shrink_after since the first empty spell began
  idx.Flush();
  const std::size_t table = idx.Memory().table_bytes;
  passes = idx.UpkeepPasses();
  ASSERT_TRUE(AwaitTrue([&] { return idx.UpkeepPasses() >= passes + 2; }));
  EXPECT_EQ(idx.Memory().table_bytes, table);  // not before shrink_after of this spell
  EXPECT_TRUE(AwaitTrue([&] { return idx.Memory().table_bytes == 0; }));
}

// The upkeep shrinks the sequence-hash table while readers query without the shard's lock: they
// keep finding the chain that stays (a shrink publishes a filled table and frees the old one
// only once no reader can hold it; TSan runs this too).
TEST(ShardedIndex, ReadersKeepFindingAChainWhileTheTableShrinksUnderThem) {
  ShardedIndex idx({.num_shards = 1, .queue_capacity = 1 << 20, .shrink_after = std::chrono::milliseconds(0)});
  std::vector<LocalHash> path;
  std::vector<StoredBlock> chain;
  for (LocalHash h = 1; h <= 8; ++h) {
    path.push_back(h);
    chain.push_back({h, h});
  }
  const auto seq_path = ComputeSequenceHashes(path);
  ASSERT_TRUE(idx.Submit(StoredBatch(99, 0, 1, std::nullopt, chain)));
  idx.Flush();
  std::atomic<bool> done{false};
  std::atomic<int> bad{0};
  std::atomic<long> queries{0};
  std::vector<std::thread> readers;
  for (int r = 0; r < 2; ++r) {
    readers.emplace_back([&] {
      while (!done.load()) {
        const OverlapScores s = idx.FindMatches(seq_path);
        if (s.size() != 1 || s[0].worker != WorkerKey{99, 0} || s[0].blocks != 8) bad.fetch_add(1);
        queries.fetch_add(1);
      }
    });
  }
  // Worker 1 fills the table past an eighth and clears, over a few upkeeps (each shrinks the
  // table if it finds it emptied).
  std::uint64_t id = 1;
  const std::uint64_t passes = idx.UpkeepPasses();
  while (idx.UpkeepPasses() < passes + 5) {
    for (std::uint64_t b = 0; b < 4096; ++b, ++id) {
      const std::uint64_t h = 1'000'000 + id;  // apart from the chain's hashes
      ASSERT_TRUE(idx.Submit(StoredBatch(1, 0, id, std::nullopt, {{h, h}})));
    }
    idx.Flush();
    idx.ClearWorker(1);
    idx.Flush();
  }
  // The chain's 8 entries in 16 slots of 12 bytes: shrunk, with the readers still at it.
  EXPECT_TRUE(AwaitTrue([&] { return idx.Memory().table_bytes == 16 * 12; }));
  done.store(true);
  for (auto& t : readers) t.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_GT(queries.load(), 0);
}

// apply_on_submit: an idle shard's events are applied by the submitting thread before Submit
// returns, visible without a Flush.
TEST(ShardedIndex, ApplyOnSubmitAppliesBeforeSubmitReturnsWhenTheShardIsIdle) {
  ShardedIndex idx({.num_shards = 2, .apply_on_submit = true});
  for (std::uint64_t w = 1; w <= 8; ++w) {
    ASSERT_TRUE(idx.Submit(StoredBatch(w, 0, 1, std::nullopt, {{w * 10, w}})));
    EXPECT_EQ(idx.TreeSize({w, 0}), 1u) << w;
  }
  std::vector<KvEventBatch> bulk;
  for (std::uint64_t w = 1; w <= 8; ++w) bulk.push_back(RemovedBatch(w, 2, {w * 10}));
  std::vector<std::uint64_t> refused;
  idx.SubmitAll(bulk, refused);
  EXPECT_TRUE(refused.empty());
  for (std::uint64_t w = 1; w <= 8; ++w) EXPECT_EQ(idx.TreeSize({w, 0}), 0u) << w;
  EXPECT_EQ(idx.Counters().blocks_removed, 8u);
}

// ...but never ahead of what its shard thread has yet to apply: while the shard thread is
// busy (here: held inside a recovery ask it makes), a worker's store and then its removal are
// queued behind it, and applied in that order.
TEST(ShardedIndex, ApplyOnSubmitNeverOvertakesWhatTheShardThreadHasYetToApply) {
  std::mutex mu;
  std::condition_variable cv;
  bool holding = false, release = false;
  std::uint64_t generation_of_1 = 0;
  auto on_recovery = [&](WorkerKey w, SequenceKind, std::optional<std::uint64_t>, std::uint64_t generation) {
    std::unique_lock g(mu);
    if (w.worker_id == 1) {
      generation_of_1 = generation;
      return;
    }
    holding = true;  // worker 99's ask: the shard thread stays here until released
    cv.notify_all();
    cv.wait(g, [&] { return release; });
  };
  ShardedIndex idx({.num_shards = 1, .on_recovery = on_recovery, .apply_on_submit = true});
  // Worker 1's rank goes live: its dump (empty) answered, the next event id is 1.
  idx.RequestDump({1, 0});
  idx.Flush();
  idx.Recovered(
      {.worker = {1, 0}, .kind = RecoveryPart::Kind::kDump, .last_event_id = 0, .generation = generation_of_1});
  idx.Flush();
  idx.RequestDump({99, 0});
  {
    std::unique_lock g(mu);
    cv.wait(g, [&] { return holding; });
  }
  ASSERT_TRUE(idx.Submit(StoredBatch(1, 0, 1, std::nullopt, {{10, 1}})));
  ASSERT_TRUE(idx.Submit(RemovedBatch(1, 2, {10})));
  EXPECT_EQ(idx.Counters().blocks_stored, 0u);  // queued, not applied ahead of the held ask
  {
    std::lock_guard g(mu);
    release = true;
  }
  cv.notify_all();
  idx.Flush();
  const IndexCounters c = idx.Counters();
  EXPECT_EQ(c.blocks_stored, 1u);
  EXPECT_EQ(c.blocks_removed, 1u);
  EXPECT_EQ(c.block_not_found, 0u);
  EXPECT_EQ(idx.TreeSize({1, 0}), 0u);
}

// on_recovery may answer at once and wait for its answer to be applied, as a synchronous bus
// and a caller that flushes would: Flush and AwaitOwnSubmissions made from inside it return
// instead of waiting for the very thread that called them, and the answer is applied after it.
TEST(ShardedIndex, AFlushFromInsideOnRecoveryReturnsAndTheAnswerIsAppliedAfter) {
  ShardedIndex* self = nullptr;
  std::atomic<int> asks{0};
  auto on_recovery = [&](WorkerKey w, SequenceKind, std::optional<std::uint64_t>, std::uint64_t generation) {
    self->Recovered({.worker = w, .kind = RecoveryPart::Kind::kDump, .last_event_id = 0, .generation = generation});
    self->Flush();
    self->AwaitOwnSubmissions();
    ++asks;
  };
  ShardedIndex idx({.num_shards = 2, .on_recovery = on_recovery});
  self = &idx;
  idx.RequestDump({1, 0});
  idx.RequestDump({2, 0});
  // A deadlock fails here at once, not at the test runner's timeout (the stuck shard thread
  // would also hang the index's destruction).
  auto flushed = std::async(std::launch::async, [&] { idx.Flush(); });
  if (flushed.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    ADD_FAILURE() << "Flush from inside on_recovery waited for itself";
    std::fflush(stdout);
    std::_Exit(1);
  }
  EXPECT_EQ(asks.load(), 2);
  // Both dumps were applied: each rank takes its next event id.
  ASSERT_TRUE(idx.Submit(StoredBatch(1, 0, 1, std::nullopt, {{10, 1}})));
  ASSERT_TRUE(idx.Submit(StoredBatch(2, 0, 1, std::nullopt, {{20, 2}})));
  idx.Flush();
  EXPECT_EQ(idx.TreeSize({1, 0}), 1u);
  EXPECT_EQ(idx.TreeSize({2, 0}), 1u);
  EXPECT_EQ(idx.Counters().gaps, 0u);
}

// Only the index whose on_recovery the thread is in returns at once: another index's Flush on
// that thread still waits for what it was given.
TEST(ShardedIndex, InsideOneIndexsOnRecoveryAnotherIndexsFlushStillWaits) {
  ShardedIndex other({.num_shards = 1});
  std::atomic<std::size_t> other_held{0};
  auto on_recovery = [&](WorkerKey, SequenceKind, std::optional<std::uint64_t>, std::uint64_t) {
    EXPECT_TRUE(other.Submit(StoredBatch(9, 0, 1, std::nullopt, {{90, 9}, {91, 10}})));
    other.Flush();
    other_held = other.TreeSize({9, 0});
  };
  ShardedIndex idx({.num_shards = 1, .on_recovery = on_recovery});
  idx.RequestDump({1, 0});
  idx.Flush();
  EXPECT_EQ(other_held.load(), 2u);
}

TEST(ShardedIndex, DuplicateEventIdIsDroppedAndGapIsFlagged) {
  ShardedIndex idx({.num_shards = 2});
  ASSERT_TRUE(idx.Submit(StoredBatch(5, 0, 1, std::nullopt, {{100, 1}})));
  ASSERT_TRUE(idx.Submit(StoredBatch(5, 0, 1, std::nullopt, {{200, 9}})));  // repeat of id 1
  ASSERT_TRUE(idx.Submit(StoredBatch(5, 0, 4, 100, {{101, 2}})));           // ids 2, 3 missing
  idx.Flush();
  auto c = idx.Counters();
  EXPECT_EQ(c.duplicate, 1u);
  EXPECT_EQ(c.gaps, 1u);
  const std::vector<LocalHash> repeat_path = {9};
  EXPECT_TRUE(idx.FindMatches(ComputeSequenceHashes(repeat_path)).empty());
  const std::vector<LocalHash> q = {1, 2};
  EXPECT_EQ(OverlapOf(idx.FindMatches(ComputeSequenceHashes(q)), {5, 0}), 2u);  // the gap's event still applies
  auto stale = idx.TakeStaleWorkers();
  ASSERT_EQ(stale.size(), 1u);
  EXPECT_EQ(stale[0], (WorkerKey{5, 0}));
  EXPECT_TRUE(idx.TakeStaleWorkers().empty());
}

TEST(ShardedIndex, EventIdsAreTrackedPerDpRank) {
  ShardedIndex idx;
  ASSERT_TRUE(idx.Submit(StoredBatch(5, 0, 1, std::nullopt, {{100, 1}})));
  ASSERT_TRUE(idx.Submit(StoredBatch(5, 1, 1, std::nullopt, {{100, 1}})));
  idx.Flush();
  EXPECT_EQ(idx.Counters().duplicate, 0u);
  EXPECT_EQ(idx.FindMatches(ComputeSequenceHashes(std::vector<LocalHash>{1})).size(), 2u);
}

TEST(ShardedIndex, RestartedPublisherStartsFromAnEmptyCache) {
  ShardedIndex idx;
  ASSERT_TRUE(idx.Submit(StoredBatch(5, 0, 1, std::nullopt, {{100, 1}})));
  ASSERT_TRUE(idx.Submit(StoredBatch(5, 0, 2, std::nullopt, {{200, 7}})));
  ASSERT_TRUE(idx.Submit(StoredBatch(5, 0, 1, std::nullopt, {{300, 8}})));  // restart
  idx.Flush();
  EXPECT_EQ(idx.Counters().restarts, 1u);
  EXPECT_TRUE(idx.FindMatches(ComputeSequenceHashes(std::vector<LocalHash>{1})).empty());
  EXPECT_EQ(idx.FindMatches(ComputeSequenceHashes(std::vector<LocalHash>{8})).size(), 1u);
}

// A restart empties the rank on every tier: an engine that restarted has no CPU cache either.
TEST(ShardedIndex, ARestartEmptiesTheRankOnEveryTier) {
  ShardedIndex idx;
  ASSERT_TRUE(idx.Submit(StoredBatch(5, 0, 1, std::nullopt, {{100, 1}, {101, 2}}, StorageTier::kHostPinned)));
  ASSERT_TRUE(idx.Submit(StoredBatch(5, 0, 2, std::nullopt, {{102, 3}}, StorageTier::kDisk)));
  ASSERT_TRUE(idx.Submit(StoredBatch(5, 0, 1, std::nullopt, {{300, 8}})));  // restart
  idx.Flush();
  EXPECT_EQ(idx.Counters().restarts, 1u);
  EXPECT_EQ(idx.TreeSize(TierRank({5, 0}, StorageTier::kHostPinned)), 0u);
  EXPECT_EQ(idx.TreeSize(TierRank({5, 0}, StorageTier::kDisk)), 0u);
  EXPECT_EQ(idx.TreeSize({5, 0}), 1u);
}

// Host and disk tiers are bigger than the GPU cache a registration announces: their ranks are
// bounded by the router's own per-rank bound only.
TEST(ShardedIndex, TierRanksAreNotBoundByTheRegisteredCapacity) {
  ShardedIndex idx;
  idx.SetCapacity(5, 2);
  ASSERT_TRUE(idx.Submit(StoredBatch(5, 0, 1, std::nullopt, {{100, 1}, {101, 2}, {102, 3}}, StorageTier::kHostPinned)));
  ASSERT_TRUE(idx.Submit(StoredBatch(5, 0, 2, std::nullopt, {{200, 4}, {201, 5}, {202, 6}})));
  idx.Flush();
  EXPECT_EQ(idx.TreeSize(TierRank({5, 0}, StorageTier::kHostPinned)), 3u);
  EXPECT_EQ(idx.TreeSize({5, 0}), 0u);
  EXPECT_EQ(idx.Counters().over_capacity, 1u);
}

// Blocks off device are matched under their tier's rank, and SplitTiers folds them into their
// rank's cumulative overlaps.
TEST(ShardedIndex, BlocksOffDeviceAreMatchedAsTheirTiersRank) {
  ShardedIndex idx;
  const auto seq = ComputeSequenceHashes(std::vector<LocalHash>{1, 2, 3});
  ASSERT_TRUE(idx.Submit(StoredBatch(5, 0, 1, std::nullopt, {{100, 1}}, StorageTier::kDevice)));
  ASSERT_TRUE(idx.Submit(StoredBatch(5, 0, 2, std::nullopt, {{100, 1}, {101, 2}}, StorageTier::kHostPinned)));
  ASSERT_TRUE(idx.Submit(StoredBatch(5, 0, 3, std::nullopt, {{100, 1}, {101, 2}, {102, 3}}, StorageTier::kDisk)));
  ASSERT_TRUE(idx.Submit(StoredBatch(6, 0, 1, std::nullopt, {{100, 1}}, StorageTier::kExternal)));
  idx.Flush();
  EXPECT_EQ(idx.Counters().non_device_ops, 3u);
  OverlapScores scores = idx.FindMatches(seq);
  EXPECT_EQ(scores.size(), 4u);
  std::unordered_map<WorkerKey, TieredOverlap, WorkerKeyHash> tiers;
  SplitTiers(scores, tiers);
  ASSERT_EQ(scores.size(), 1u);  // the device entries stay
  EXPECT_EQ(scores[0], (OverlapScore{{5, 0}, 1}));
  EXPECT_EQ(tiers.size(), 2u);
  EXPECT_EQ((tiers[{5, 0}]), (TieredOverlap{.device = 1, .host = 2, .any = 3}));
  EXPECT_EQ((tiers[{6, 0}]), (TieredOverlap{.device = 0, .host = 0, .any = 1}));
  EXPECT_EQ(idx.TreeSize(TierRank({5, 0}, StorageTier::kHostPinned)), 2u);
  // A cleared worker loses every tier.
  KvEventBatch cleared{.worker_id = 5, .sequence = {SequenceKind::kEventId, 4}};
  cleared.ops.push_back({StorageTier::kDevice, KvCleared{}});
  ASSERT_TRUE(idx.Submit(std::move(cleared)));
  idx.Flush();
  scores = idx.FindMatches(seq);
  ASSERT_EQ(scores.size(), 1u);
  EXPECT_EQ(scores[0].worker.worker_id, 6u);
}

// A block offloaded from GPU to CPU: removed on device, stored on host with its parent still on
// device. The host rank takes it, and matching still walks the prefix correctly.
TEST(ShardedIndex, ABlockMovedToHostKeepsItsPlaceAfterItsDeviceParent) {
  ShardedIndex idx;
  const auto seq = ComputeSequenceHashes(std::vector<LocalHash>{1, 2, 3});
  ASSERT_TRUE(idx.Submit(StoredBatch(5, 0, 1, std::nullopt, {{100, 1}, {101, 2}, {102, 3}})));
  ASSERT_TRUE(idx.Submit(StoredBatch(7, 0, 1, std::nullopt, {{100, 1}, {101, 2}, {102, 3}})));
  KvEventBatch move{.worker_id = 5, .sequence = {SequenceKind::kEventId, 2}};
  move.ops.push_back({StorageTier::kDevice, KvRemoved{{102}}});
  move.ops.push_back({StorageTier::kHostPinned, KvStored{.parent_hash = 101, .blocks = {{102, 3}}}});
  ASSERT_TRUE(idx.Submit(std::move(move)));
  idx.Flush();
  EXPECT_EQ(idx.Counters().parent_block_not_found, 0u);
  OverlapScores scores = idx.FindMatches(seq);
  std::unordered_map<WorkerKey, TieredOverlap, WorkerKeyHash> tiers;
  SplitTiers(scores, tiers);
  std::sort(scores.begin(), scores.end(),
            [](const OverlapScore& a, const OverlapScore& b) { return a.worker < b.worker; });
  ASSERT_EQ(scores.size(), 2u);
  EXPECT_EQ(scores[0], (OverlapScore{{5, 0}, 2}));
  EXPECT_EQ(scores[1], (OverlapScore{{7, 0}, 3}));  // the other worker's walk is not cut short
  // The host rank holds the third block without the first two: its own prefix is empty, so the
  // cumulative figures stop at the device's (the tiers are assumed to nest).
  EXPECT_TRUE(tiers.empty() || (tiers[{5, 0}] == TieredOverlap{2, 2, 2}));
}

// Parts of a peer's dump (router.dump) for every rank `from` can dump.
std::vector<RecoveryPart> PeerParts(const ShardedIndex& from) {
  std::vector<RecoveryPart> parts;
  for (WorkerKey rank : from.DumpableRanks()) {
    std::optional<RankDump> d = from.DumpRank(rank);
    if (!d) continue;
    RecoveryPart& p = parts.emplace_back(RecoveryPart{.worker = rank,
                                                      .numbering = d->numbering,
                                                      .kind = RecoveryPart::Kind::kDump,
                                                      .last_event_id = d->last_event_id,
                                                      .from_peer = true});
    for (DumpedChain& c : d->chains) {
      KvEventBatch& b = p.events.emplace_back(KvEventBatch{.worker_id = rank.worker_id, .dp_rank = rank.dp_rank});
      b.ops.push_back({c.tier, std::move(c.stored)});
    }
  }
  return parts;
}

// A replica warmed from a peer's dump: every rank, every tier, as the peer has it; a first-sight
// ask its events raised meanwhile is superseded, later events follow on, and the warmed ranks are
// not asked for when their workers register.
TEST(ShardedIndex, AReplicaWarmedFromAPeersDumpMatchesAsThePeerDoesAndAsksNoWorker) {
  ShardedIndex peer({.num_shards = 2});
  ASSERT_TRUE(peer.Submit(StoredBatch(5, 0, 1, std::nullopt, {{100, 1}, {101, 2}})));
  ASSERT_TRUE(peer.Submit(StoredBatch(5, 0, 2, 101, {{102, 3}}, StorageTier::kHostPinned)));
  ASSERT_TRUE(peer.Submit(StoredBatch(5, 1, 1, std::nullopt, {{100, 1}})));
  ASSERT_TRUE(peer.Submit(StoredBatch(6, 0, 1, std::nullopt, {{200, 1}, {201, 7}})));
  peer.Flush();
  EXPECT_EQ(peer.DumpableRanks(), (std::vector<WorkerKey>{{5, 0}, {5, 1}, {6, 0}}));

  std::mutex mu;
  std::vector<std::pair<WorkerKey, std::uint64_t>> asks;
  ShardedIndex idx(
      {.num_shards = 2,
       .on_recovery = [&](WorkerKey w, SequenceKind, std::optional<std::uint64_t>, std::uint64_t generation) {
         std::lock_guard g(mu);
         asks.emplace_back(w, generation);
       }});
  ASSERT_TRUE(idx.Submit(StoredBatch(6, 0, 2, 201, {{202, 8}})));  // held: first sight of (6, 0)
  idx.Flush();
  ASSERT_EQ(asks.size(), 1u);
  for (RecoveryPart& p : PeerParts(peer)) idx.Recovered(std::move(p));
  idx.Flush();
  EXPECT_EQ(idx.TakeSuperseded(), (std::vector<std::pair<WorkerKey, std::uint64_t>>{asks[0]}));
  for (WorkerKey w : {WorkerKey{5, 0}, WorkerKey{5, 1}, WorkerKey{6, 0}})
    idx.RequestDump(w, SequenceKind::kEventId, true);
  idx.Flush();
  EXPECT_EQ(asks.size(), 1u);  // registrations of warmed ranks ask nothing

  const auto seq = ComputeSequenceHashes(std::vector<LocalHash>{1, 2, 3});
  OverlapScores a = peer.FindMatches(seq), b = idx.FindMatches(seq);
  auto by_rank = [](const OverlapScore& x, const OverlapScore& y) { return x.worker < y.worker; };
  std::sort(a.begin(), a.end(), by_rank);
  std::sort(b.begin(), b.end(), by_rank);
  EXPECT_EQ(a, b);
  EXPECT_EQ(idx.TreeSize(TierRank({5, 0}, StorageTier::kHostPinned)), 1u);
  EXPECT_EQ(idx.TreeSize({6, 0}), 3u);                             // the peer's two, then the held event on top
  ASSERT_TRUE(idx.Submit(StoredBatch(5, 0, 3, 100, {{103, 9}})));  // follows the peer's id 2
  idx.Flush();
  EXPECT_EQ(idx.TreeSize({5, 0}), 3u);
  EXPECT_EQ(idx.Counters().gaps, 0u);
  EXPECT_EQ(idx.DumpRank({6, 0})->last_event_id, 2u);
  EXPECT_EQ(idx.Counters().batches_applied, 2u);  // the held one counted once, not again when released
}

TEST(ShardedIndex, FullQueueIsCountedAndFlagsTheWorker) {
  ShardedIndex idx({.num_shards = 1, .queue_capacity = 0});
  EXPECT_FALSE(idx.Submit(StoredBatch(9, 2, 1, std::nullopt, {{100, 1}})));
  EXPECT_EQ(idx.Counters().queue_full, 1u);
  auto stale = idx.TakeStaleWorkers();
  ASSERT_EQ(stale.size(), 1u);
  EXPECT_EQ(stale[0], (WorkerKey{9, 2}));
}

TEST(ShardedIndex, ClearedAndRemoveWorkerApplyInOrder) {
  ShardedIndex idx;
  ASSERT_TRUE(idx.Submit(StoredBatch(5, 0, 1, std::nullopt, {{100, 1}})));
  KvEventBatch cleared;
  cleared.worker_id = 5;
  cleared.sequence = {SequenceKind::kEventId, 2};
  cleared.ops.push_back({StorageTier::kDevice, KvCleared{}});
  ASSERT_TRUE(idx.Submit(std::move(cleared)));
  idx.Flush();
  EXPECT_TRUE(idx.FindMatches(ComputeSequenceHashes(std::vector<LocalHash>{1})).empty());
  ASSERT_TRUE(idx.Submit(StoredBatch(5, 0, 3, std::nullopt, {{100, 1}})));
  idx.Flush();
  EXPECT_EQ(idx.TreeSizes().size(), 1u);
  idx.RemoveWorker(5);
  idx.Flush();
  EXPECT_TRUE(idx.TreeSizes().empty());
  // Sequence tracking was forgotten with the worker: id 1 is a fresh start, not a restart.
  ASSERT_TRUE(idx.Submit(StoredBatch(5, 0, 1, std::nullopt, {{100, 1}})));
  idx.Flush();
  EXPECT_EQ(idx.Counters().restarts, 0u);
  EXPECT_EQ(idx.FindMatches(ComputeSequenceHashes(std::vector<LocalHash>{1})).size(), 1u);
}

// Writers store and remove whole 8-block chains in single events while readers query; one more
// worker holds the same chain throughout. With patience to wait out any event, a reader must
// only ever see 0 or 8 blocks for a worker, never a half-applied event; with none (every query
// that meets an event reads around it), it may see the event in progress partly, but each
// worker once and with 1..8 blocks, and the worker no event touches always with all 8.
void StoreAndRemoveWhileReading(std::chrono::nanoseconds patience, bool expect_whole) {
  constexpr int kWriters = 3;
  constexpr int kRounds = 3000;
  ShardedIndex idx({.num_shards = 2, .queue_capacity = 1 << 20, .read_patience = patience});
  std::vector<LocalHash> path;
  for (LocalHash h = 1; h <= 8; ++h) path.push_back(h);
  const auto seq_path = ComputeSequenceHashes(path);
  constexpr std::uint64_t kSteady = 99;
  {
    std::vector<StoredBlock> chain;
    for (std::size_t i = 0; i < path.size(); ++i) chain.push_back({1000 + i, path[i]});
    ASSERT_TRUE(idx.Submit(StoredBatch(kSteady, 0, 1, std::nullopt, chain)));
    idx.Flush();
  }
  std::atomic<bool> done{false};
  std::atomic<int> torn{0}, bad{0};
  std::atomic<long> queries{0};
  std::vector<std::thread> readers;
  for (int r = 0; r < 2; ++r) {
    readers.emplace_back([&] {
      while (!done.load()) {
        std::set<WorkerKey> seen;
        bool steady = false;
        for (const auto& s : idx.FindMatches(seq_path)) {
          if (s.worker.worker_id == kSteady) {
            steady = s.blocks == 8;
            continue;
          }
          if (s.blocks != 8) torn.fetch_add(1);
          if (s.blocks == 0 || s.blocks > 8 || s.worker.worker_id >= kWriters || !seen.insert(s.worker).second) {
            bad.fetch_add(1);
          }
        }
        if (!steady) bad.fetch_add(1);
        queries.fetch_add(1);
      }
    });
  }
  std::vector<std::thread> writers;
  for (int w = 0; w < kWriters; ++w) {
    writers.emplace_back([&, w] {
      std::uint64_t id = 1;
      for (int round = 0; round < kRounds; ++round) {
        std::vector<StoredBlock> chain;
        std::vector<BlockHash> ids;
        for (std::size_t i = 0; i < path.size(); ++i) {
          chain.push_back({1000 + i, path[i]});
          ids.push_back(1000 + i);
        }
        while (!idx.Submit(StoredBatch(w, 0, id, std::nullopt, chain))) std::this_thread::yield();
        ++id;
        while (!idx.Submit(RemovedBatch(w, id, ids))) std::this_thread::yield();
        ++id;
      }
    });
  }
  for (auto& t : writers) t.join();
  idx.Flush();
  done.store(true);
  for (auto& t : readers) t.join();
  EXPECT_EQ(bad.load(), 0);
  if (expect_whole) {
    EXPECT_EQ(torn.load(), 0);
    EXPECT_EQ(idx.Counters().tolerant_reads, 0u);
  }
  EXPECT_GT(queries.load(), 0);
  auto c = idx.Counters();
  EXPECT_EQ(c.blocks_stored, std::uint64_t{kWriters} * kRounds * 8 + 8);
  EXPECT_EQ(c.blocks_removed, std::uint64_t{kWriters} * kRounds * 8);
  EXPECT_EQ(c.duplicate + c.gaps, 0u);
  EXPECT_EQ(idx.Memory().nodes, 8u);  // the steady worker's chain
}

TEST(ShardedIndex, PatientReadersNeverSeeHalfAppliedEvents) {
  StoreAndRemoveWhileReading(std::chrono::hours(1), /*expect_whole=*/true);
}

TEST(ShardedIndex, ReadersThatDoNotWaitSeeEachWorkerOnceWithinItsChain) {
  StoreAndRemoveWhileReading(std::chrono::nanoseconds(0), /*expect_whole=*/false);
}

}  // namespace
}  // namespace kvrouter
