// Codec of router.dump (docs/protocol.md section 12): one replica's index handed to another, a
// page of ranks' stored chains at a time. Decoding never throws. Thread-safe (pure functions;
// a DumpReplyWriter is one caller's).
//
//   DumpReplyWriter w(router_id, max_bytes);  w.Add(...);  body = std::move(w).Finish(...);
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <msgpack.hpp>

#include "events/base/status.h"
#include "events/kv_event.h"

namespace kvrouter {

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

}  // namespace kvrouter
