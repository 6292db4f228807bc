// Codec for vLLM-format KV events (docs/protocol.md section 3), the body of
// `namespace.{ns}.component.{comp}.vllm-kv-events.{worker_id}.{dp_rank}`.
//
// Grammar:
//   batch   = [ts: f64, events: [event...], data_parallel_rank?: int|nil]
//           | {ts: f64, events: [event...], data_parallel_rank?: int|nil}
//   event   = [tag: str, field...] | {type: tag, field_name: value...}
//   BlockStored      fields: block_hashes, parent_block_hash, token_ids, block_size, lora_id,
//                            medium, lora_name, extra_keys, group_idx, ... (may stop after
//                            block_size; trailing unknown fields ignored)
//   BlockRemoved     fields: block_hashes, medium, ...
//   AllBlocksCleared no fields
//   hash    = int (its u64 bit pattern) | bin (the last 8 bytes, big-endian; a shorter bin is
//             read big-endian as it is, an empty bin is an error)
//   medium  = nil | "GPU" -> device tier; "CPU" (any case) -> host_pinned; "DISK" (any case)
//             -> disk; any other string -> external
// Required: ts, events; block_hashes, token_ids, block_size of BlockStored; block_hashes of
// BlockRemoved. lora_id is not used (lora_name seeds the hash). data_parallel_rank is checked
// to be an int or nil, then ignored.
// tokens_hash is recomputed from token_ids (with lora_name) at the router's block size: block k
// hashes token_ids[k*bs, (k+1)*bs). A stored event whose block_size differs from the router's
// (every block is bad) or whose token_ids run out stops at the first bad block, keeping the
// blocks before it (possibly none: the op is still emitted, one op per event); each such event
// counts 1 in block_size_mismatches. An unknown event type fails the whole batch.
// The worker and dp rank come from the subject and win over data_parallel_rank.
// Decoding never throws. Thread-safe (pure functions).
// Bounds: events, block hashes and token_ids are at most what the bytes encode (lengths checked
// before allocating, msgpack_reader.h); worker and rank from the subject are bounded by the
// registry (worker_registry.h).
//
//   auto r = DecodeVllmBatch(body, {.worker_id = 3, .dp_rank = 0, .kv_seq = 12, .block_size = 64});
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <msgpack.hpp>

#include "events/kv_event.h"
#include "events/base/status.h"

namespace kvrouter {

struct VllmBatchContext {
  std::uint64_t worker_id = 0;          // from the subject
  std::uint32_t dp_rank = 0;            // from the subject
  std::optional<std::uint64_t> kv_seq;  // Kv-Seq header; sequence kind kNone when absent
  std::uint32_t block_size = 64;        // the router's block size
};

struct VllmDecoded {
  KvEventBatch batch;                       // sequence {kVllmSeq, kv_seq} when kv_seq is set
  std::uint32_t block_size_mismatches = 0;  // stored events cut short
};

Result<VllmDecoded> DecodeVllmBatch(std::span<const std::byte> body, const VllmBatchContext& ctx);

// Parses the Kv-Seq header value (a decimal u64); nullopt when malformed.
std::optional<std::uint64_t> ParseKvSeqHeader(std::string_view value);

// One vLLM event as a publisher (mock worker, tests) describes it.
struct VllmStoredEvent {
  std::vector<std::uint64_t> block_hashes;
  std::optional<std::uint64_t> parent_block_hash;
  std::vector<std::uint32_t> token_ids;
  std::uint32_t block_size = 64;
  std::string lora_name;              // empty = none
  std::optional<std::string> medium;  // nullopt = nil (GPU)
  // Per block, its extra keys (item identifiers, cache_salt, the LoRA name); empty = nil.
  std::vector<std::vector<std::string>> extra_keys;
};
struct VllmRemovedEvent {
  std::vector<std::uint64_t> block_hashes;
  std::optional<std::string> medium;
};
struct VllmClearedEvent {};
using VllmEvent = std::variant<VllmStoredEvent, VllmRemovedEvent, VllmClearedEvent>;

// Encodes [ts, [events as tagged arrays], dp_rank] (the form vLLM's msgspec encoder emits).
msgpack::sbuffer EncodeVllmBatch(double ts, const std::vector<VllmEvent>& events, std::optional<std::uint32_t> dp_rank);

}  // namespace kvrouter
