// Codec for Dynamo-format KV events (docs/protocol.md section 2), the body of
// `namespace.{ns}.component.{comp}.kv-events`.
//
// Grammar (msgpack maps keyed by field name; unknown keys ignored; integers of any width):
//   body        = envelope | router_event
//   envelope    = {publisher_id: u64, sequence: u64, published_at: u64, topic: str,
//                  payload: bin(router_event)}
//   router_event= {worker_id: u64, storage_tier?: "device"|"host_pinned"|"disk"|"external",
//                  event: kv_event}                      (has key "event", no key "payload")
//   kv_event    = {event_id: u64, dp_rank?: u32 (0), data: data}
//   data        = {"stored": {parent_hash: u64|nil, blocks: [{block_hash: u64, tokens_hash: u64,
//                              mm_extra_info?: nil|map}...]}}
//               | {"removed": {block_hashes: [u64...]}}
//               | "cleared"
// Hashes may arrive negative: their u64 bit pattern is taken. `data` names the event kind with
// its single key: an unknown kind or a second key is an error, as is an unknown
// storage_tier; {"cleared": <any>} is read as "cleared". Of the envelope only `payload` is read
// (the other fields are informational). Decoding never throws.
// Bounds: a batch holds at most what its bytes encode (every declared length is checked against
// the bytes left before anything is allocated, msgpack_reader.h); the router then bounds the
// worker and dp_rank it names (worker_registry.h) and holds at most 4,096 batches per rank while
// that rank recovers (event_stream.h).
// Encoders write storage_tier only when it is not "device". Thread-safe (pure functions).
//
//   Result<KvEventBatch> b = DecodeDynamoEvent(body);  // one op, sequence {kEventId, event_id}
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include <msgpack.hpp>

#include "events/kv_event.h"
#include "events/base/status.h"

namespace kvrouter {

struct EnvelopeHeader {
  std::uint64_t publisher_id = 0;
  std::uint64_t sequence = 0;
  std::uint64_t published_at_ms = 0;
  std::string topic = "kv-events";
};

// Decodes an envelope or a bare RouterEvent into a batch of exactly one op whose sequence is
// {kEventId, event_id}.
// The ingest path: a pull decoder that builds nothing but the batch takes the usual shapes,
// and anything else goes to the tree decoder, whose answer (result or error) is the same.
Result<KvEventBatch> DecodeDynamoEvent(std::span<const std::byte> body);
// The same into `out`, a batch used before (ShardedIndex::Spare): the pull decoder reuses the
// memory of its first op's blocks or hashes. Every field of `out` is set on success; on error
// `out` holds no meaning.
Status DecodeDynamoEventInto(std::span<const std::byte> body, KvEventBatch& out);
// Its two halves, for tests and fuzzing: the tree decoder (every input, explaining errors) and
// the pull decoder (nullopt for whatever it leaves to the tree decoder).
Result<KvEventBatch> DecodeDynamoEventTree(std::span<const std::byte> body);
std::optional<KvEventBatch> DecodeDynamoEventPull(std::span<const std::byte> body);

// The KvCacheEvent map {event_id, dp_rank, data} of `batch`, appended to `out`: the `event` of a
// RouterEvent and each element of a recovery reply's `events` (events/worker_codec.h). `batch`
// must hold exactly one op; its sequence value is written as event_id.
// with_tier: the op's storage_tier inside the event map when it is not `device` (recovery
// replies, kvrouter's extension; a RouterEvent carries the tier beside its event instead).
void PackKvCacheEvent(msgpack::sbuffer& out, const KvEventBatch& batch, bool with_tier = false);

// The KvCacheEvent map of one stored chain, with its storage_tier always written (a chain of a
// router's dump, docs/protocol.md section 12), appended to `out`: at most
// kStoredEventBytes + kStoredBlockBytes per block.
inline constexpr std::size_t kStoredEventBytes = 128;
inline constexpr std::size_t kStoredBlockBytes = 42;
void PackStoredEvent(msgpack::sbuffer& out, std::uint64_t event_id, std::uint32_t dp_rank, StorageTier tier,
                     const KvStored& stored);

// Decodes a KvCacheEvent map into a batch of `worker_id` with exactly one op of `tier` and
// sequence {kEventId, event_id}. Allocates only in proportion to the parsed object.
Result<KvEventBatch> DecodeKvCacheEvent(const msgpack::object& event, std::uint64_t worker_id, StorageTier tier);

// Encodes a bare RouterEvent map. `batch` must hold exactly one op; its sequence value is
// written as event_id.
msgpack::sbuffer EncodeRouterEvent(const KvEventBatch& batch);

// Encodes an envelope whose payload is EncodeRouterEvent(batch).
msgpack::sbuffer EncodeDynamoEnvelope(const KvEventBatch& batch, const EnvelopeHeader& header);

}  // namespace kvrouter
