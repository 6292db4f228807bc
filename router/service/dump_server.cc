#include "router/service/dump_server.h"

#include <algorithm>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "events/peer_dump_codec.h"
#include "events/msgpack_reader.h"

namespace kvrouter {

DumpServer::DumpServer(const ShardedIndex& index, MessageBus& bus, std::uint64_t router_id, RateLimitedLog& log,
                       ReplyError reply_error)
    : index_(index), bus_(bus), router_id_(router_id), log_(log), reply_error_(std::move(reply_error)) {}

void DumpServer::Serve(const BusMessage& m, Warmth warmth) {
  if (m.reply.empty()) return;
  auto req = DecodeDumpRequest(m.data);
  if (!req.ok()) {
    reply_error_(m, req.status());
    return;
  }
  if (req->router_id == router_id_ || warmth != Warmth::kWarm) return;  // its own ask; or not the fleet's index yet
  const std::vector<WorkerKey> ranks = index_.DumpableRanks();
  const DumpCursor from = DumpCursor::Of(req->offset);
  std::uint64_t offset = from.rank, chain_offset = std::max(from.chain, req->chain_offset);
  // An asker of several parts gets whole ranks: each ask ends at a rank's end, so a rank never
  // spans two asks (two moments of the index, whose chains may come in another order).
  const bool whole_ranks = req->max_parts > 1;
  // The rank being written, dumped once however many parts it spans.
  std::optional<RankDump> rank;
  std::uint64_t rank_index = ~std::uint64_t{0};
  for (std::uint32_t part = 1;; ++part) {
    DumpReplyWriter page(router_id_, bus_.MaxPayload());
    bool more = false;
    std::uint64_t next_offset = 0, next_chain = 0;
    for (std::uint64_t i = offset; i < ranks.size(); ++i) {
      if (part > req->max_parts && i != offset) {  // past max_parts only to finish the open rank
        more = true;
        next_offset = i;
        break;
      }
      if (i != rank_index) {
        rank = index_.DumpRank(ranks[i]);
        rank_index = i;
      }
      if (!rank) continue;  // still recovering: the asker gets it from its worker
      const std::uint64_t first = i == offset ? std::min<std::uint64_t>(chain_offset, rank->chains.size()) : 0;
      const std::span<const DumpedChain> chains = std::span(rank->chains).subspan(first);
      const std::size_t ranks_before = page.ranks();
      auto n = page.Add(rank->rank.worker_id, rank->rank.dp_rank, rank->last_event_id, rank->numbering, chains);
      if (!n.ok()) {
        reply_error_(m, n.status());
        return;
      }
      if (page.ranks() == ranks_before || *n < chains.size()) {  // the page is full
        more = true;
        next_offset = i;
        next_chain = page.ranks() == ranks_before ? first : first + *n;
        break;
      }
    }
    const msgpack::sbuffer body =
        std::move(page).Finish(more, DumpCursor{next_offset, next_chain}.offset(), next_chain);
    pages_served_.fetch_add(1, std::memory_order_relaxed);
    if (Status s = bus_.Publish(m.reply, AsBytes(body)); !s.ok()) {
      log_.Log(LogLevel::kWarning, "reply", "dump reply to {} failed: {}", m.subject, s.message());
      return;
    }
    if (!more) return;
    offset = next_offset;
    chain_offset = next_chain;
    if (part >= req->max_parts && (!whole_ranks || chain_offset == 0)) return;
  }
}

}  // namespace kvrouter
