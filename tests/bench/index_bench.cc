// Index benchmarks (issue 2): apply throughput per shard thread, find_matches latency
// percentiles with 64 and 1,000 workers of 16,384 blocks each while ingestion runs, and bytes
// per indexed (block, worker) pair. Run: build/bin/index_bench (see docs/performance.md).
//
// Workload ("shared prefixes"): every cached sequence is 128 blocks = one of 8 system prompts
// (32 blocks, shared fleet-wide) + one of 256 documents per system prompt (64 blocks, shared
// by the workers that saw it) + a 32-block tail unique to the worker. A worker holds 128
// and more sequences until it holds 16,384 distinct blocks. Engine block ids are sequence hashes, as Dynamo workers publish.
#include <benchmark/benchmark.h>
#include <malloc.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <random>
#include <thread>
#include <unordered_set>
#include <map>

#include "events/block_hash.h"
#include "router/index/approx_index.h"
#include "router/index/block_index.h"
#include "router/index/large_array.h"
#include "router/index/sharded_index.h"

#include <fmt/format.h>

#include "events/event_codec.h"
#include "events/registration_codec.h"
#include "events/router_endpoints_codec.h"
#include "events/msgpack_reader.h"
#include "router/service/kv_router_service.h"
#include "router/scheduling/selector.h"
#include "transport/memory_bus.h"

namespace kvrouter {
namespace {

constexpr int kSystemPrompts = 8;
constexpr int kDocsPerSystem = 256;
constexpr int kSystemBlocks = 32;
constexpr int kDocBlocks = 64;
constexpr int kTailBlocks = 32;
constexpr int kSeqBlocks = kSystemBlocks + kDocBlocks + kTailBlocks;

// Local hashes of one sequence; tail_owner makes the tail unique.
std::vector<LocalHash> SequenceLocals(int system, int doc, std::uint64_t tail_owner) {
  std::vector<LocalHash> h;
  h.reserve(kSeqBlocks);
  for (int i = 0; i < kSystemBlocks; ++i) h.push_back(Mix64(0x5000 + system * 1000 + i));
  for (int i = 0; i < kDocBlocks; ++i) h.push_back(Mix64((std::uint64_t(system * kDocsPerSystem + doc) << 20) + i + 1));
  for (int i = 0; i < kTailBlocks; ++i) h.push_back(Mix64((tail_owner << 24) ^ (0xabcdef00 + i)));
  return h;
}

std::vector<StoredBlock> AsChain(const std::vector<LocalHash>& locals) {
  const auto seq = ComputeSequenceHashes(locals);
  std::vector<StoredBlock> out;
  out.reserve(locals.size());
  for (std::size_t i = 0; i < locals.size(); ++i) out.push_back({seq[i], locals[i]});
  return out;
}

constexpr std::size_t kBlocksPerWorker = 16384;

// Stores sequences on `worker` until it holds exactly kBlocksPerWorker distinct blocks.
template <typename Apply>
void FillWorker(std::uint64_t worker, std::mt19937_64& rng, Apply&& apply) {
  std::unordered_set<BlockHash> held;
  for (std::uint64_t s = 0; held.size() < kBlocksPerWorker; ++s) {
    const int system = static_cast<int>(rng() % kSystemPrompts);
    const int doc = static_cast<int>(rng() % kDocsPerSystem);
    auto chain = AsChain(SequenceLocals(system, doc, worker * 4096 + s));
    std::size_t keep = 0;
    while (keep < chain.size() && held.size() < kBlocksPerWorker) held.insert(chain[keep++].block_hash);
    chain.resize(keep);
    apply(worker, std::move(chain));
  }
}

// A request: a system prompt and document some workers hold, plus a new 104-block tail.
std::vector<LocalHash> RequestLocals(std::mt19937_64& rng) {
  auto h = SequenceLocals(static_cast<int>(rng() % kSystemPrompts), static_cast<int>(rng() % kDocsPerSystem),
                          0xfffff0 + rng() % 8);
  while (h.size() < 200) h.push_back(rng());
  return h;
}

// ---- apply throughput -------------------------------------------------------------------------

// The work of one shard thread, without the queue: stored chains of 16 blocks, then their
// removal (so the index stays at a steady size). items_per_second = blocks applied.
void BM_ApplyChains16(benchmark::State& state) {
  BlockIndex idx;
  std::mt19937_64 rng(7);
  constexpr int kChains = 4096;
  std::vector<std::vector<StoredBlock>> chains;
  std::vector<std::vector<BlockHash>> ids;
  for (int c = 0; c < kChains; ++c) {
    std::vector<LocalHash> locals;
    // Half of each chain is a prefix shared with other chains.
    for (int i = 0; i < 8; ++i) locals.push_back(Mix64(c % 64 * 100 + i));
    for (int i = 0; i < 8; ++i) locals.push_back(rng());
    chains.push_back(AsChain(locals));
    std::vector<BlockHash> r;
    for (auto& b : chains.back()) r.push_back(b.block_hash);
    ids.push_back(std::move(r));
  }
  std::int64_t blocks = 0;
  for (auto _ : state) {
    for (int c = 0; c < kChains; ++c) {
      const WorkerKey w{static_cast<std::uint64_t>(c % 16), 0};
      benchmark::DoNotOptimize(idx.ApplyStored(w, std::nullopt, chains[c]));
    }
    for (int c = 0; c < kChains; ++c) {
      const WorkerKey w{static_cast<std::uint64_t>(c % 16), 0};
      benchmark::DoNotOptimize(idx.ApplyRemoved(w, ids[c]));
    }
    blocks += 2 * kChains * 16;
  }
  state.SetItemsProcessed(blocks);
}
BENCHMARK(BM_ApplyChains16)->Unit(benchmark::kMillisecond);

// route_bench's ingest workload (BM_IngestVsBareSubscriber): 300,000 events of 4 new blocks
// each, event e from worker e % 64, each a chain of its own; with engine_ids, block ids that are
// not the sequence hashes (vLLM's).
constexpr int kIngestWorkers = 64, kIngestEvents = 300000, kIngestBlocks = 4;
std::vector<std::vector<StoredBlock>> IngestEvents(bool engine_ids) {
  std::vector<std::vector<StoredBlock>> events(kIngestEvents);
  for (int e = 0; e < kIngestEvents; ++e) {
    std::vector<LocalHash> locals;
    for (int b = 0; b < kIngestBlocks; ++b) locals.push_back(Mix64((std::uint64_t(e) << 3) + b + 1));
    events[e] = AsChain(locals);
    if (engine_ids) {
      for (int b = 0; b < kIngestBlocks; ++b)
        events[e][b].block_hash = Mix64((std::uint64_t(e) << 3) + b + (1ull << 40));
    }
  }
  return events;
}

// The apply work of that workload, on one thread and without the queue: the events stored into
// an index that readers may read (as a shard's is), then, untimed, every worker cleared as that
// benchmark does between runs (clear_ms: the 64 clears' time), and the free nodes put in order
// as an idle shard thread does. items_per_second = events. Arg 0/1: without/with the prefetch of
// the next event's slots. Second arg 1: engine block ids, each event continuing its worker's
// chain (a vLLM engine's events, as route_bench's /1 sends them).
void BM_ApplyIngestEvents(benchmark::State& state) {
  const bool engine_hashes = state.range(1) != 0;
  const std::vector<std::vector<StoredBlock>> events = IngestEvents(engine_hashes);
  std::vector<std::optional<BlockHash>> parents(kIngestEvents);
  for (int e = kIngestWorkers; engine_hashes && e < kIngestEvents; ++e)
    parents[e] = events[e - kIngestWorkers].back().block_hash;
  BlockIndex idx;
  idx.SetConcurrentReaders(true);
  idx.ShrinkTablesLater(true);  // as a shard's index
  const bool prefetch = state.range(0) != 0;
  double clear_s = 0;
  for (auto _ : state) {
    for (int e = 0; e < kIngestEvents; ++e) {
      if (prefetch && e + 1 < kIngestEvents) {
        idx.PrefetchStored({std::uint64_t((e + 1) % kIngestWorkers), 0}, parents[e + 1], events[e + 1]);
      }
      benchmark::DoNotOptimize(idx.ApplyStored({std::uint64_t(e % kIngestWorkers), 0}, parents[e], events[e]));
    }
    state.PauseTiming();
    if (idx.Memory().holdings != std::size_t{kIngestEvents} * kIngestBlocks) state.SkipWithError("blocks were lost");
    const auto t0 = std::chrono::steady_clock::now();
    for (int w = 0; w < kIngestWorkers; ++w) idx.ClearWorker(w);
    clear_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    idx.FreeRetired();
    idx.TidyFreeNodes();  // as a shard thread does when idle
    state.ResumeTiming();
  }
  state.SetItemsProcessed(state.iterations() * kIngestEvents);
  state.counters["clear_ms"] = clear_s / static_cast<double>(state.iterations()) * 1e3;
}
BENCHMARK(BM_ApplyIngestEvents)->ArgsProduct({{0, 1}, {0, 1}})->Unit(benchmark::kMillisecond)->Iterations(10);

// The removals that follow BM_ApplyIngestEvents' stores, as an engine evicts: each event's
// blocks in the order they were stored, each event's chain tail first (vLLM frees a request's
// blocks in reverse, so its tail goes first). items_per_second = events removed; store_per_remove
// = the stores' time (in the same iteration, untimed) over the removals'. Args as that
// benchmark's second: engine ids that are the sequence hashes, or not.
void BM_RemoveIngestEvents(benchmark::State& state) {
  const std::vector<std::vector<StoredBlock>> events = IngestEvents(state.range(0) != 0);
  std::vector<std::vector<BlockHash>> removals(kIngestEvents);
  for (int e = 0; e < kIngestEvents; ++e) {
    for (int b = kIngestBlocks; b-- > 0;) removals[e].push_back(events[e][b].block_hash);
  }
  BlockIndex idx;
  idx.SetConcurrentReaders(true);
  idx.ShrinkTablesLater(true);  // as a shard's index
  double store_s = 0, remove_s = 0;
  for (auto _ : state) {
    state.PauseTiming();
    const auto t0 = std::chrono::steady_clock::now();
    for (int e = 0; e < kIngestEvents; ++e) {
      if (e + 1 < kIngestEvents)
        idx.PrefetchStored({std::uint64_t((e + 1) % kIngestWorkers), 0}, std::nullopt, events[e + 1]);
      benchmark::DoNotOptimize(idx.ApplyStored({std::uint64_t(e % kIngestWorkers), 0}, std::nullopt, events[e]));
    }
    store_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    state.ResumeTiming();
    const auto t1 = std::chrono::steady_clock::now();
    for (int e = 0; e < kIngestEvents; ++e) {
      if (e + 1 < kIngestEvents) idx.PrefetchRemoved({std::uint64_t((e + 1) % kIngestWorkers), 0}, removals[e + 1]);
      benchmark::DoNotOptimize(idx.ApplyRemoved({std::uint64_t(e % kIngestWorkers), 0}, removals[e]));
    }
    remove_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
    state.PauseTiming();
    if (idx.Memory().holdings != 0) state.SkipWithError("blocks were left");
    idx.FreeRetired();
    idx.TidyFreeNodes();  // as a shard thread does when idle
    state.ResumeTiming();
  }
  state.SetItemsProcessed(state.iterations() * kIngestEvents);
  state.counters["store_per_remove"] = store_s / remove_s;
}
BENCHMARK(BM_RemoveIngestEvents)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->Iterations(10);

// router.dump's work on the answering replica: one rank of 10,000 blocks (100 chains of 100)
// read back as stored chains (BlockIndex::DumpRank), against storing them (the asker's work) in
// the same run. items_per_second = blocks dumped; dump_per_store = the dump's time over the
// stores'. Arg 0/1: engine ids that are the blocks' sequence hashes (Dynamo's, kvmocker's) or
// not (vLLM's).
void BM_DumpRank(benchmark::State& state) {
  constexpr int kChains = 100, kLength = 100;
  const bool engine_hashes = state.range(0) != 0;
  std::vector<std::vector<StoredBlock>> chains(kChains);
  for (int c = 0; c < kChains; ++c) {
    std::vector<LocalHash> locals;
    for (int b = 0; b < kLength; ++b) locals.push_back(Mix64((std::uint64_t(c) << 8) + b + 1));
    chains[c] = AsChain(locals);
    if (engine_hashes) {
      for (int b = 0; b < kLength; ++b) chains[c][b].block_hash = Mix64((std::uint64_t(c) << 8) + b + (1ull << 40));
    }
  }
  const WorkerKey rank{1, 0};
  double store_s = 0, dump_s = 0;
  std::vector<DumpedChain> out;
  for (auto _ : state) {
    BlockIndex idx;
    const auto t0 = std::chrono::steady_clock::now();
    for (const auto& c : chains) benchmark::DoNotOptimize(idx.ApplyStored(rank, std::nullopt, c));
    const auto t1 = std::chrono::steady_clock::now();
    out.clear();
    idx.DumpRank(rank, out);
    const auto t2 = std::chrono::steady_clock::now();
    store_s += std::chrono::duration<double>(t1 - t0).count();
    dump_s += std::chrono::duration<double>(t2 - t1).count();
    if (out.size() != kChains) state.SkipWithError("the dump is not the stored chains");
  }
  state.SetItemsProcessed(state.iterations() * kChains * kLength);
  state.counters["dump_us"] = dump_s / static_cast<double>(state.iterations()) * 1e6;
  state.counters["dump_per_store"] = dump_s / store_s;
}
BENCHMARK(BM_DumpRank)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond);

// End to end through one shard: a producer thread Submit()s Dynamo-style batches (16-block
// stored chains and their removals) and the shard thread dequeues in bulk and applies them.
void BM_ShardIngest(benchmark::State& state) {
  std::mt19937_64 rng(9);
  constexpr int kChains = 20000;
  std::vector<std::vector<StoredBlock>> chains;
  for (int c = 0; c < kChains; ++c) {
    std::vector<LocalHash> locals;
    for (int i = 0; i < 8; ++i) locals.push_back(Mix64(c % 64 * 100 + i));
    for (int i = 0; i < 8; ++i) locals.push_back(rng());
    chains.push_back(AsChain(locals));
  }
  std::int64_t blocks = 0;
  for (auto _ : state) {
    state.PauseTiming();
    std::vector<KvEventBatch> batches;
    batches.reserve(2 * kChains);
    std::vector<std::uint64_t> next_id(16, 1);
    for (int c = 0; c < kChains; ++c) {
      const std::uint64_t w = c % 16;
      KvEventBatch b{.worker_id = w, .sequence = {SequenceKind::kEventId, next_id[w]++}};
      b.ops.push_back({StorageTier::kDevice, KvStored{std::nullopt, chains[c]}});
      batches.push_back(std::move(b));
    }
    for (int c = 0; c < kChains; ++c) {
      const std::uint64_t w = c % 16;
      KvEventBatch b{.worker_id = w, .sequence = {SequenceKind::kEventId, next_id[w]++}};
      KvRemoved r;
      for (auto& blk : chains[c]) r.block_hashes.push_back(blk.block_hash);
      b.ops.push_back({StorageTier::kDevice, std::move(r)});
      batches.push_back(std::move(b));
    }
    ShardedIndex idx({.num_shards = 1, .queue_capacity = 1 << 20});
    state.ResumeTiming();
    bool refused = false;
    for (auto& b : batches) refused |= !idx.Submit(std::move(b));
    idx.Flush();
    state.PauseTiming();
    blocks += 2 * kChains * 16;
    const IndexCounters c = idx.Counters();
    // Chains of one worker share prefixes (same engine ids): a second removal is not_found.
    if (refused || c.blocks_removed + c.block_not_found != std::uint64_t(kChains) * 16) {
      state.SkipWithError("events were lost");
      break;
    }
    state.ResumeTiming();
  }
  state.SetItemsProcessed(blocks);
}
BENCHMARK(BM_ShardIngest)->Unit(benchmark::kMillisecond)->UseRealTime();

// ---- find_matches latency ---------------------------------------------------------------------

struct Fleet {
  std::unique_ptr<ShardedIndex> index;
  int workers = 0;
};

Fleet& FleetOf(int workers) {
  static std::map<int, Fleet> fleets;
  Fleet& f = fleets[workers];
  if (!f.index) {
    f.workers = workers;
    f.index = std::make_unique<ShardedIndex>(ShardedIndexOptions{.num_shards = 2, .queue_capacity = 1 << 20});
    std::mt19937_64 rng(1234);
    for (int w = 0; w < workers; ++w) {
      FillWorker(w, rng, [&](std::uint64_t worker, std::vector<StoredBlock> chain) {
        KvEventBatch b{.worker_id = worker};
        b.ops.push_back({StorageTier::kDevice, KvStored{std::nullopt, std::move(chain)}});
        while (!f.index->Submit(std::move(b))) std::this_thread::yield();
      });
    }
    f.index->Flush();
  }
  return f;
}

// Percentiles of per-call latency over the run, as counters (microseconds).
void ReportPercentiles(benchmark::State& state, std::vector<double>& us) {
  if (us.empty()) return;
  std::sort(us.begin(), us.end());
  auto at = [&](double q) { return us[std::min(us.size() - 1, static_cast<std::size_t>(q * us.size()))]; };
  state.counters["p50_us"] = at(0.50);
  state.counters["p99_us"] = at(0.99);
  state.counters["max_us"] = us.back();
}

// Arg 0: workers; arg 1: blocks per second that a background thread stores and removes
// meanwhile (0 = none, -1 = as fast as the shard queues take them); arg 2: queries per second
// (0 = back to back: the query thread never sleeps, so on 2 cores every wake-up of the
// ingest threads can preempt it; a router's route thread sleeps between requests, as a
// paced query thread does).
void BM_FindMatches200(benchmark::State& state) {
  Fleet& fleet = FleetOf(static_cast<int>(state.range(0)));
  const std::int64_t rate = state.range(1);
  const std::int64_t query_rate = state.range(2);
  const bool ingest = rate != 0;
  std::mt19937_64 rng(99);
  std::vector<std::vector<LocalHash>> requests;
  for (int i = 0; i < 512; ++i) requests.push_back(ComputeSequenceHashes(RequestLocals(rng)));

  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> ingested{0};
  std::thread flood;
  if (ingest) {
    // Extra workers (ids above the fleet) store and drop 16-block chains as fast as the
    // shard queues take them.
    flood = std::thread([&] {
      ShardedIndex::MarkIngestThread();  // as the router's event thread is
      std::mt19937_64 r(5);
      std::uint64_t id = 1;
      const auto start = std::chrono::steady_clock::now();
      while (!stop.load(std::memory_order_relaxed)) {
        if (rate > 0) {  // pace: 32 blocks per loop
          const auto due = start + std::chrono::nanoseconds(static_cast<std::int64_t>(ingested.load() * 1e9 / rate));
          std::this_thread::sleep_until(due);
        }
        const std::uint64_t w = 1'000'000 + r() % 32;
        std::vector<LocalHash> locals;
        for (int i = 0; i < 16; ++i) locals.push_back(r());
        auto chain = AsChain(locals);
        KvEventBatch s{.worker_id = w};
        KvRemoved rm;
        for (auto& b : chain) rm.block_hashes.push_back(b.block_hash);
        s.ops.push_back({StorageTier::kDevice, KvStored{std::nullopt, std::move(chain)}});
        KvEventBatch d{.worker_id = w};
        d.ops.push_back({StorageTier::kDevice, std::move(rm)});
        if (fleet.index->Submit(std::move(s))) ingested.fetch_add(16, std::memory_order_relaxed);
        if (fleet.index->Submit(std::move(d))) ingested.fetch_add(16, std::memory_order_relaxed);
        ++id;
      }
    });
  }
  std::vector<double> us;
  std::size_t i = 0;
  std::size_t matched = 0;
  const std::uint64_t tolerant0 = fleet.index->Counters().tolerant_reads;
  OverlapScores scores;
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) {
    if (query_rate > 0)
      std::this_thread::sleep_until(t0 + std::chrono::nanoseconds(static_cast<std::int64_t>(i * 1e9 / query_rate)));
    const auto a = std::chrono::steady_clock::now();
    fleet.index->FindMatches(requests[i++ % requests.size()], scores);  // the route's reused buffer
    const auto b = std::chrono::steady_clock::now();
    matched += scores.size();
    benchmark::DoNotOptimize(scores);
    us.push_back(std::chrono::duration<double, std::micro>(b - a).count());
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  stop.store(true);
  if (flood.joinable()) flood.join();
  fleet.index->Flush();  // leave nothing being applied behind us
  ReportPercentiles(state, us);
  state.counters["workers_matched"] = static_cast<double>(matched) / std::max<std::size_t>(1, us.size());
  if (ingest) state.counters["ingest_blocks_per_s"] = ingested.load() / secs;
  // Shard reads that went around an event its thread had not finished (router/index/read_gate.h).
  state.counters["tolerant_reads"] = static_cast<double>(fleet.index->Counters().tolerant_reads - tolerant0);
}
BENCHMARK(BM_FindMatches200)
    ->Args({64, 0, 0})
    ->Args({64, 1'000'000, 0})
    ->Args({1000, 0, 0})
    ->Args({1000, 1'000'000, 0})
    ->Args({1000, 1'000'000, 10'000})
    ->Args({1000, -1, 0})
    ->Unit(benchmark::kMicrosecond)
    ->Iterations(20000);

// A query that matches every worker, as in Dynamo's indexer benchmark (7,000 workers all hold
// the trace's first block): 7,000 workers hold one root block; in 64 groups of about 109 they
// hold 8 more blocks each. A request down one group's path reports 6,891 workers at 1 block and
// 109 at 9. Arg: 0 an exact read (no event in progress), 1 a tolerant one (ReadGate's read
// around an event). Counter: ns per reported worker.
void BM_FindMatchesEveryWorker(benchmark::State& state) {
  constexpr std::uint64_t kWorkers = 7000, kGroups = 64, kDeep = 8;
  BlockIndex index;
  index.SetConcurrentReaders(true);
  const LocalHash root = Mix64(0x77);
  for (std::uint64_t w = 0; w < kWorkers; ++w) {
    std::vector<LocalHash> locals{root};
    for (std::uint64_t d = 0; d < kDeep; ++d) locals.push_back(Mix64((w % kGroups) * 100 + d + 1));
    index.ApplyStored({w, 0}, std::nullopt, AsChain(locals));
  }
  index.FreeRetired();
  std::vector<LocalHash> request{root};
  for (std::uint64_t d = 0; d < kDeep; ++d) request.push_back(Mix64(5 * 100 + d + 1));
  for (int i = 0; i < 100; ++i) request.push_back(Mix64(0xdead0000 + i));
  const auto hashes = ComputeSequenceHashes(request);
  const bool tolerant = state.range(0) != 0;
  OverlapScores scores;
  for (auto _ : state) {
    scores.clear();
    index.FindMatches(hashes, scores, tolerant);
    benchmark::DoNotOptimize(scores.data());
  }
  if (scores.size() != kWorkers) state.SkipWithError("every worker must be reported once");
  state.counters["ns_per_worker"] = benchmark::Counter(static_cast<double>(state.iterations()) * kWorkers,
                                                       benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_FindMatchesEveryWorker)->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);

// ---- memory -----------------------------------------------------------------------------------

// What malloc has handed out plus the index's own huge-page mappings (LargeArray).
std::size_t AllocatedBytes() {
  const auto mi = mallinfo2();
  return mi.uordblks + mi.hblkhd + large_array_mapped_bytes.load();
}

// Bytes per (block, worker) pair: the index's own accounting and the growth of AllocatedBytes.
void BM_MemoryPerPair(benchmark::State& state) {
  const int workers = static_cast<int>(state.range(0));
  for (auto _ : state) {
    malloc_trim(0);
    const std::size_t heap0 = AllocatedBytes();
    auto idx = std::make_unique<BlockIndex>();
    std::mt19937_64 rng(1234);
    for (int w = 0; w < workers; ++w) {
      FillWorker(w, rng, [&](std::uint64_t worker, const std::vector<StoredBlock>& chain) {
        benchmark::DoNotOptimize(idx->ApplyStored({worker, 0}, std::nullopt, chain));
      });
    }
    const std::size_t heap1 = AllocatedBytes();
    const IndexMemory m = idx->Memory();
    state.counters["pairs"] = static_cast<double>(m.holdings);
    state.counters["nodes"] = static_cast<double>(m.nodes);
    state.counters["bytes_per_pair"] = static_cast<double>(m.bytes) / m.holdings;
    state.counters["heap_bytes_per_pair"] = static_cast<double>(heap1 - heap0) / m.holdings;
  }
}
BENCHMARK(BM_MemoryPerPair)->Arg(64)->Arg(1000)->Iterations(1)->Unit(benchmark::kSecond);

// Approximate mode: 64 workers' predictions of the same workload (64 x 16,384 = the default
// --router-max-tree-size), recorded as routed requests would be. Bytes per predicted (block,
// worker): the predictions' own entries and table, and with the index they feed.
void BM_ApproxMemoryPerBlock(benchmark::State& state) {
  for (auto _ : state) {
    malloc_trim(0);
    const std::size_t heap0 = AllocatedBytes();
    auto approx = std::make_unique<ApproxIndex>(std::chrono::seconds(120), std::uint64_t{1} << 20, 0.8);
    std::mt19937_64 rng(1234);
    const SteadyTime t0{};
    for (int w = 0; w < 64; ++w) {
      FillWorker(w, rng, [&](std::uint64_t worker, const std::vector<StoredBlock>& chain) {
        std::vector<LocalHash> local;
        std::vector<SequenceHash> seq;
        for (const StoredBlock& b : chain) {
          local.push_back(b.tokens_hash);
          seq.push_back(b.block_hash);
        }
        approx->Record({worker, 0}, local, seq, t0);
      });
    }
    const std::size_t heap1 = AllocatedBytes();
    const double n = static_cast<double>(approx->size());
    state.counters["predicted"] = n;
    state.counters["own_bytes_per_block"] = static_cast<double>(approx->OwnBytes()) / n;
    state.counters["bytes_per_block"] = static_cast<double>(approx->OwnBytes() + approx->IndexBytes().bytes) / n;
    state.counters["heap_bytes_per_block"] = static_cast<double>(heap1 - heap0) / n;
  }
}
BENCHMARK(BM_ApproxMemoryPerBlock)->Iterations(1)->Unit(benchmark::kSecond);

// ---- the cost alone: Selector::Pick among 1,000 candidates --------------------------------------

// Arg 0: Dynamo's formula; 1: the predicted cost. Candidates with varied overlap and load.
void BM_PickAmong1000(benchmark::State& state) {
  std::mt19937_64 rng(5);
  std::vector<Candidate> cands(1000);
  for (std::size_t i = 0; i < cands.size(); ++i) {
    Candidate& c = cands[i];
    c.worker = {i + 1, 0};
    c.overlap_blocks = static_cast<std::uint32_t>(rng() % 64);
    c.active_blocks = rng() % 8000;
    c.active_prefill_tokens = rng() % 20000;
    c.active_prefill_squares = c.active_prefill_tokens * c.active_prefill_tokens;
    c.active_requests = static_cast<std::uint32_t>(rng() % 30);
    c.recent_requests = static_cast<double>(rng() % 50);
    c.total_kv_blocks = 16384;
  }
  const CostParams p{.model = state.range(0) == 0 ? CostModel::kKvBlocks : CostModel::kPredicted};
  Selector sel;
  for (auto _ : state) benchmark::DoNotOptimize(sel.Pick(RouterMode::kKv, {4096, 64}, cands, p, rng));
}
BENCHMARK(BM_PickAmong1000)->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond);

// ---- one routing decision at 1,000 workers ----------------------------------------------------

// The service's whole decision (decode, hash, overlaps from the index, candidates with their
// load, the cost of each, the pick) on an in-memory bus, for 1,000 registered workers that each
// cache a 2,048-token prompt and run 4 requests. Arg 0: Dynamo's formula; 1: the predicted cost.
// Arg 2: the predicted cost on a disaggregated fleet (workers 1..500 prefill, the rest decode;
// protocol.md section 13), against arg 1 in the same run.
// A `route` without request_id books nothing, so every iteration sees the same fleet.
void BM_Decision1000Workers(benchmark::State& state) {
  constexpr std::uint64_t kFleet = 1000;
  InMemoryBus bus;
  std::vector<std::string> args = {"kvbench", "--router-mode", "kv"};
  if (state.range(0) == 0) args.insert(args.end(), {"--router-prefill-load-scale", "1"});
  std::vector<const char*> argv;
  for (auto& a : args) argv.push_back(a.c_str());
  auto cfg = ParseRouterConfig(static_cast<int>(argv.size()), argv.data(), [](const char*) { return nullptr; });
  SteadyTime now{};
  KvRouterService svc(
      cfg->config, bus, [&] { return now; }, 1);
  if (!svc.Start().ok()) return state.SkipWithError("service did not start");
  auto prompt = [](std::uint64_t w) {
    std::vector<std::uint32_t> t(2048);
    for (std::uint32_t k = 0; k < t.size(); ++k) t[k] = static_cast<std::uint32_t>(k < 1024 ? k : w * 10000 + k);
    return t;
  };
  for (std::uint64_t w = 1; w <= kFleet; ++w) {
    WorkerRegistration reg{.worker_id = w, .block_size = 64, .total_kv_blocks = 16384};
    if (state.range(0) == 2) reg.role = w <= kFleet / 2 ? WorkerRole::kPrefill : WorkerRole::kDecode;
    (void)bus.Publish(svc.subjects().instances, AsBytes(EncodeWorkerRegistration(reg)));
    (void)bus.Publish(svc.subjects().kv_events,
                      AsBytes(EncodeDynamoEnvelope(StoredPromptBatch(w, 1, prompt(w), 64), {})));
    for (int r = 0; r < 4; ++r) {
      if (state.range(0) == 2 && w <= kFleet / 2) break;  // prefill workers take no whole requests
      RouteRequest busy{.request_id = fmt::format("busy-{}-{}", w, r),
                        .token_ids = prompt(w + kFleet * (r + 1)),
                        .has_token_ids = true,
                        .worker_id = w};
      busy.isl = static_cast<std::uint32_t>(busy.token_ids.size());
      (void)bus.Request(svc.subjects().route, AsBytes(EncodeRouteRequest(busy)));
    }
  }
  svc.index().Flush();
  RouteRequest req{.token_ids = prompt(7), .has_token_ids = true};
  req.isl = static_cast<std::uint32_t>(req.token_ids.size());
  const auto payload = EncodeRouteRequest(req);
  for (auto _ : state) {
    auto reply = bus.Request(svc.subjects().route, AsBytes(payload));
    benchmark::DoNotOptimize(reply);
  }
}
BENCHMARK(BM_Decision1000Workers)->Arg(0)->Arg(1)->Arg(2)->Unit(benchmark::kMicrosecond);

// A best_worker decision as the fleet grows (decisions sublinear in the fleet): the service in
// process, arg workers of one rank each, every tenth holding 4 blocks (block size 16), none
// loaded. Second arg 1: the first 4 blocks of the 512-token prompt asked for, so a tenth of the
// fleet matches it; 0: 4 blocks of a prompt of its own, so none does; 2: every worker holds the
// prompt's first 4 blocks (a system prompt the whole fleet shares). items_per_second =
// decisions.
void BM_BestWorkerAtScale(benchmark::State& state) {
  const auto fleet = static_cast<std::uint64_t>(state.range(0));
  const bool matching = state.range(1) != 0, everyone = state.range(1) == 2;
  InMemoryBus bus;
  const char* argv[] = {"kvrouter", "--router-mode",        "kv",    "--block-size", "16", "--router-max-worker-ranks",
                        "262144",   "--router-max-workers", "262144"};
  auto cfg = ParseRouterConfig(9, argv, [](const char*) { return nullptr; });
  if (!cfg.ok()) return state.SkipWithError(cfg.status().ToString().c_str());
  SteadyTime now{};
  KvRouterService svc(
      cfg->config, bus, [&] { return now; }, 1);
  if (!svc.Start().ok()) return state.SkipWithError("service did not start");
  std::vector<std::uint32_t> prompt(512);
  for (std::uint32_t k = 0; k < prompt.size(); ++k) prompt[k] = k + 1;
  std::vector<std::uint32_t> held(prompt.begin(), prompt.begin() + 4 * 16);
  for (std::uint64_t w = 1; w <= fleet; ++w) {
    WorkerRegistration reg{.worker_id = w, .block_size = 16, .total_kv_blocks = 16384, .lease_ms = 3600000};
    (void)bus.Publish(svc.subjects().instances, AsBytes(EncodeWorkerRegistration(reg)));
    if (w % 10 == 0 || everyone) {
      if (!matching) held[0] = static_cast<std::uint32_t>(1'000'000 + w);
      (void)bus.Publish(svc.subjects().kv_events, AsBytes(EncodeDynamoEnvelope(StoredPromptBatch(w, 1, held, 16), {})));
    }
  }
  svc.index().Flush();
  RouteRequest req{.token_ids = prompt, .has_token_ids = true, .isl = 512};
  const auto payload = EncodeRouteRequest(req);
  for (auto _ : state) {
    auto reply = bus.Request(svc.subjects().best_worker, AsBytes(payload));
    benchmark::DoNotOptimize(reply);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_BestWorkerAtScale)->ArgsProduct({{1000, 10000, 100000}, {1, 0, 2}})->Unit(benchmark::kMicrosecond);

// The machine itself, for reading every latency above: one thread does nothing but read the
// clock for a second and counts the gaps of more than 10 us between two readings, the time it
// lost in them, and its context switches (when the count of switches is far below the count of
// gaps, the CPU was taken away below the guest's scheduler: the hypervisor, or interrupts).
// Arg 1: the other CPUs busy meanwhile (a spinning thread each), as during ingestion.
// On this project's VM (2026-12-02): about 1,000-1,500 gaps per second at ~1 ms intervals,
// 25-125 us each, 5-8 % of the thread's time, with no context switch: a query of T us meets one
// with a probability of about T/1000, so a p99 below the stalls' length (find_matches under
// 20 us) needs queries well under 10 us.
void BM_MachineStalls(benchmark::State& state) {
  using Clock = std::chrono::steady_clock;
  std::atomic<bool> stop{false};
  std::vector<std::thread> busy;
  if (state.range(0) == 1) {
    for (unsigned i = 1; i < std::max(2u, std::thread::hardware_concurrency()); ++i) {
      busy.emplace_back([&] {
        while (!stop.load(std::memory_order_relaxed)) CpuRelax();
      });
    }
  }
  std::vector<double> gaps;
  double seconds = 0;
  long switches = 0;
  for (auto _ : state) {
    rusage r0{}, r1{};
    getrusage(RUSAGE_THREAD, &r0);
    const auto start = Clock::now();
    auto prev = start;
    for (auto now = start; now - start < std::chrono::seconds(1); now = Clock::now()) {
      const double us = std::chrono::duration<double, std::micro>(now - prev).count();
      if (us > 10) gaps.push_back(us);
      prev = now;
    }
    getrusage(RUSAGE_THREAD, &r1);
    seconds += std::chrono::duration<double>(Clock::now() - start).count();
    switches += (r1.ru_nvcsw - r0.ru_nvcsw) + (r1.ru_nivcsw - r0.ru_nivcsw);
  }
  stop.store(true);
  for (auto& t : busy) t.join();
  double lost = 0;
  for (double g : gaps) lost += g;
  state.counters["stalls_per_s"] = static_cast<double>(gaps.size()) / seconds;
  state.counters["lost_pct"] = lost / (seconds * 1e4);
  state.counters["switches_per_s"] = static_cast<double>(switches) / seconds;
  ReportPercentiles(state, gaps);  // of the stalls: p50_us, p99_us, max_us
}
BENCHMARK(BM_MachineStalls)->Arg(0)->Arg(1)->Iterations(2)->Unit(benchmark::kSecond)->UseRealTime();

}  // namespace
}  // namespace kvrouter

BENCHMARK_MAIN();
