// ShardedIndex: the router's KV block index, split into shards that each own a BlockIndex and
// one thread (terms: docs/design.md "Glossary"). NATS delivery threads Submit() decoded batches:
// a bounded lock-free queue per shard (moodycamel) carries them to the shard thread, which
// dequeues in bulk and applies them under the shard's write lock, letting go of it after about
// 64 blocks. With apply_on_submit, a submitting thread applies a batch itself instead when its
// shard is idle (nothing queued or being applied, the lock free), so no event overtakes another.
// FindMatches fans out to every shard without that lock, through the shard's ReadGate
// (router/index/read_gate.h): an exact read between events, or, when the shard thread lost its
// CPU in the middle of an event, a tolerant read around it (counted as tolerant_reads). So a
// route never sleeps behind the shard thread. The stats (TreeSizes, TreeSize, Memory) and the
// dumps (DumpableRanks, DumpRank) take the shard's read lock, a ShardLock: its writer lets a
// waiting reader in between events.
//
// Per (worker_id, dp_rank) the shard keeps an EventStreams cursor (Dynamo event_id or vLLM
// Kv-Seq): a repeat is dropped, a restart (id back to its first value) clears that rank first,
// and with recovery on a rank seen for the first time or with a gap is held while its worker is
// asked (dump or range), then applied with the reply. A full queue drops the batch, counts it
// and flags the worker (TakeStaleWorkers: its index is now wrong, not late).
//
// Thread contract: every method from any thread. on_recovery is called on a thread that applies
// events (a shard thread, or a submitting one with apply_on_submit), after it has released the
// shard's lock: Flush and AwaitOwnSubmissions called from inside it return at once, since they
// would wait for that thread itself; what it left queued is applied once on_recovery returns.
// Destruction applies what is queued, then stops and joins the shards.
//
//   ShardedIndex index({.num_shards = 2});
//   index.Submit(std::move(batch));          // NATS thread
//   OverlapScores s = index.FindMatches(ComputeSequenceHashes(local));  // route thread
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "events/kv_event.h"
#include "router/index/block_index.h"
#include "router/index/read_gate.h"
#include "router/index/recovery_part.h"
#include "router/index/worker_key.h"

namespace kvrouter {

class IndexShard;    // router/index/shard.h
class SpareBatches;  // router/index/spare_batches.h

struct ShardedIndexOptions {
  std::size_t num_shards = 2;          // fixed for the index's life; worker_id -> shard by hash
  std::size_t queue_capacity = 65536;  // batches waiting per shard before Submit refuses
  std::size_t max_bulk = 256;          // batches dequeued at once by a shard thread
  // Recovery (docs/protocol.md section 6, EventStreams): when set, a rank seen for the first time or
  // with a gap in its ids is held and this is called to ask its worker; the answer comes back
  // through Recovered(). Unset: gaps are only counted. It is called on the thread that applied
  // the event (a shard thread, or with apply_on_submit a submitting thread) once the shard's lock
  // is released, and must not block: that thread's next events wait for it.
  RecoveryNeeded on_recovery;
  std::size_t max_held = 4096;  // batches held per rank while it recovers
  // Indexed blocks per (worker, dp_rank) unless SetCapacity says otherwise; a stored event that
  // would pass it is dropped (over_capacity): a worker flooding more than its cache cannot grow
  // the index without bound.
  std::uint64_t default_capacity = std::numeric_limits<std::uint64_t>::max();
  // How long FindMatches waits for a shard thread that is in the middle of an event before it
  // reads around that event (router/index/read_gate.h).
  std::chrono::nanoseconds read_patience = ReadGate::kDefaultPatience;
  // Submit applies a batch on the submitting thread itself when its shard is idle (nothing
  // queued, nothing being applied, the lock free), instead of handing it over: cheaper when
  // the machine has fewer CPUs than busy ingestion threads (ApplyOnSubmitPays).
  bool apply_on_submit = false;
  // How long a shard's sequence-hash table stays under an eighth full before its thread gives
  // the memory back (sampled every 100 ms, busy or idle). Emptied and refilled sooner (a fleet
  // restarting), it keeps its capacity and never rehashes.
  std::chrono::milliseconds shrink_after{10000};
};

// ShardedIndex::FindMatches' runs, one per shard.
struct IndexMatches {
  std::vector<MatchRuns> shards;
  std::uint32_t max_depth() const {  // the longest prefix any worker holds
    std::uint32_t d = 0;
    for (const MatchRuns& m : shards) d = std::max(d, m.max_depth());
    return d;
  }
};

// Event counters summed over shards (monotonic).
struct IndexCounters {
  std::uint64_t batches_applied = 0;
  std::uint64_t ops_applied = 0;  // stored/removed/cleared operations applied
  std::uint64_t blocks_stored = 0;
  std::uint64_t blocks_removed = 0;
  std::uint64_t non_device_ops = 0;    // ops on host, disk or external tiers
  std::uint64_t gaps = 0;              // event_id / Kv-Seq jumped forward
  std::uint64_t events_recovered = 0;  // events (a dump's chains) applied from recoveries
  std::uint64_t held_dropped = 0;      // held batches dropped when a rank's hold overflowed
  std::uint64_t restarts = 0;          // ids started again from the beginning
  // Drop reasons (docs/protocol.md names).
  std::uint64_t parent_block_not_found = 0;
  std::uint64_t block_not_found = 0;
  std::uint64_t duplicate = 0;      // repeated event ids, dropped
  std::uint64_t over_capacity = 0;  // stored events dropped: the rank was full
  std::uint64_t queue_full = 0;
  // Route queries that read a shard while its thread, preempted in the middle of an event, had
  // not finished it within read_patience (router/index/read_gate.h).
  std::uint64_t tolerant_reads = 0;
};

// One rank of a replica's dump (docs/protocol.md section 12, router.dump).
struct RankDump {
  WorkerKey rank;
  SequenceKind numbering = SequenceKind::kNone;  // how its ids count (kNone: no numbered event yet)
  std::uint64_t last_event_id = 0;               // §6 id of the last event applied (0: none)
  std::vector<DumpedChain> chains;               // BlockIndex::DumpRank
};

struct WorkerTreeSize {
  WorkerKey worker;
  std::size_t blocks = 0;
};

class ShardedIndex {
 public:
  explicit ShardedIndex(ShardedIndexOptions options = {});
  ~ShardedIndex();
  ShardedIndex(const ShardedIndex&) = delete;
  ShardedIndex& operator=(const ShardedIndex&) = delete;

  // Hands a decoded batch to the shard owning batch.worker_id. Never blocks; false when that
  // shard's queue is full (counted as queue_full, the worker flagged stale).
  bool Submit(KvEventBatch&& batch);
  // Submit for every batch (emptied and left in `batches`), one queue hand-off and at most one
  // wake-up per shard; appends the worker of each refused batch to `refused`.
  void SubmitAll(std::vector<KvEventBatch>& batches, std::vector<std::uint64_t>& refused);
  // A batch to decode the next event into (DecodeDynamoEventInto): one the shards applied and
  // handed back with its vectors' memory, or an empty one. So the delivery thread does not
  // allocate, for every event, memory that a shard thread then frees: malloc and free on
  // different threads are a real share of the ingest path's cost. At most 4,096 wait, and only
  // small ones (one or a few ops of up to 64 blocks); a thread that takes them holds up to 64 of
  // its own, taken at once, and with apply_on_submit up to 256 it applied itself. Any thread.
  KvEventBatch Spare();
  // Control operations; never refused, applied in order with the worker's events.
  void ClearWorker(std::uint64_t worker_id);   // all dp ranks, keeps sequence tracking
  void RemoveWorker(std::uint64_t worker_id);  // blocks and sequence tracking
  // Recovery (when on_recovery is set): ask for a tree dump of a rank (reconnect, dropped events;
  // first_sight, a first registration: only when nothing is known of the rank yet), and apply a
  // reply part, or a part of a peer's dump (RecoveryPart::from_peer).
  void RequestDump(WorkerKey worker, SequenceKind numbering = SequenceKind::kEventId, bool first_sight = false);
  // The most blocks each rank of `worker_id` may hold (its registration's capacity).
  void SetCapacity(std::uint64_t worker_id, std::uint64_t blocks_per_rank);
  void Recovered(RecoveryPart part);

  // Overlap per (worker, dp_rank) for a request given its sequence hashes, in no particular
  // order. The second form fills `out` (cleared first) and keeps its memory: a caller that
  // queries again and again passes the same buffer, so a query of thousands of matching
  // workers does not allocate (and, at 100 KB and more, free and fault in) its result anew.
  OverlapScores FindMatches(std::span<const SequenceHash> seq_hashes) const;
  void FindMatches(std::span<const SequenceHash> seq_hashes, OverlapScores& out) const;
  // The same in two steps: the index read, as runs of holder slots per shard (MatchRuns: no
  // worker keys looked up), then the scores, appended to `out`. TranslateMatches is false,
  // appending nothing, when a worker has been removed and its slot given to another since the
  // read, or a run is elided: FindMatches again. `known`: the holder-set stamps whose slots the
  // caller keeps, ascending (BlockIndex::FindMatches).
  void FindMatches(std::span<const SequenceHash> seq_hashes, IndexMatches& out,
                   std::span<const std::uint64_t> known = {}) const;
  bool TranslateMatches(const IndexMatches& matches, OverlapScores& out) const;
  std::vector<WorkerTreeSize> TreeSizes() const;
  // A dump of the index for a peer (docs/protocol.md section 12): the real ranks (tier bits
  // clear) the index or its event streams know, ascending; and one rank's chains on every tier
  // with the id of the last event they include, read under its shard's lock (nullopt while the
  // rank is recovering: its worker's answer is still to come).
  std::vector<WorkerKey> DumpableRanks() const;
  std::optional<RankDump> DumpRank(WorkerKey rank) const;
  // The recovery asks (worker, generation) peers' dump parts took the place of since the last
  // call: they need not be made.
  std::vector<std::pair<WorkerKey, std::uint64_t>> TakeSuperseded();
  std::size_t TreeSize(WorkerKey worker) const;  // blocks of one rank
  IndexCounters Counters() const;
  IndexMemory Memory() const;
  // Upkeep passes made by the shard thread that made fewest (each makes one every 100 ms:
  // free nodes put in order, the sequence-hash table shrunk once it has stayed small).
  std::uint64_t UpkeepPasses() const;
  // Workers whose index may be wrong (gap, queue full) since the last call; clears the set.
  std::vector<WorkerKey> TakeStaleWorkers();
  // Blocks until everything submitted before the call has been applied; from inside this
  // index's on_recovery, returns at once (the thread contract above).
  void Flush();
  // Blocks until what this thread submitted before the call has been applied: unlike Flush, not
  // held up by what other threads keep submitting (an event flood). From inside this index's
  // on_recovery, returns at once, as Flush.
  void AwaitOwnSubmissions();

  // Puts the calling thread in Linux's batch scheduling class (SCHED_BATCH, same share of the
  // CPU, but it does not preempt a running thread when it wakes up). Shard threads run so, and
  // the service marks the threads that deliver events to them: on a machine with fewer cores
  // than busy threads, a route's thread is then not preempted by ingestion waking up in the
  // middle of a query. `tid` 0 is the calling thread; another thread of this process by its
  // Linux thread id. False when the system refused (the thread keeps its class).
  static bool MarkIngestThread(int tid = 0);

  // Whether this process has fewer CPUs than the threads an event flood keeps busy with
  // `num_shards` shards (the shard threads, the thread delivering events, nats.c's socket
  // reader). A batch handed to a shard thread then waits for that thread to win a CPU and is
  // read on another core than the one that decoded it: applying it on the delivery thread
  // costs less.
  static bool ApplyOnSubmitPays(std::size_t num_shards);

  std::size_t num_shards() const { return shards_.size(); }
  std::size_t ShardOf(std::uint64_t worker_id) const;

 private:
  std::unique_ptr<SpareBatches> spares_;  // before shards_: their threads give to it until joined
  std::vector<std::unique_ptr<IndexShard>> shards_;
  const bool apply_on_submit_;
  mutable std::atomic<std::size_t> last_matches_{0};  // size of the last FindMatches result
};

}  // namespace kvrouter
