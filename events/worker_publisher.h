// KvEventPublisher: the worker side of KV events for one (worker_id, dp_rank), as a library with
// no threads, sockets or clock. It numbers what its engine emits (event ids from 1, +1 per event,
// docs/protocol.md section 2), keeps the last `event_buffer` (1,024) events and an index of the blocks
// the worker holds, and answers recovery queries (section 6) from them.
// Thread contract: not thread-safe; the owner serialises every call (kvmocker: its engine mutex).
// Owns its buffer and index; every batch and reply it returns is the caller's.
//
//   KvEventPublisher pub({.worker_id = 7});  Send(EncodeDynamoEnvelope(pub.Publish(stored), h));
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <unordered_map>
#include <vector>

#include "events/kv_event.h"
#include "events/worker_codec.h"

namespace kvrouter {

struct PublisherConfig {
  std::uint64_t worker_id = 0;      // worker_id of every event
  std::uint32_t dp_rank = 0;        // dp_rank of every event
  std::size_t event_buffer = 1024;  // events kept for range recoveries; 0 = always a tree dump
};

// A block of the index: what a stored chain said about it.
struct HeldBlock {
  BlockHash block_hash = 0;
  std::optional<BlockHash> parent_hash;  // nullopt: the first block of a sequence
  LocalHash tokens_hash = 0;
  bool operator==(const HeldBlock&) const = default;
};

// The index follows the events the way the router's index does, so that a tree dump rebuilds
// what a router that saw every event can match (only device-tier blocks; other tiers are
// numbered and buffered but not indexed):
//   stored  - a chain under a parent the index does not hold is not indexed (the router drops
//             it too: parent_block_not_found); a block stored again at the same place (parent and
//             tokens_hash) is a no-op; a known block stored at another place moves there, and
//             what hung below its old place is dropped as by a removal.
//   removed - each known block goes with all its descendants: an engine cannot hit a block
//             whose parent is gone, nor can a router match past a missing block, so nothing
//             matchable is lost, and a dump never carries a child without its parent. Unknown
//             hashes are ignored.
//   cleared - empties the index (any tier).
class KvEventPublisher {
 public:
  explicit KvEventPublisher(PublisherConfig config);

  // Numbers the event (the next event id), applies it to the index, buffers it, and returns it
  // as a batch of one op of `tier` for the caller to publish.
  KvEventBatch Publish(KvEventData data, StorageTier tier = StorageTier::kDevice);

  // Recovery (docs/protocol.md section 6), ids inclusive:
  //   end < start                                  -> "invalid_range" (with a message);
  //   start > last_event_id                        -> "too_new" (with a message);
  //   start nil, or older than the buffer          -> "tree_dump": one stored chain per event,
  //       each a maximal run parent -> child of held blocks, parents' chains first, every
  //       event numbered last_event_id; as many events as the index has leaves;
  //   otherwise                                    -> "events" [start, min(end, last_event_id)].
  // last_event_id is set on every reply. Time: the range or the index, linear.
  RecoveryReply Recover(std::optional<std::uint64_t> start, std::optional<std::uint64_t> end) const;
  // The reply to a decoded query: Recover(start, end), or kind "error" with the decoding failure
  // as its message.
  RecoveryReply Answer(const Result<RecoveryQuery>& query) const;

  std::uint64_t last_event_id() const { return last_event_id_; }
  std::size_t held_blocks() const { return node_of_.size(); }
  // Every held block, ascending by block_hash (for tests and checks; linear time).
  std::vector<HeldBlock> HeldBlocks() const;

 private:
  static constexpr std::uint32_t kRoot = 0;  // the sentinel parent of every sequence's first block
  static constexpr std::uint32_t kNone = 0xffffffff;
  struct Node {
    BlockHash block_hash = 0;
    LocalHash tokens_hash = 0;
    std::uint32_t parent = kRoot;
    std::uint32_t first_child = kNone;
    std::uint32_t next_sibling = kNone;
    std::uint32_t prev_sibling = kNone;
  };

  void Apply(const KvOp& op);
  void ApplyStored(const KvStored& stored);
  std::uint32_t Find(BlockHash block_hash) const;  // kNone when not held
  std::uint32_t AddChild(std::uint32_t parent, const StoredBlock& block);
  void DropSubtree(std::uint32_t node);  // the node and every descendant
  void Clear();
  void Remember(const KvEventBatch& batch);
  const KvEventBatch& Buffered(std::size_t i) const;  // 0 = the oldest buffered event
  KvEventBatch Batch(std::uint64_t event_id, KvOp op) const;

  const PublisherConfig config_;
  std::uint64_t last_event_id_ = 0;

  // Ring buffer of the last event_buffer events: while it fills, ring_[i] is the i-th oldest;
  // once full, the oldest is ring_[ring_first_].
  std::vector<KvEventBatch> ring_;
  std::size_t ring_first_ = 0;

  // The index: a forest under nodes_[kRoot]; children in doubly linked sibling lists, so adding
  // and dropping a block cost O(1) besides the hash map. Freed slots are reused.
  std::vector<Node> nodes_;
  std::vector<std::uint32_t> free_nodes_;
  std::unordered_map<BlockHash, std::uint32_t> node_of_;  // held block_hash -> slot
};

}  // namespace kvrouter
