// Codecs of the router's own publications (docs/protocol.md section 8): replica sync, replica
// heartbeats (kvrouter's extension) and kv_metrics. Subjects: events/subjects.h.
// Decoding never throws. Thread-safe (pure functions).
// Bounds: request_id and session_id at most kMaxNameBytes; a sync add is obeyed only for a known
// rank within the router's bounds (routing.h), and at most 4,096 peers are tracked (replica_peers.h).
//
//   Result<RouterHeartbeat> h = DecodeRouterHeartbeat(body);
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <msgpack.hpp>

#include "events/base/status.h"

namespace kvrouter {

// Router replica sync (docs/protocol.md section 8), on
// namespace.{ns}.component.{comp}.active_sequences_events:
//   {router_id: u64, request_id: str, worker_id: u64, dp_rank: u32,
//    kind: "add"|"prefill_done"|"free", seq_hashes?: [u64], isl?: u32, overlap_blocks?: u32,
//    epoch?: u32 (0; kvrouter's extension: the sender's epoch, see RouterHeartbeat)}
struct ActiveSequenceEvent {
  enum class Kind { kAdd, kPrefillDone, kFree };
  std::uint64_t router_id = 0;
  std::string request_id;  // non-empty
  std::uint64_t worker_id = 0;
  std::uint32_t dp_rank = 0;
  Kind kind = Kind::kAdd;
  std::vector<std::uint64_t> seq_hashes;
  std::uint32_t isl = 0;
  std::uint32_t overlap_blocks = 0;
  std::uint32_t epoch = 0;
  std::string session_id;  // kAdd: the session the booking binds to its worker (empty: none)
  bool operator==(const ActiveSequenceEvent&) const = default;
};
Result<ActiveSequenceEvent> DecodeActiveSequenceEvent(std::span<const std::byte> body);
msgpack::sbuffer EncodeActiveSequenceEvent(const ActiveSequenceEvent& event);

// A router replica's heartbeat (kvrouter's extension of section 8), once a second on
// namespace.{ns}.component.{comp}.router_heartbeats:
//   {router_id: u64, interval_ms: u32, epoch?: u32 (0)}
// Replicas that stop sending it for a while are dead: their synced bookings are released.
// `epoch` goes up each time the replica's NATS connection comes back: sync messages around its
// outage may be lost, so peers drop its bookings and both sides send their live ones again.
struct RouterHeartbeat {
  std::uint64_t router_id = 0;
  std::uint32_t interval_ms = 1000;
  std::uint32_t epoch = 0;
  bool operator==(const RouterHeartbeat&) const = default;
};
// RouterHeartbeat's wire fields in encoded order, walked by its encoder and decoder
// (events/wire_fields.h); the encoder writes every one.
template <typename Heartbeat, typename Visitor>  // Heartbeat: RouterHeartbeat or const RouterHeartbeat
void ForEachRouterHeartbeatField(Heartbeat& h, Visitor&& v) {
  v.Required("router_id", h.router_id);
  v.Optional("interval_ms", h.interval_ms);
  v.Optional("epoch", h.epoch);
}
Result<RouterHeartbeat> DecodeRouterHeartbeat(std::span<const std::byte> body);
msgpack::sbuffer EncodeRouterHeartbeat(const RouterHeartbeat& heartbeat);

// Load gauges of one worker rank (docs/protocol.md section 8), on namespace.{ns}.kv_metrics:
//   {worker_id: u64, dp_rank?: u32 (0), active_decode_blocks: u64, active_prefill_tokens: u64}
// The encoder writes every field.
struct KvMetrics {
  std::uint64_t worker_id = 0;
  std::uint32_t dp_rank = 0;
  std::uint64_t active_decode_blocks = 0;   // distinct blocks of the requests booked there
  std::uint64_t active_prefill_tokens = 0;  // prompt tokens booked there and not yet prefilled
  bool operator==(const KvMetrics&) const = default;
};
// KvMetrics' wire fields in encoded order, walked by its encoder and decoder (events/wire_fields.h).
template <typename Metrics, typename Visitor>  // Metrics: KvMetrics or const KvMetrics
void ForEachKvMetricsField(Metrics& k, Visitor&& v) {
  v.Required("worker_id", k.worker_id);
  v.Optional("dp_rank", k.dp_rank);
  v.Required("active_decode_blocks", k.active_decode_blocks);
  v.Required("active_prefill_tokens", k.active_prefill_tokens);
}
Result<KvMetrics> DecodeKvMetrics(std::span<const std::byte> body);
msgpack::sbuffer EncodeKvMetrics(const KvMetrics& metrics);

}  // namespace kvrouter
