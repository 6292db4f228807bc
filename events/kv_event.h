// The KV event model shared by both wire formats (Dynamo RouterEvent, vLLM KVEventBatch).
//
// A KvEventBatch is what one NATS message carries for one (worker_id, dp_rank): one or more
// cache operations (stored chain, removed blocks, cleared) plus the ordering information the
// router needs to detect gaps and repeats. Plain values; moved from the NATS thread into the
// shard that owns the worker, never shared.
//
//   KvEventBatch b{.worker_id = 7, .sequence = {SequenceKind::kEventId, 1}};
//   b.ops.push_back({StorageTier::kDevice, KvStored{std::nullopt, {{0xa, 0xb}}}});
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <variant>
#include <vector>

#include "events/block_hash.h"

namespace kvrouter {

// Where a block lives. Only kDevice blocks count toward overlap.
enum class StorageTier : std::uint8_t { kDevice, kHostPinned, kDisk, kExternal };
std::string_view StorageTierName(StorageTier tier);
// "device", "host_pinned", "disk", "external"; nullopt for anything else.
std::optional<StorageTier> StorageTierFromName(std::string_view name);

struct StoredBlock {
  BlockHash block_hash = 0;   // engine id: parents and removals refer to it
  LocalHash tokens_hash = 0;  // local hash of the block's tokens: used for matching
  bool operator==(const StoredBlock&) const = default;
};

// A chain: block k's parent is block k-1, block 0's parent is parent_hash (nullopt = the chain
// starts at the beginning of a sequence).
struct KvStored {
  std::optional<BlockHash> parent_hash;
  std::vector<StoredBlock> blocks;
  bool operator==(const KvStored&) const = default;
};

struct KvRemoved {
  std::vector<BlockHash> block_hashes;
  bool operator==(const KvRemoved&) const = default;
};

// The worker dropped its whole cache (all dp ranks).
struct KvCleared {
  bool operator==(const KvCleared&) const = default;
};

using KvEventData = std::variant<KvStored, KvRemoved, KvCleared>;

struct KvOp {
  StorageTier tier = StorageTier::kDevice;
  KvEventData data;
  bool operator==(const KvOp&) const = default;
};

// A stored chain on one storage tier: one chain of a rank's dump (BlockIndex::DumpRank, a
// router's dump reply).
struct DumpedChain {
  StorageTier tier = StorageTier::kDevice;
  KvStored stored;
  bool operator==(const DumpedChain&) const = default;
};

// How the batch is numbered. Dynamo event ids start at 1 per (worker, dp_rank); vLLM's Kv-Seq
// header counts batches from 0 and is tracked separately.
enum class SequenceKind : std::uint8_t { kNone, kEventId, kVllmSeq };

struct EventSequence {
  SequenceKind kind = SequenceKind::kNone;
  std::uint64_t value = 0;
  bool operator==(const EventSequence&) const = default;
};

struct KvEventBatch {
  std::uint64_t worker_id = 0;
  std::uint32_t dp_rank = 0;
  EventSequence sequence;
  std::vector<KvOp> ops;
  bool operator==(const KvEventBatch&) const = default;
};

// A batch storing a whole prompt as one chain from the start of a sequence, the way a Dynamo
// worker publishes it: engine block ids are the sequence hashes, tokens_hash the local hashes
// (docs/protocol.md section 1). For workers, tests and load generators.
KvEventBatch StoredPromptBatch(std::uint64_t worker_id, std::uint64_t event_id, std::span<const std::uint32_t> tokens,
                               std::uint32_t block_size, std::string_view lora_name = {});

}  // namespace kvrouter
