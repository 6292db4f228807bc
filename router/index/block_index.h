// BlockIndex: which KV blocks each (worker_id, dp_rank) holds, as a prefix tree with a sorted
// holder set per node: one shard's worth of workers. Terms used here (holder set, slot, canonical
// and mapped worker, tier rank, orphan risk, run, stamp, elided run, tolerant read, retired
// memory) are defined in docs/design.md "Glossary".
// A node is the prefix ending at a block; it is found by that prefix's sequence hash
// (docs/protocol.md section 1), computed here from its parent's and the stored block's local
// hash, so every level of a request's path can be looked up (and prefetched) independently
// instead of chasing parent links. A canonical worker (engine block_hash = sequence hash:
// Dynamo's workers, kvmocker, approximate mode) keeps only a list of the nodes it holds (4 bytes
// each, for `cleared`); its first block whose block_hash differs turns it mapped until it is
// cleared: a map from engine block_hash to node (12 bytes at load 0.375-0.75 per block).
// Files by job: block_index_write.cc applies events, block_index_match.cc answers FindMatches
// and TranslateMatches, block_index_dump.cc DumpRank, block_index_tiers.cc folds tier ranks back
// (SplitTiers, RankOverlaps), block_index.cc the rest (lifetime, retired memory, upkeep, Memory).
//
// Thread contract: one thread at a time applies events (the shard's thread, or one applying its
// own events, under the shard's lock: "the owner" below). FindMatches and TranslateMatches may
// run on other threads while it writes, when SetConcurrentReaders(true) is set and the reads and
// writes go through a ReadGate (router/index/read_gate.h): every word they reach (table entries,
// node hashes and flags, holder sets, the chunk directory, slot keys) is written with atomic
// stores, memory a write replaces is kept until FreeRetired() (and a freed node or slot is
// reused only after it, so a reader never meets one recycled), and FindMatches checks each node
// it reaches against the request's hash and bounds each slot and size it loads. TreeSize,
// ForEachWorker, Memory and DumpRank read the owner's bookkeeping: only while the owner cannot
// write (IndexShard holds the shard's lock, a ShardLock). Memory: a node is freed (slot
// recycled, holder heap released, child link erased) when its last holder goes and it has no
// children; a worker's removal or `cleared` costs time proportional to that worker's blocks;
// FindMatches touches only the request's path.
//
//   BlockIndex idx;  idx.ApplyStored({7, 0}, std::nullopt, blocks);
//   idx.FindMatches(ComputeSequenceHashes(local_hashes), scores);  // (worker, rank) -> blocks
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <memory>
#include <span>
#include <type_traits>
#include <utility>
#include <unordered_map>
#include <vector>

#include "events/kv_event.h"
#include "router/index/flat_table.h"
#include "router/index/holder_set.h"
#include "router/index/large_array.h"
#include "router/index/published_array.h"
#include "router/index/worker_key.h"

namespace kvrouter {

struct OverlapScore {
  WorkerKey worker;
  std::uint32_t blocks = 0;  // leading request blocks the worker holds (> 0)
  bool operator==(const OverlapScore&) const = default;
};
static_assert(sizeof(OverlapScore) == 16);

// An allocator whose resize(n) leaves new elements unwritten (value-initialisation is skipped,
// so vector(n) and emplace_back() do the same): FindMatches sizes its result for every holder
// of the request's first block (thousands in a large fleet) and writes each score
// itself, so zeroing them first would write the whole result twice. Every other construction
// is the ordinary one.
template <typename T>
struct UninitializedResizeAllocator : std::allocator<T> {
  static_assert(std::is_trivially_copyable_v<T> && std::is_trivially_destructible_v<T>);
  template <typename U>
  struct rebind {
    using other = UninitializedResizeAllocator<U>;
  };
  UninitializedResizeAllocator() = default;
  template <typename U>
  UninitializedResizeAllocator(const UninitializedResizeAllocator<U>&) noexcept {}
  template <typename U>
  void construct(U*) noexcept {}  // resize(n): the caller writes the element
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
using OverlapScores = std::vector<OverlapScore, UninitializedResizeAllocator<OverlapScore>>;

// FindMatches' result before worker keys are looked up (BlockIndex::TranslateMatches): runs of
// holder slots, each with a depth. A slot's overlap is the largest depth among the runs holding
// it; every run is a subset of the first block's holders as read, and the depths ascend. Where
// most of the matching set drops out at one depth (a large fleet's usual case: thousands share
// a system prompt, few the rest), the set is one copied holder array, 4 bytes a slot, rather
// than a 16-byte score per worker with its key looked up; where fewer drop out, only they are
// written. At most twice as many slots as workers matched.
//
// A run that is one whole holder set kept in a buffer of HolderSet::kStampedCapacity slots or
// more names its version (HolderSet's stamp). When the reader passes that stamp among the ones
// it knows, the set's slots are not copied: the run is elided (no slots in `slots`, `elided` of
// them) and only a reader that kept them can use it; TranslateMatches refuses runs with one.
struct MatchRuns {
  struct Run {
    std::uint32_t end = 0;  // slots[previous run's end, end)
    std::uint32_t depth = 0;
    std::uint64_t stamp = 0;   // the holder set's version these slots are, whole (0: none)
    std::uint32_t elided = 0;  // slots of that version left out (a known stamp), else 0
  };
  std::vector<std::uint32_t> slots;
  std::vector<Run> runs;
  std::uint64_t slot_reuses = 0;  // the index's count of reused slots when read

  void clear() {
    slots.clear();
    runs.clear();
  }
  std::uint32_t max_depth() const { return runs.empty() ? 0 : runs.back().depth; }
  bool any_elided() const {
    return std::any_of(runs.begin(), runs.end(), [](const Run& r) { return r.elided != 0; });
  }
};

// Storage tiers (docs/protocol.md section 12). The index keeps a rank's blocks on each tier apart,
// as ranks of their own: device blocks under the rank itself, host-pinned blocks with
// kHostTierRank set in dp_rank, disk and external ones with kDiskTierRank (real dp ranks stay
// below kTierRankBits: registrations and events of higher ranks are refused). FindMatches reports
// them as such; SplitTiers folds them back.
inline constexpr std::uint32_t kHostTierRank = 1u << 30;
inline constexpr std::uint32_t kDiskTierRank = 1u << 31;
inline constexpr std::uint32_t kTierRankBits = kHostTierRank | kDiskTierRank;
// Where the index keeps `worker`'s blocks on `tier`.
WorkerKey TierRank(WorkerKey worker, StorageTier tier);

// A rank's overlap with a prompt on each tier, cumulative: the longest prefix held on device; on
// device or host; on any tier.
struct TieredOverlap {
  std::uint32_t device = 0, host = 0, any = 0;
  bool operator==(const TieredOverlap&) const = default;
};
// Takes the entries of tier ranks out of `scores` (FindMatches' output; the device entries stay,
// in their order) into `tiers`, keyed by their device rank, each with its cumulative overlaps
// (device taken from `scores`). `tiers` is cleared first; it stays empty when no rank holds a
// prompt block off device.
void SplitTiers(OverlapScores& scores, std::unordered_map<WorkerKey, TieredOverlap, WorkerKeyHash>& tiers);

// FindMatches' output read rank by rank, its tiers folded in (SplitTiers): At must be asked for
// ranks in ascending order. Borrows `scores` and reorders it.
//   RankOverlaps overlaps(scores);  for (rank : ranks ascending) TieredOverlap t = overlaps.At(rank);
class RankOverlaps {
 public:
  explicit RankOverlaps(OverlapScores& scores);
  TieredOverlap At(WorkerKey rank);

 private:
  OverlapScores& scores_;
  std::unordered_map<WorkerKey, TieredOverlap, WorkerKeyHash> tiers_;
  std::size_t next_ = 0;
};

// What applying one operation did; the caller turns it into counters.
struct ApplyOutcome {
  std::uint32_t blocks_stored = 0;  // new (worker, block) holdings
  std::uint32_t blocks_removed = 0;
  bool parent_not_found = false;       // stored chain dropped whole
  bool over_capacity = false;          // stored chain dropped whole: it would pass max_blocks
  std::uint32_t blocks_not_found = 0;  // removals of unknown blocks (rest still applied)
};

struct IndexMemory {
  std::size_t bytes = 0;        // everything the index allocated (capacities, not sizes)
  std::size_t nodes = 0;        // live tree nodes (without the root)
  std::size_t holdings = 0;     // (block, worker) pairs = sum of tree sizes
  std::size_t table_bytes = 0;  // of `bytes`: the sequence-hash table's slots
  std::size_t map_bytes = 0;    // of `bytes`: the slots of workers' maps of engine hashes
};

class BlockIndex {
 public:
  BlockIndex();
  ~BlockIndex();
  BlockIndex(const BlockIndex&) = delete;
  BlockIndex& operator=(const BlockIndex&) = delete;

  // Stores a chain for `worker`. A parent this rank does not hold is looked for on its other
  // storage tiers (a block offloaded from GPU to CPU names its parent wherever that is). An
  // unknown parent drops the whole chain, and so does a chain
  // that would take the worker's blocks past max_blocks; re-storing a known block is
  // idempotent; a known block_hash stored at a new position moves there.
  ApplyOutcome ApplyStored(WorkerKey worker, std::optional<BlockHash> parent, std::span<const StoredBlock> blocks,
                           std::uint64_t max_blocks = std::numeric_limits<std::uint64_t>::max());
  // Starts loading what ApplyStored of this chain will look up first, so that its cache misses
  // overlap the work before it (the caller applies the previous event meanwhile): the table
  // slots of its engine hashes, in the worker's own map when its engine hashes are not sequence
  // hashes (vLLM's; then also the sequence-hash table's slots of the chain's prefixes, when the
  // parent is held here), else in the sequence-hash table (Dynamo's and kvmocker's workers).
  void PrefetchStored(WorkerKey worker, std::optional<BlockHash> parent, std::span<const StoredBlock> blocks) const;
  // Removes blocks by engine hash; unknown ones are counted and skipped.
  ApplyOutcome ApplyRemoved(WorkerKey worker, std::span<const BlockHash> block_hashes);
  // Starts loading the table slots where ApplyRemoved of these blocks looks first (the first 8).
  void PrefetchRemoved(WorkerKey worker, std::span<const BlockHash> block_hashes) const;
  // Drops every block of one (worker, dp_rank), on every storage tier; the worker stays known.
  std::size_t ClearRank(WorkerKey worker);
  // Drops every block of every dp rank of worker_id (`cleared`); returns blocks dropped.
  std::size_t ClearWorker(std::uint64_t worker_id);
  // Forgets worker_id entirely (lease expiry, leaving).
  std::size_t RemoveWorker(std::uint64_t worker_id);

  // Appends, for every (worker, dp_rank) holding at least the first block, the number of
  // leading blocks of the request it holds, given the request's sequence hashes. Touches only
  // the request's path and stops as soon as no worker remains. `tolerant`: the owner may be
  // writing meanwhile (a ReadGate's tolerant read); each worker is then still reported at most
  // once, with what the reader saw.
  void FindMatches(std::span<const SequenceHash> seq_hashes, OverlapScores& out, bool tolerant = false) const;
  // The same matches as runs of holder slots (replacing `out`'s), for TranslateMatches later.
  // `known`: stamps whose slots the caller keeps (ascending); a run of one of them is elided.
  void FindMatches(std::span<const SequenceHash> seq_hashes, MatchRuns& out, bool tolerant = false,
                   std::span<const std::uint64_t> known = {}) const;
  // Appends the scores of `runs` (each slot once, at its overlap; deepest first), the scores
  // FindMatches into OverlapScores would have given when the runs were read. Under the same
  // ReadGate rules as FindMatches, in the same read or a later one. False, appending nothing,
  // when a slot has been handed to another worker since the runs were read (a worker removed
  // and another added), or a run is elided: read again.
  bool TranslateMatches(const MatchRuns& runs, OverlapScores& out, bool tolerant = false) const;

  // FindMatches will run while the owner writes: replaced memory is kept until FreeRetired.
  void SetConcurrentReaders(bool on);
  bool HasRetired() const;
  // Owner, when no reader can hold replaced memory any more (ReadGate::EndWrite said quiet).
  void FreeRetired();

  // On: the sequence-hash table keeps its capacity when blocks go, and so does a worker's map of
  // engine hashes when it is cleared (a cleared fleet refills without growing them again step by
  // step); the owner gives memory back with ShrinkTables once one has stayed under an eighth full
  // a while (TablesUnderfull). Off (the default): the table halves as it empties.
  void ShrinkTablesLater(bool on) {
    shrink_later_ = on;
    node_of_.ShrinkOnErase(!on);
  }
  bool TablesUnderfull() const;
  void ShrinkTables();
  // Owner, now and then (a shard thread's upkeep, every 100 ms): when many freed nodes wait
  // unsorted (a worker cleared), orders the free list so that new nodes are taken in address
  // order, neighbours sharing cache lines and pages, rather than all over the node chunks.
  void TidyFreeNodes();

  std::size_t TreeSize(WorkerKey worker) const;  // blocks held by (worker, dp_rank)
  // While the owner cannot write (as TreeSize): every block a rank holds, on each storage tier,
  // as stored chains that rebuild it when applied in order (ApplyStored on TierRank(rank, tier)):
  // a chain's parent is written before it, on whichever tier holds it (device chains come first,
  // then host and disk, a chain below a block held on a later tier only after that block); each
  // chain names its first block's parent by the engine hash this rank knows it under, and no
  // chain is longer than max_chain_blocks. A block whose parent the rank holds on no tier (left
  // behind when a middle block was removed) is left out, and so are its children: FindMatches
  // cannot reach them. Appends to `out`; costs time and memory in proportion to the rank's
  // blocks, times the changes of tier along a path (one round over the tiers each).
  void DumpRank(WorkerKey rank, std::vector<DumpedChain>& out, std::size_t max_chain_blocks = 1024) const;
  // Node and worker-slot numbers handed out so far (live, free or waiting for FreeRetired).
  std::size_t node_numbers() const { return num_node_slots_; }
  // Freed node numbers, the next one to be taken last.
  std::span<const std::uint32_t> free_node_numbers() const { return free_nodes_; }
  std::size_t slot_numbers() const { return slots_.size(); }
  // Calls f(WorkerKey, tree_size) for every known (worker, dp_rank).
  template <typename F>
  void ForEachWorker(F&& f) const {
    for (const auto& [key, slot] : slot_of_) f(key, slots_[slot].holdings());
  }
  IndexMemory Memory() const;

 private:
  static constexpr std::uint32_t kRoot = 0;

  struct Node {
    SequenceHash seq = 0;          // identifies the prefix ending here
    std::uint32_t parent = kRoot;  // owner only
    // Bit 0, "orphan risk": set when a holder left this node while it had children: a child may
    // then hold a worker this node does not, so FindMatches must intersect explicitly below it.
    // Sticky until the node is freed (rare: engines evict leaves first). Bits 1-31: children.
    std::uint32_t meta = 0;
    HolderSet holders;

    std::uint32_t num_children() const { return meta >> 1; }
    bool orphan_risk() const { return (meta & 1) != 0; }
  };
  static_assert(sizeof(Node) == 32);

  // u64 key -> u32, packed in 12 bytes (the key split so the entry aligns to 4).
  struct U64MapTraits {
    using Key = std::uint64_t;
    struct Entry {
      std::uint32_t lo, hi;
      std::uint32_t value;
    };
    static Key KeyOf(const Entry& e) { return (std::uint64_t{e.hi} << 32) | e.lo; }
    static void Set(Entry& e, Key k, std::uint32_t v) {
      e = {static_cast<std::uint32_t>(k), static_cast<std::uint32_t>(k >> 32), v};
    }
    static std::uint64_t Hash(Key k) { return Mix64(k); }
    // Word by word, atomically: the sequence-hash table is read while the owner writes.
    static Entry Load(const Entry& e) { return {RelaxedLoad(e.lo), RelaxedLoad(e.hi), RelaxedLoad(e.value)}; }
    static void Store(Entry& e, const Entry& v) {
      RelaxedStore(e.lo, v.lo);
      RelaxedStore(e.hi, v.hi);
      RelaxedStore(e.value, v.value);
    }
  };
  static_assert(sizeof(U64MapTraits::Entry) == 12);

  struct WorkerSlot {
    WorkerKey key;
    bool in_use = false;
    bool mapped = false;  // see the header comment; back to canonical when cleared
    // Canonical: the nodes held, appended on every new holding and never erased one by one; an
    // entry is stale when the node no longer holds this slot (or holds it through a later
    // entry). Compacted when stale entries outnumber live ones.
    std::vector<std::uint32_t> held;
    std::uint32_t canonical_blocks = 0;  // canonical: live holdings
    FlatTable<U64MapTraits> blocks;      // mapped: engine block_hash -> node
    // Mapped: nodes this worker reaches through more than one block_hash: extra references
    // beyond the one its holder entry stands for. Almost always empty.
    std::unordered_map<std::uint32_t, std::uint32_t> extra_refs;
    std::size_t holdings() const { return mapped ? blocks.size() : canonical_blocks; }
  };

  std::uint32_t SlotFor(WorkerKey worker);         // creates on first use
  std::uint32_t FindSlot(WorkerKey worker) const;  // kFlatEmpty when unknown
  // The node of sequence hash seq (a child of parent), created when new with the local hash of
  // its block (kept for DumpRank).
  std::uint32_t ChildOrCreate(std::uint32_t parent, SequenceHash seq, LocalHash local);
  // The node the slot holds under engine hash h, or kFlatEmpty.
  std::uint32_t HeldNode(std::uint32_t slot, BlockHash h) const;
  // The node of parent_hash held by one of worker's other storage tiers (flagged: this rank will
  // hold children of a node it does not hold), or kFlatEmpty.
  std::uint32_t ParentOnAnotherTier(WorkerKey worker, BlockHash parent_hash);
  // Canonical slot -> mapped (the map built from its held nodes).
  void MakeMapped(std::uint32_t slot);
  // Canonical slot: drops stale entries of `held` once they outnumber the live ones.
  void MaybeCompact(std::uint32_t slot);
  void AddHolding(std::uint32_t slot, std::uint32_t i);
  // Drops one of the slot's references to node; frees nodes left without holders and children.
  void DropHolding(std::uint32_t slot, std::uint32_t i);
  void MaybeFree(std::uint32_t i);
  // ApplyRemoved's blocks in groups: what removing each will read, loaded ahead (no change).
  static constexpr std::size_t kRemovalGroup = 16;
  void PrefetchRemovals(std::uint32_t slot, std::span<const BlockHash> block_hashes) const;
  std::size_t ClearSlot(std::uint32_t slot);
  // FindMatches' walk of the request's path, writing through a ScoreWriter or a RunWriter.
  template <typename Writer>
  void WalkMatches(std::span<const SequenceHash> hashes, Writer& w) const;
  template <bool kTolerant>
  static void Translate(const MatchRuns& runs, PublishedArray<std::uint32_t>::View keys, OverlapScores& out);

  // Nodes live in fixed chunks so growth never copies them nor doubles memory; a chunk is one
  // 2 MiB huge page (LargeArray), so a request's path costs no page walks.
  static constexpr std::uint32_t kChunkBits = 16;
  static constexpr std::uint32_t kChunkSize = 1u << kChunkBits;
  static_assert(kChunkSize * sizeof(Node) == kHugePageBytes);
  Node& node(std::uint32_t i) { return chunks_[i >> kChunkBits][i & (kChunkSize - 1)]; }
  const Node& node(std::uint32_t i) const { return chunks_[i >> kChunkBits][i & (kChunkSize - 1)]; }

  std::vector<LargeArray<Node>> chunks_;  // node 0 (kRoot) is the root
  // The local hash of each node's block, beside chunks_ (owner only: FindMatches never reads it,
  // so it stays out of the nodes a request's path loads).
  std::vector<LargeArray<LocalHash>> locals_;
  LocalHash& local_of(std::uint32_t i) { return locals_[i >> kChunkBits][i & (kChunkSize - 1)]; }
  LocalHash local_of(std::uint32_t i) const { return locals_[i >> kChunkBits][i & (kChunkSize - 1)]; }
  PublishedArray<Node*> chunk_dir_;   // chunks_[c]'s nodes, for FindMatches
  std::uint32_t num_node_slots_ = 0;  // slots handed out so far
  // Freed node numbers, reused last freed first. A list of numbers rather than one linked
  // through the nodes: taking one touches no node, and the next few can be prefetched.
  std::vector<std::uint32_t> free_nodes_;
  std::size_t free_sorted_ = 0;               // free_nodes_[0, free_sorted_) is in descending order
  std::vector<std::uint32_t> retired_nodes_;  // freed while readers may read: free at FreeRetired
  std::size_t live_nodes_ = 0;
  FlatTable<U64MapTraits> node_of_;  // sequence hash -> node
  HolderHeap holder_heap_;
  std::vector<void*> retired_holders_;  // holder buffers replaced while readers may read

  std::vector<WorkerSlot> slots_;
  bool shrink_later_ = false;  // ShrinkTablesLater
  // slots_[i].key for FindMatches: words 3i, 3i+1 (worker_id, low and high), 3i+2 (dp_rank).
  PublishedArray<std::uint32_t> key_words_;
  std::vector<std::uint32_t> free_slots_;
  // Slots taken from free_slots_ so far (SlotFor counts before it writes the slot's new key):
  // runs read before a reuse may name a slot whose key has changed.
  std::atomic<std::uint64_t> slot_reuses_{0};
  std::vector<std::uint32_t> retired_slots_;  // removed while readers may read: free at FreeRetired
  std::unordered_map<WorkerKey, std::uint32_t, WorkerKeyHash> slot_of_;
  std::unordered_map<std::uint64_t, std::vector<std::uint32_t>> ranks_of_;  // worker_id -> slots
};

}  // namespace kvrouter
