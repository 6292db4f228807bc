// Codecs of the worker endpoints: the recovery query and reply of a worker's kv_indexer_query
// endpoint (docs/protocol.md section 6) and the generate request and responses of a (mock) worker's
// generate endpoint (section 7). Decoding never throws and allocates only in proportion to the
// bytes read. Thread-safe (pure functions; the structs are plain values).
// Bounds: a reply part is at most the max payload; a recovery's parts are applied as they come
// (nothing accumulates), with at most 16 recoveries in flight (recovery_client.h); a generate
// request's max_tokens is at most kMaxGenerateTokens.
//
//   Result<RecoveryReply> r = DecodeRecoveryReply(Request(subject, RecoveryQuery{}.Encode()), id);
//
// Grammar (maps keyed by field name, unknown keys ignored, integers of any width):
//   recovery_query = {start_event_id?: u64|nil, end_event_id?: u64|nil}       (inclusive)
//   recovery_reply = {kind: "events"|"tree_dump"|"too_new"|"invalid_range"|"error",
//                     events?: [kv_event...]|nil, last_event_id?: u64 (0), message?: str,
//                     more?: bool (false)}
//                    A reply larger than the server's max payload goes as several messages on
//                    the same reply subject, each a recovery_reply of the same kind and
//                    last_event_id; every one but the last says more: true (an extension of
//                    docs/protocol.md section 6: a 1,000,000-block dump is ~34 MB). Parts split the
//                    event list in order; a dump's long chains may be cut into consecutive
//                    chains (the second's parent is the first's last block).
//   kv_event       = section 2's KvCacheEvent {event_id: u64, dp_rank?: u32 (0), data: data}
//                    (events/event_codec.h; no worker_id and no tier: the endpoint names the
//                    worker, and recovered blocks are device blocks)
//   generate_req   = {request_id: str, token_ids: [u32], max_tokens?: u32 (16), dp_rank?: u32 (0)}
//                    max_tokens in [1, kMaxGenerateTokens]
//   generate_resp  = {request_id: str, token_ids: [u32], index?: u32 (0)}          (first token)
//                  | {request_id: str, token_ids: [u32], index?: u32 (0),          (final)
//                     finish_reason: "length"|"stop"|"error", cached_tokens?: u32,
//                     prompt_tokens?: u32, ttft_ms?: f64, message?: str}
// Encoders write every field of the form they encode (events even when empty, message only when
// set). Subjects: RecoverySubject and WorkerGenerateSubject (events/subjects.h).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <msgpack.hpp>

#include "events/kv_event.h"
#include "events/base/status.h"

namespace kvrouter {

// ---------------------------------------------------------------------------------------------
// Recovery (section 6).

struct RecoveryQuery {
  std::optional<std::uint64_t> start_event_id;  // nullopt: a tree dump
  std::optional<std::uint64_t> end_event_id;    // nullopt: up to the last event

  msgpack::sbuffer Encode() const;
  static Result<RecoveryQuery> Decode(std::span<const std::byte> body);
  bool operator==(const RecoveryQuery&) const = default;
};

struct RecoveryReply {
  std::string kind;                  // events | tree_dump | too_new | invalid_range | error
  std::vector<KvEventBatch> events;  // one op each, sequence {kEventId, event_id}
  std::uint64_t last_event_id = 0;   // the worker's newest event id when it answered
  std::string message;               // why, for too_new / invalid_range / error; empty = none
  bool more = false;                 // one part of several: more parts follow
  bool operator==(const RecoveryReply&) const = default;
};

// Every event must hold exactly one op; its sequence value is written as event_id.
msgpack::sbuffer EncodeRecoveryReply(const RecoveryReply& reply);
// The reply as messages of at most max_bytes each (one message when it fits), in order. A range
// reply's events are never cut; an event that cannot fit alone is InvalidArgument.
Result<std::vector<msgpack::sbuffer>> EncodeRecoveryReplyParts(const RecoveryReply& reply, std::size_t max_bytes);
// The reply's events become batches of `worker_id` (one device-tier op each).
Result<RecoveryReply> DecodeRecoveryReply(std::span<const std::byte> body, std::uint64_t worker_id);

// ---------------------------------------------------------------------------------------------
// Generate (section 7). A response is final exactly when it has the key finish_reason. token_ids
// are deltas: the first response carries the first generated token (index 0), the final one the
// remaining max_tokens - 1 tokens starting at index 1 (empty when max_tokens is 1); an error
// carries none, index 0, and a message. ttft_ms is measured from the request's arrival at the
// worker.

inline constexpr std::uint32_t kMaxGenerateTokens = 65536;  // keeps the final response < 1 MB

struct GenerateRequest {
  std::string request_id;
  std::vector<std::uint32_t> token_ids;
  std::uint32_t max_tokens = 16;
  std::uint32_t dp_rank = 0;

  msgpack::sbuffer Encode() const;
  static Result<GenerateRequest> Decode(std::span<const std::byte> body);
  bool operator==(const GenerateRequest&) const = default;
};

struct GenerateResponse {
  std::string request_id;
  std::vector<std::uint32_t> token_ids;
  std::uint32_t index = 0;
  std::optional<std::string> finish_reason;  // set = the final response
  // Written on the final response only.
  std::uint32_t cached_tokens = 0;
  std::uint32_t prompt_tokens = 0;
  double ttft_ms = 0;
  std::string message;  // why, when finish_reason is "error"; empty = not written

  bool is_final() const { return finish_reason.has_value(); }
  msgpack::sbuffer Encode() const;
  static Result<GenerateResponse> Decode(std::span<const std::byte> body);
  bool operator==(const GenerateResponse&) const = default;
};
// Whether a response is the final one (has finish_reason), without reading the rest: what a
// relay needs, whatever else the worker wrote. An error when the body is not a msgpack map.
Result<bool> IsFinalGenerateResponse(std::span<const std::byte> body);

}  // namespace kvrouter
