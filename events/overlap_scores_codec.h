// Codec of router.overlap_scores (docs/protocol.md section 12, Dynamo's get_overlap_scores):
// every rank's matched prefix of a prompt, per storage tier, paged as stats is.
// Decoding never throws. Thread-safe (pure functions).
//
//   Result<OverlapScoresRequest> req = DecodeOverlapScoresRequest(body);
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include <msgpack.hpp>

#include "events/base/status.h"
#include "events/router_endpoints_codec.h"

namespace kvrouter {

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

}  // namespace kvrouter
