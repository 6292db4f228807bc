#include "events/peer_dump_codec.h"

#include <fmt/format.h>

#include <algorithm>

#include "events/codec_detail.h"
#include "events/event_codec.h"
#include "events/msgpack_reader.h"
#include "events/msgpack_writer.h"

namespace kvrouter {

using codec_detail::ErrorOfReply;

Result<DumpRequest> DecodeDumpRequest(std::span<const std::byte> body) {
  auto doc = ParseMsgpackMap(body, "dump request");
  if (!doc.ok()) return doc.status();
  DumpRequest req;
  FieldReads reads;
  reads.Required(doc->get(), "router_id", ReadU64, req.router_id);
  reads.Optional(doc->get(), "offset", ReadU64, req.offset);
  reads.Optional(doc->get(), "chain_offset", ReadU64, req.chain_offset);
  std::uint64_t parts = 1;
  reads.Optional(doc->get(), "max_parts", ReadU64, parts);
  if (!reads.ok()) return reads.status();
  req.max_parts = static_cast<std::uint32_t>(std::clamp<std::uint64_t>(parts, 1, kMaxDumpParts));
  return req;
}

msgpack::sbuffer EncodeDumpRequest(const DumpRequest& req) {
  MapWriter w;
  w.Field("router_id", req.router_id).Field("offset", req.offset);
  if (req.chain_offset != 0) w.Field("chain_offset", req.chain_offset);
  if (req.max_parts != 1) w.Field("max_parts", req.max_parts);
  return std::move(w).Finish();
}

namespace {

std::string_view IdKindName(SequenceKind k) { return k == SequenceKind::kVllmSeq ? "kv_seq" : "event_id"; }

// The widest a key and u64 value take: a fixstr key, a 9-byte uint.
constexpr std::size_t FieldBytes(std::string_view key) { return 1 + key.size() + 9; }

}  // namespace

DumpReplyWriter::DumpReplyWriter(std::uint64_t router_id, std::size_t max_bytes)
    : router_id_(router_id),
      max_bytes_(max_bytes),
      used_(5 /* map */ + 8 /* "workers" */ + 5 /* array */ + 6 + 1 /* more */ + FieldBytes("next_offset") +
            FieldBytes("next_chain") + FieldBytes("router_id")) {}

Result<std::size_t> DumpReplyWriter::Add(std::uint64_t worker_id, std::uint32_t dp_rank, std::uint64_t last_event_id,
                                         SequenceKind numbering, std::span<const DumpedChain> chains) {
  // The rank's map without its chains, at its widest (partial included).
  const std::size_t head = 1 + FieldBytes("worker_id") + FieldBytes("dp_rank") + FieldBytes("last_event_id") + 1 + 7 +
                           1 + 8 /* id_kind */ + 7 + 5 /* chains */ + 8 + 1 /* partial */;
  if (used_ + head > max_bytes_) return std::size_t{0};
  msgpack::sbuffer packed;
  msgpack::sbuffer one;
  std::size_t n = 0;
  for (; n < chains.size(); ++n) {
    const std::size_t room = max_bytes_ - std::min(max_bytes_, used_ + head + packed.size());
    if (kStoredEventBytes + kStoredBlockBytes * chains[n].stored.blocks.size() <= room) {
      PackStoredEvent(packed, last_event_id, dp_rank, chains[n].tier, chains[n].stored);  // surely fits
      continue;
    }
    one.clear();  // near the limit: packed aside and measured
    PackStoredEvent(one, last_event_id, dp_rank, chains[n].tier, chains[n].stored);
    if (one.size() > room) break;
    packed.write(one.data(), one.size());
  }
  if (n == 0 && !chains.empty()) {
    if (ranks_ == 0) {
      return InvalidArgument(fmt::format("a chain of worker {} rank {} needs {} bytes; the limit is {}", worker_id,
                                         dp_rank, used_ + head + one.size(), max_bytes_));
    }
    return std::size_t{0};
  }
  MapWriter w;
  w.Field("worker_id", worker_id).Field("dp_rank", dp_rank).Field("last_event_id", last_event_id);
  if (numbering != SequenceKind::kNone) w.Field("id_kind", IdKindName(numbering));
  w.With("chains", [&](msgpack::sbuffer& out) {
    msgpack::packer<msgpack::sbuffer>(out).pack_array(static_cast<std::uint32_t>(n));
    out.write(packed.data(), packed.size());
  });
  if (n < chains.size()) w.Field("partial", true);
  const std::size_t before = workers_.size();
  w.AppendTo(workers_);
  used_ += workers_.size() - before;
  ++ranks_;
  return n;
}

msgpack::sbuffer DumpReplyWriter::Finish(bool more, std::uint64_t next_offset, std::uint64_t next_chain) && {
  MapWriter w;
  w.With("workers", [&](msgpack::sbuffer& out) {
    msgpack::packer<msgpack::sbuffer>(out).pack_array(static_cast<std::uint32_t>(ranks_));
    out.write(workers_.data(), workers_.size());
  });
  w.Field("more", more);
  if (more) {
    w.Field("next_offset", next_offset);
    if (next_chain != 0) w.Field("next_chain", next_chain);
  }
  w.Field("router_id", router_id_);
  return std::move(w).Finish();
}

Result<DumpReply> DecodeDumpReply(std::span<const std::byte> body) {
  auto doc = ParseMsgpackMap(body, "dump reply");
  if (!doc.ok()) return doc.status();
  const msgpack::object& m = doc->get();
  if (Status error = ErrorOfReply(m); !error.ok()) return error;
  DumpReply r;
  FieldReads reads;
  reads.Optional(m, "more", ReadBool, r.more);
  reads.Optional(m, "next_offset", ReadU64, r.next_offset);
  reads.Optional(m, "next_chain", ReadU64, r.next_chain);
  reads.Optional(m, "router_id", ReadU64, r.router_id);
  auto workers = ReadArray(FindKey(m, "workers"), "workers");
  if (!workers.ok()) reads.Fail(workers.status());
  if (!reads.ok()) return reads.status();
  r.workers.reserve(workers->size());  // bounded by the bytes read
  for (const msgpack::object& o : *workers) {
    DumpedRank& d = r.workers.emplace_back();
    std::optional<std::string_view> id_kind;
    reads.Required(o, "worker_id", ReadU64, d.worker_id);
    reads.Required(o, "dp_rank", ReadU32, d.dp_rank);
    reads.Optional(o, "last_event_id", ReadU64, d.last_event_id);
    reads.Optional(o, "id_kind", ReadStr, id_kind);
    reads.Optional(o, "partial", ReadBool, d.partial);
    auto chains = ReadArray(FindKey(o, "chains"), "chains");
    if (!chains.ok()) reads.Fail(chains.status());
    if (!reads.ok()) return InvalidArgument("workers: " + reads.status().message());
    if (id_kind) {
      if (*id_kind == "kv_seq") {
        d.numbering = SequenceKind::kVllmSeq;
      } else if (*id_kind == "event_id") {
        d.numbering = SequenceKind::kEventId;
      } else {
        return InvalidArgument(fmt::format("workers: unknown id_kind '{}'", *id_kind));
      }
    }
    d.chains.reserve(chains->size());
    for (const msgpack::object& c : *chains) {
      auto b = DecodeKvCacheEvent(c, d.worker_id, StorageTier::kDevice);
      if (!b.ok()) return InvalidArgument("chains: " + b.status().message());
      auto* stored = std::get_if<KvStored>(&b->ops.front().data);
      if (stored == nullptr) return InvalidArgument("chains: a chain must be a stored event");
      d.chains.push_back({b->ops.front().tier, std::move(*stored)});
    }
  }
  return r;
}

}  // namespace kvrouter
