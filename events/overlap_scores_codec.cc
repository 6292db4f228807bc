#include "events/overlap_scores_codec.h"

#include <algorithm>

#include "events/codec_detail.h"
#include "events/msgpack_reader.h"
#include "events/msgpack_writer.h"

namespace kvrouter {

using namespace codec_detail;

Result<OverlapScoresRequest> DecodeOverlapScoresRequest(std::span<const std::byte> body) {
  OverlapScoresRequest req;
  auto prompt = DecodeRouteRequest(body);
  if (!prompt.ok()) return prompt.status();
  req.prompt = std::move(prompt).value();
  auto doc = ParseMsgpackMap(body, "overlap_scores request");
  if (!doc.ok()) return doc.status();
  if (Status s = ReadPage(doc->get(), req.offset, req.limit); !s.ok()) return s;
  return req;
}

msgpack::sbuffer EncodeOverlapScoresRequest(const OverlapScoresRequest& req) {
  MapWriter w;
  const RouteRequest& p = req.prompt;
  if (p.has_token_ids) {
    w.Field("token_ids", p.token_ids);
  } else {
    w.Field("block_hashes", p.block_hashes).Field("isl", p.isl);
  }
  if (!p.lora_name.empty()) w.Field("lora_name", p.lora_name);
  if (!p.mm_items.empty()) w.Packed("mm_items", AsBytes(EncodeMmItems(p.mm_items)));
  if (req.offset != 0) w.Field("offset", req.offset);
  if (req.limit != StatsRequest::kDefaultLimit) w.Field("limit", req.limit);
  return std::move(w).Finish();
}

Result<msgpack::sbuffer> EncodeOverlapScoresReply(OverlapScoresReply& r, std::size_t max_bytes) {
  std::vector<msgpack::sbuffer> entries;
  entries.reserve(r.scores.size());
  for (const RankOverlap& o : r.scores) {
    const msgpack::sbuffer t = EncodeOverlapByTier(o.overlap_by_tier);
    MapWriter w;
    w.Field("worker_id", o.worker_id).Field("dp_rank", o.dp_rank).Field("overlap_blocks", o.overlap_blocks);
    w.Packed("overlap_by_tier", AsBytes(t));
    entries.push_back(std::move(w).Finish());
  }
  std::size_t keep = 0;
  auto body = EncodePage(
      "overlap_scores", "scores", entries, r.offset, r.workers_total, r.next_offset, max_bytes,
      [&] {
        MapWriter w;
        w.Field("workers_total", r.workers_total).Field("offset", r.offset);
        if (r.next_offset) w.Field("next_offset", *r.next_offset);
        return w;
      },
      keep);
  r.scores.resize(std::min(keep, r.scores.size()));
  return body;
}

Result<OverlapScoresReply> DecodeOverlapScoresReply(std::span<const std::byte> body) {
  auto doc = ParseMsgpackMap(body, "overlap_scores reply");
  if (!doc.ok()) return doc.status();
  const msgpack::object& m = doc->get();
  if (Status error = ErrorOfReply(m); !error.ok()) return error;
  OverlapScoresReply r;
  FieldReads reads;
  reads.Required(m, "workers_total", ReadU64, r.workers_total);
  reads.Optional(m, "offset", ReadU64, r.offset);
  reads.Optional(m, "next_offset", ReadU64, r.next_offset);
  auto scores = ReadArray(FindKey(m, "scores"), "scores");
  if (!scores.ok()) reads.Fail(scores.status());
  if (!reads.ok()) return reads.status();
  for (const msgpack::object& o : *scores) {
    RankOverlap x;
    reads.Required(o, "worker_id", ReadU64, x.worker_id);
    reads.Required(o, "dp_rank", ReadU32, x.dp_rank);
    reads.Required(o, "overlap_blocks", ReadU32, x.overlap_blocks);
    if (reads.ok()) {
      if (Status s = ReadOverlapByTier(o, x.overlap_by_tier); !s.ok()) reads.Fail(s);
    }
    if (!reads.ok()) return InvalidArgument("scores: " + reads.status().message());
    r.scores.push_back(x);
  }
  return r;
}

}  // namespace kvrouter
