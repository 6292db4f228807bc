// Codecs for worker registration (docs/protocol.md section 4) and the router endpoints (section 5):
// route / best_worker requests and replies, lifecycle requests, error replies; and the router's
// own messages of section 8 (replica sync, kv_metrics).
//
// Grammar (maps keyed by field name, unknown keys ignored, integers of any width):
//   registration = {worker_id: u64, dp_start?: u32 (0), dp_size?: u32 (1), block_size?: u32,
//                   total_kv_blocks?: u64 (0), max_num_seqs?: u32 (256),
//                   max_num_batched_tokens?: u32 (8192), device?: str ("gpu"),
//                   lease_ms?: u32 (3000), status?: "up"|"leaving" ("up"),
//                   http_url?: str (""), models?: [str]}                          (section 11)
//   route_req    = {request_id?: str, token_ids?: [u32], block_hashes?: [u64], isl?: u32,
//                   lora_name?: str, update_states?: bool (true), priority?: int,
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
//                   http_url?: str}                              (section 11)
//   lifecycle    = {request_id: str}                             (non-empty)
//   error_reply  = {error: {code: str, message?: str}}
// Registration: dp_size 0, dp_start + dp_size above 2^32-1, or another status is an
// InvalidArgument; lease_ms (any u64) is clamped to [kMinLeaseMs, kMaxLeaseMs]. The router's own
// bound on dp_size (--router-max-dp-size) is checked by the registry, not here. request_id and
// device are at most kMaxNameBytes bytes; http_url starts with http:// and is at most kMaxUrlBytes
// (trailing slashes dropped), models at most kMaxModels names of kMaxNameBytes. Error replies: an unknown code, or "ok", reads as kInternal; a malformed
// error map (not a map, no string code) is kInternal too. Encoders leave out unset optionals
// and fields equal to their default.
// Decoding never throws. Thread-safe (pure functions).
// Bounds (what a peer's numbers may make the router hold): every list and string is at most what
// the bytes encode (msgpack_reader.h); request_id and device at most kMaxNameBytes; lease_ms
// clamped; dp_size at most --router-max-dp-size and workers at most --router-max-worker-ranks
// (worker_registry.h); a prompt at most --router-max-prompt-tokens, bookings at most
// --router-max-active-requests / --router-max-active-blocks, a replica-sync add only for a known
// rank within those bounds (routing.h); a stats page at most kMaxLimit ranks and the max payload.
//
//   Result<RouteRequest> req = DecodeRouteRequest(body);
//   if (!req.ok()) Reply(EncodeErrorReply(req.status()));
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <msgpack.hpp>

#include "events/base/status.h"
#include "events/kv_event.h"
#include "events/block_hash.h"

namespace kvrouter {

inline constexpr std::uint32_t kMinLeaseMs = 100;
inline constexpr std::uint32_t kMaxLeaseMs = 3'600'000;

// A registration's `status` (section 4): a worker that is up, or one about to go.
enum class WorkerStatus { kUp, kLeaving };

// Bounds on what a registration may carry (section 11), so a peer cannot grow a worker's entry.
inline constexpr std::size_t kMaxUrlBytes = 2048;
inline constexpr std::size_t kMaxModels = 64;

// dp ranks a worker may have, [0, kMaxDpRanks): the index keeps a rank's other storage tiers
// under the higher ranks (router/index/block_index.h, TierRank).
inline constexpr std::uint64_t kMaxDpRanks = 1u << 30;

struct WorkerRegistration {
  std::uint64_t worker_id = 0;
  std::uint32_t dp_start = 0;
  std::uint32_t dp_size = 1;                // must be >= 1
  std::optional<std::uint32_t> block_size;  // absent = the router's
  std::uint64_t total_kv_blocks = 0;        // 0 = unknown
  std::uint32_t max_num_seqs = 256;
  std::uint32_t max_num_batched_tokens = 8192;
  std::string device = "gpu";
  std::uint32_t lease_ms = 3000;
  bool leaving = false;  // status "leaving"
  // Section 11: the engine's OpenAI base URL ("http://host:port", no trailing slash; empty: it
  // serves no HTTP) and the model names it serves.
  std::string http_url;
  std::vector<std::string> models;
  bool operator==(const WorkerRegistration&) const = default;
};
Result<WorkerRegistration> DecodeWorkerRegistration(std::span<const std::byte> body);
msgpack::sbuffer EncodeWorkerRegistration(const WorkerRegistration& reg);

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

struct OverlapByTier {
  std::uint32_t device = 0;
  std::uint32_t host_pinned = 0;
  std::uint32_t disk = 0;
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
  bool operator==(const RouteReply&) const = default;
};
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
Result<KvMetrics> DecodeKvMetrics(std::span<const std::byte> body);
msgpack::sbuffer EncodeKvMetrics(const KvMetrics& metrics);

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
  bool operator==(const WorkerStats&) const = default;
};

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

// router.overlap_scores (docs/protocol.md section 12), Dynamo's get_overlap_scores:
//   request = {token_ids | block_hashes (+ isl), lora_name?, offset?: u64 (0), limit?: u32 (1000,
//              at most 10000; larger reads as 10000)}: the prompt as in a route request
//   reply   = {scores: [{worker_id: u64, dp_rank: u32, overlap_blocks: u32,
//                        overlap_by_tier: {device: u32, host_pinned: u32, disk: u32}}...],
//              workers_total: u64, offset: u64, next_offset?: u64}
//   Every known rank, ascending (worker_id, dp_rank), paged as stats is (next_offset present when
//   ranks after this page exist). overlap_by_tier is cumulative: on device; on device or host;
//   on any tier.
struct OverlapScoresRequest {
  RouteRequest prompt;  // token_ids, or block_hashes with isl, and lora_name; nothing else read
  std::uint64_t offset = 0;
  std::uint32_t limit = StatsRequest::kDefaultLimit;  // <= StatsRequest::kMaxLimit
};
Result<OverlapScoresRequest> DecodeOverlapScoresRequest(std::span<const std::byte> body);
msgpack::sbuffer EncodeOverlapScoresRequest(const OverlapScoresRequest& req);

struct RankOverlap {
  std::uint64_t worker_id = 0;
  std::uint32_t dp_rank = 0;
  std::uint32_t overlap_blocks = 0;  // on device
  OverlapByTier overlap_by_tier;
  bool operator==(const RankOverlap&) const = default;
};

struct OverlapScoresReply {
  std::vector<RankOverlap> scores;  // one page, ascending (worker_id, dp_rank)
  std::uint64_t workers_total = 0;
  std::uint64_t offset = 0;
  std::optional<std::uint64_t> next_offset;
  bool operator==(const OverlapScoresReply&) const = default;
};
// Encodes `reply` in at most max_bytes as EncodeStatsReply does: the scores that fit are kept
// and next_offset points at the first one dropped.
Result<msgpack::sbuffer> EncodeOverlapScoresReply(OverlapScoresReply& reply, std::size_t max_bytes);
Result<OverlapScoresReply> DecodeOverlapScoresReply(std::span<const std::byte> body);

// router.dump (docs/protocol.md section 12): a replica's whole index, a page at a time.
//   request = {router_id: u64 (the asker's; a replica never answers its own), offset?: u64 (0),
//              chain_offset?: u64 (0), max_parts?: u32 (1, at most kMaxDumpParts)}: from the
//              offset-th rank (ascending (worker_id, dp_rank)); an offset of a reply's next_offset
//              may also name a chain in it (DumpCursor). Up to max_parts replies to the one request,
//              each saying where the next starts; with max_parts > 1 the last of them also ends
//              a rank (more parts are sent to finish it), so no rank spans two asks.
//   reply   = {workers: [{worker_id: u64, dp_rank: u32, last_event_id: u64, id_kind?: "event_id" |
//                         "kv_seq", chains: [KvCacheEvent with storage_tier...], partial?: bool}...],
//              more: bool, next_offset?: u64, next_chain?: u64, router_id: u64 (the answerer's)}
//   A chain is a §6 dump event ({event_id: the rank's last_event_id, dp_rank, storage_tier, data:
//   {stored: ...}}). partial: the rank's chains go on in the next part (next_offset is then a
//   cursor into it, next_chain its first chain there). id_kind says how last_event_id counts (§6
//   ids: vLLM's Kv-Seq + 1); absent: no numbered event yet.
// A position in a dump: the rank's index, and the first chain of it to send (0: all).
struct DumpCursor {
  static constexpr unsigned kChainShift = 40;  // ranks below 2^40; a cursor of chain 0 is the index
  std::uint64_t rank = 0;
  std::uint64_t chain = 0;
  static DumpCursor Of(std::uint64_t offset) {
    return {offset & ((std::uint64_t{1} << kChainShift) - 1), offset >> kChainShift};
  }
  std::uint64_t offset() const { return rank | (chain << kChainShift); }
};
inline constexpr std::uint32_t kMaxDumpParts = 64;
struct DumpRequest {
  std::uint64_t router_id = 0;
  std::uint64_t offset = 0;
  std::uint64_t chain_offset = 0;
  std::uint32_t max_parts = 1;  // read as at most kMaxDumpParts (and at least 1)
  bool operator==(const DumpRequest&) const = default;
};
Result<DumpRequest> DecodeDumpRequest(std::span<const std::byte> body);
msgpack::sbuffer EncodeDumpRequest(const DumpRequest& req);

struct DumpedRank {
  std::uint64_t worker_id = 0;
  std::uint32_t dp_rank = 0;
  std::uint64_t last_event_id = 0;
  SequenceKind numbering = SequenceKind::kNone;
  std::vector<DumpedChain> chains;
  bool partial = false;
  bool operator==(const DumpedRank&) const = default;
};

struct DumpReply {
  std::vector<DumpedRank> workers;
  bool more = false;
  std::uint64_t next_offset = 0;  // when more
  std::uint64_t next_chain = 0;
  std::uint64_t router_id = 0;
  bool operator==(const DumpReply&) const = default;
};
// Chains whose ops are not stored chains are InvalidArgument; an error reply gives its Status.
Result<DumpReply> DecodeDumpReply(std::span<const std::byte> body);

// Writes one dump reply of at most max_bytes, rank by rank.
//   DumpReplyWriter w(router_id, max_bytes);  n = w.Add(worker_id, rank, last, numbering, chains);
//   msgpack::sbuffer body = std::move(w).Finish(more, next_offset, next_chain);
class DumpReplyWriter {
 public:
  DumpReplyWriter(std::uint64_t router_id, std::size_t max_bytes);
  // Adds the rank with as many of `chains` as fit, in order; returns how many went in. Fewer than
  // all: the rank is marked partial (or, when none went in, left out: the page is full). A rank
  // whose first chain does not fit an empty page is InvalidArgument.
  Result<std::size_t> Add(std::uint64_t worker_id, std::uint32_t dp_rank, std::uint64_t last_event_id,
                          SequenceKind numbering, std::span<const DumpedChain> chains);
  std::size_t ranks() const { return ranks_; }
  msgpack::sbuffer Finish(bool more, std::uint64_t next_offset, std::uint64_t next_chain) &&;

 private:
  std::uint64_t router_id_;
  std::size_t max_bytes_;
  std::size_t used_;  // bytes the reply needs so far, the fixed part at its widest
  std::size_t ranks_ = 0;
  msgpack::sbuffer workers_;  // the packed rank maps, without the array header
};

// {error: {code, message}}; the message is cut to kMaxErrorMessageBytes. status must not be OK.
inline constexpr std::size_t kMaxErrorMessageBytes = 1024;
msgpack::sbuffer EncodeErrorReply(const Status& status);
msgpack::sbuffer EncodeOkReply();  // {"ok": true}
// The error carried by a reply body, or OK when it is not an error reply (a body that is not a
// msgpack map gives InvalidArgument).
Status DecodeErrorReply(std::span<const std::byte> body);

}  // namespace kvrouter
