// Codecs of the router endpoints (docs/protocol.md section 5): route / best_worker / generate
// requests and replies, the lifecycle requests (mark_prefill, free, with section 11's timing),
// stats, and error replies. RouteKind, the endpoint a route request came by, is in
// events/subjects.h with the endpoints' names.
// Decoding never throws. Thread-safe (pure functions).
//
// Grammar (maps keyed by field name, unknown keys ignored, integers of any width):
//   route_req    = {request_id?: str, token_ids?: [u32], block_hashes?: [u64], isl?: u32,
//                   lora_name?: str, mm_items?: [{hash: u64, offset: u32, length: u32}] (section 12),
//                   update_states?: bool (true), priority?: int,
//                   expected_output_tokens?: u32, worker_id?: u64, dp_rank?: u32,
//                   allowed_worker_ids?: [u64], timeout_ms?: u32, max_tokens?: u32 (generate),
//                   session_id?: str, excluded_worker_ids?: [u64]              (section 11),
//                   router_config_override?: {overlap_score_credit?: f64,
//                                             prefill_load_scale?: f64, router_temperature?: f64},
//                   nvext?: {agent_hints?: {priority?: int, osl?: u32}}}
//                  token_ids or (block_hashes and isl) is required; token_ids wins when both come
//                  (block_hashes and isl are then not read). Top-level priority /
//                  expected_output_tokens win over nvext.agent_hints. router_config_override
//                  values are floats or ints, finite and >= 0.
//   route_reply  = {worker_id: u64, dp_rank: u32, overlap_blocks: u32, request_blocks: u32,
//                   cached_tokens: u32, queued_ms: f64,          (all required)
//                   http_url?: str,                              (section 11)
//                   overlap_by_tier?: {device: u32, host_pinned: u32, disk: u32}}  (section 12)
//                  Fields in that order (ForEachRouteReplyField); overlap_by_tier is always sent.
//   lifecycle    = {request_id: str}                             (non-empty)
//   error_reply  = {error: {code: str, message?: str}}
// request_id is at most kMaxNameBytes bytes. Error replies: an unknown code, or "ok", reads as
// kInternal; a malformed error map (not a map, no string code) is kInternal too. Encoders leave
// out unset optionals and fields equal to their default.
// Bounds (what a peer's numbers may make the router hold): every list and string is at most what
// the bytes encode (msgpack_reader.h); a prompt at most --router-max-prompt-tokens, bookings at
// most --router-max-active-requests / --router-max-active-blocks (routing.h); a stats page at
// most kMaxLimit ranks and the max payload.
//
//   Result<RouteRequest> req = DecodeRouteRequest(body);
//   if (!req.ok()) Reply(EncodeErrorReply(req.status()));
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <msgpack.hpp>

#include "events/base/status.h"
#include "events/block_hash.h"
#include "events/subjects.h"  // RouteKind

namespace kvrouter {

struct RouterConfigOverride {
  std::optional<double> overlap_score_credit;
  std::optional<double> prefill_load_scale;
  std::optional<double> router_temperature;
  bool operator==(const RouterConfigOverride&) const = default;
};

// A route request's multimodal items at most (each may touch every block of the prompt).
inline constexpr std::size_t kMaxMmItems = 256;

struct RouteRequest {
  std::string request_id;                // empty = nothing is booked
  std::vector<std::uint32_t> token_ids;  // used when has_token_ids
  bool has_token_ids = false;
  std::vector<std::uint64_t> block_hashes;  // local hashes, when no token_ids
  std::uint32_t isl = 0;                    // token_ids.size() when has_token_ids
  std::string lora_name;
  bool update_states = true;
  std::int64_t priority = 0;
  std::optional<std::uint32_t> expected_output_tokens;
  std::optional<std::uint64_t> worker_id;  // pin
  std::optional<std::uint32_t> dp_rank;
  std::optional<std::vector<std::uint64_t>> allowed_worker_ids;
  RouterConfigOverride config_override;
  std::optional<std::uint32_t> timeout_ms;
  std::optional<std::uint32_t> max_tokens;                        // router.generate: tokens to generate
  std::string session_id;                                         // section 11 session affinity (empty: none)
  std::optional<std::vector<std::uint64_t>> excluded_worker_ids;  // never these workers
  // Multimodal items of token_ids (section 12): they enter the hashes of the blocks they overlap.
  std::vector<MmItem> mm_items;  // at most kMaxMmItems
  bool operator==(const RouteRequest&) const = default;
};
Result<RouteRequest> DecodeRouteRequest(std::span<const std::byte> body);
msgpack::sbuffer EncodeRouteRequest(const RouteRequest& req);

// A prompt's matched prefix per storage tier, cumulative (section 12); on the wire
// {device, host_pinned, disk}.
struct OverlapByTier {
  std::uint32_t device = 0;       // held on device
  std::uint32_t host_pinned = 0;  // held on device or host
  std::uint32_t any_tier = 0;     // held on any tier (the wire's "disk")
  bool operator==(const OverlapByTier&) const = default;
};

struct RouteReply {
  std::uint64_t worker_id = 0;
  std::uint32_t dp_rank = 0;
  std::uint32_t overlap_blocks = 0;  // on device
  // Cumulative per tier (section 12): on device; on device or host; on any tier. Sent never
  // below overlap_blocks (the encoder lifts each figure to it and to the one before); decoded
  // as overlap_blocks three times from routers that do not send it.
  OverlapByTier overlap_by_tier;
  std::uint32_t request_blocks = 0;
  std::uint32_t cached_tokens = 0;
  double queued_ms = 0;
  std::string http_url;  // the chosen worker's, when it announced one (section 11)
  // Section 13: the request goes through the prefill pool. worker_id, dp_rank and http_url then
  // name its decode rank, and cached_tokens is prefill_cached_tokens. The rest is sent only
  // when disaggregated, the bootstrap fields only for kv_connector "sglang".
  bool disaggregated = false;
  std::uint64_t prefill_worker_id = 0;
  std::uint32_t prefill_dp_rank = 0;
  std::string prefill_http_url;
  std::uint32_t prefill_cached_tokens = 0;
  std::string kv_connector;  // the prefill worker's: "nixl" or "sglang"
  std::string bootstrap_host;
  std::uint32_t bootstrap_port = 0;
  std::uint64_t bootstrap_room = 0;
  bool operator==(const RouteReply&) const = default;
};
// RouteReply's wire fields, in their encoded order: EncodeRouteReply and DecodeRouteReply both
// walk this list (events/wire_fields.h says what Required and OmittedWhenEmpty mean). Tiers is
// overlap_by_tier's own rule (see RouteReply). A new reply field is a member above, one line
// here, and its value where the reply is filled (router/service/routing.cc).
template <typename Reply, typename Visitor>  // Reply: RouteReply or const RouteReply
void ForEachRouteReplyField(Reply& r, Visitor&& v) {
  v.Required("worker_id", r.worker_id);
  v.Required("dp_rank", r.dp_rank);
  v.Required("overlap_blocks", r.overlap_blocks);
  v.Required("request_blocks", r.request_blocks);
  v.Required("cached_tokens", r.cached_tokens);
  v.Required("queued_ms", r.queued_ms);
  v.OmittedWhenEmpty("http_url", r.http_url);
  v.Tiers("overlap_by_tier", r.overlap_by_tier);
  v.OmittedWhenFalse("disaggregated", r.disaggregated);
  if (!r.disaggregated) return;  // the decoder has read it by now
  v.Required("prefill_worker_id", r.prefill_worker_id);
  v.Required("prefill_dp_rank", r.prefill_dp_rank);
  v.OmittedWhenEmpty("prefill_http_url", r.prefill_http_url);
  v.Required("prefill_cached_tokens", r.prefill_cached_tokens);
  v.Required("kv_connector", r.kv_connector);
  if (r.kv_connector != "sglang") return;
  v.Required("bootstrap_host", r.bootstrap_host);
  v.Required("bootstrap_port", r.bootstrap_port);
  v.Required("bootstrap_room", r.bootstrap_room);
}
msgpack::sbuffer EncodeRouteReply(const RouteReply& reply);
// A reply body: the RouteReply, or the Status carried by an error reply (code from the wire).
Result<RouteReply> DecodeRouteReply(std::span<const std::byte> body);

// {request_id} of mark_prefill / free.
Result<std::string> DecodeLifecycleRequest(std::span<const std::byte> body);
msgpack::sbuffer EncodeLifecycleRequest(std::string_view request_id);

// How an engine answered a request, as a gateway saw it (section 11), carried by its `free`:
//   {request_id, ttfb_ms?: f64, chunks?: u32, inter_chunk_ms_mean?: f64, inter_chunk_ms_max?: f64}
// ttfb_ms: from the engine call to its first response byte; the inter-chunk times are between
// the response's chunks. The rank's learned rates are taught by them (WorkerRates).
struct ResponseTiming {
  double ttfb_ms = 0;
  std::uint32_t chunks = 0;
  double inter_chunk_ms_mean = 0;
  double inter_chunk_ms_max = 0;
  bool operator==(const ResponseTiming&) const = default;
};
msgpack::sbuffer EncodeLifecycleRequest(std::string_view request_id, const ResponseTiming& timing);
// The timing of a `free`, when it carries one (ttfb_ms present, every number finite and >= 0).
std::optional<ResponseTiming> DecodeResponseTiming(std::span<const std::byte> body);

// router.stats (docs/protocol.md section 5):
//   stats_req   = {offset?: u64 (0), limit?: u32 (1000, at most 10000)}; an empty body or nil
//                 is the defaults; a larger limit is read as 10000.
//   stats_reply = {workers: [{worker_id: u64, dp_rank: u32, blocks: u64, active_blocks: u64,
//                             active_prefill_tokens: u64, active_requests: u32, device: str,
//                             routed_requests: u64, prefill_tokens_per_second: f64,
//                             decode_step_seconds: f64, rate_observations: u64}...],
//                  workers_total: u64, offset: u64, next_offset?: u64,
//                  <counter>: u64 ..., <breakdown>: {<name>: u64 ...} ...}
//                 Counters and breakdowns are open-ended (docs/protocol.md lists the required ones);
//                 next_offset is present when ranks after this page exist.
struct StatsRequest {
  static constexpr std::uint32_t kDefaultLimit = 1000;
  static constexpr std::uint32_t kMaxLimit = 10000;
  std::uint64_t offset = 0;
  std::uint32_t limit = kDefaultLimit;  // <= kMaxLimit
  bool operator==(const StatsRequest&) const = default;
};
Result<StatsRequest> DecodeStatsRequest(std::span<const std::byte> body);
msgpack::sbuffer EncodeStatsRequest(const StatsRequest& req);

struct WorkerStats {
  std::uint64_t worker_id = 0;
  std::uint32_t dp_rank = 0;
  std::uint64_t blocks = 0;  // indexed (or, approximate mode, predicted) blocks
  std::uint64_t active_blocks = 0;
  std::uint64_t active_prefill_tokens = 0;
  std::uint32_t active_requests = 0;
  std::string device;
  std::uint64_t routed_requests = 0;
  // Learned speed (docs/design.md "Learned rates"): the prior's marginal prefill rate and low-load
  // decode step scaled by the rank's factors, and how many requests taught them.
  double prefill_tokens_per_second = 0;
  double decode_step_seconds = 0;
  std::uint64_t rate_observations = 0;
  std::string role = "both";  // section 13: "both", "prefill" or "decode"
  // Registered 30 s ago or more, routed requests, and no KV event of it yet, while the router
  // reads events (docs/operations.md "Silent workers").
  bool without_events = false;
  bool operator==(const WorkerStats&) const = default;
};
// WorkerStats' wire fields in encoded order, walked by its encoder and decoder
// (events/wire_fields.h); the encoder writes every one but without_events, sent only when true.
template <typename Stats, typename Visitor>  // Stats: WorkerStats or const WorkerStats
void ForEachWorkerStatsField(Stats& s, Visitor&& v) {
  v.Required("worker_id", s.worker_id);
  v.Required("dp_rank", s.dp_rank);
  v.Optional("blocks", s.blocks);
  v.Optional("active_blocks", s.active_blocks);
  v.Optional("active_prefill_tokens", s.active_prefill_tokens);
  v.Optional("active_requests", s.active_requests);
  v.Optional("device", s.device);
  v.Optional("routed_requests", s.routed_requests);
  v.Optional("prefill_tokens_per_second", s.prefill_tokens_per_second);
  v.Optional("decode_step_seconds", s.decode_step_seconds);
  v.Optional("rate_observations", s.rate_observations);
  v.Optional("role", s.role);
  v.OmittedWhenFalse("without_events", s.without_events);
}

struct StatsReply {
  std::vector<WorkerStats> workers;  // one page, ascending (worker_id, dp_rank)
  std::uint64_t workers_total = 0;   // ranks known (decoded: offset + page size when absent)
  std::uint64_t offset = 0;          // rank index of workers[0]
  std::optional<std::uint64_t> next_offset;
  std::map<std::string, std::uint64_t> counters;
  std::map<std::string, std::map<std::string, std::uint64_t>> breakdowns;
  bool operator==(const StatsReply&) const = default;
};
// Encodes `reply` in at most max_bytes: when the whole page does not fit, the workers that do
// are kept (in order), the rest dropped, and next_offset points at the first one dropped.
// Internal when even the reply without workers does not fit.
Result<msgpack::sbuffer> EncodeStatsReply(StatsReply& reply, std::size_t max_bytes);
// Unknown keys are ignored, as are values of other shapes; an error reply gives its Status.
Result<StatsReply> DecodeStatsReply(std::span<const std::byte> body);

// {error: {code, message}}; the message is cut to kMaxErrorMessageBytes. status must not be OK.
inline constexpr std::size_t kMaxErrorMessageBytes = 1024;
msgpack::sbuffer EncodeErrorReply(const Status& status);
msgpack::sbuffer EncodeOkReply();  // {"ok": true}
// The error carried by a reply body, or OK when it is not an error reply (a body that is not a
// msgpack map gives InvalidArgument).
Status DecodeErrorReply(std::span<const std::byte> body);

}  // namespace kvrouter
