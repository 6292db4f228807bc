#include "events/replica_sync_codec.h"

#include <fmt/format.h>

#include "events/msgpack_reader.h"
#include "events/msgpack_writer.h"
#include "events/wire_fields.h"

namespace kvrouter {

Result<ActiveSequenceEvent> DecodeActiveSequenceEvent(std::span<const std::byte> body) {
  auto doc = ParseMsgpackMap(body, "active sequence event");
  if (!doc.ok()) return doc.status();
  const msgpack::object& m = doc->get();
  ActiveSequenceEvent e;
  std::string_view request_id, kind;
  FieldReads reads;
  reads.Required(m, "router_id", ReadU64, e.router_id);
  reads.Required(m, "request_id", ReadName, request_id);
  reads.Required(m, "worker_id", ReadU64, e.worker_id);
  reads.Optional(m, "dp_rank", ReadU32, e.dp_rank);
  reads.Required(m, "kind", ReadStr, kind);
  reads.Optional(m, "seq_hashes", ReadU64BitsArray, e.seq_hashes);
  reads.Optional(m, "isl", ReadU32, e.isl);
  reads.Optional(m, "overlap_blocks", ReadU32, e.overlap_blocks);
  reads.Optional(m, "epoch", ReadU32, e.epoch);
  reads.Optional(m, "session_id", ReadName, e.session_id);
  if (!reads.ok()) return reads.status();
  if (request_id.empty()) return InvalidArgument("field 'request_id' must not be empty");
  e.request_id = std::string(request_id);
  if (kind == "add")
    e.kind = ActiveSequenceEvent::Kind::kAdd;
  else if (kind == "prefill_done")
    e.kind = ActiveSequenceEvent::Kind::kPrefillDone;
  else if (kind == "free")
    e.kind = ActiveSequenceEvent::Kind::kFree;
  else
    return InvalidArgument(fmt::format("field 'kind' must be add, prefill_done or free, not '{}'", kind.substr(0, 32)));
  return e;
}

Result<RouterHeartbeat> DecodeRouterHeartbeat(std::span<const std::byte> body) {
  auto doc = ParseMsgpackMap(body, "router heartbeat");
  if (!doc.ok()) return doc.status();
  RouterHeartbeat h;
  FieldReads reads;
  ForEachRouterHeartbeatField(h, FieldDecoder{doc->get(), reads});
  if (!reads.ok()) return reads.status();
  return h;
}

msgpack::sbuffer EncodeRouterHeartbeat(const RouterHeartbeat& h) {
  MapWriter w;
  ForEachRouterHeartbeatField(h, FieldEncoder{w});
  return std::move(w).Finish();
}

msgpack::sbuffer EncodeActiveSequenceEvent(const ActiveSequenceEvent& e) {
  const std::string_view kind = e.kind == ActiveSequenceEvent::Kind::kAdd           ? "add"
                                : e.kind == ActiveSequenceEvent::Kind::kPrefillDone ? "prefill_done"
                                                                                    : "free";
  MapWriter w;
  w.Field("router_id", e.router_id)
      .Field("request_id", e.request_id)
      .Field("worker_id", e.worker_id)
      .Field("dp_rank", e.dp_rank)
      .Field("kind", kind)
      .Field("seq_hashes", e.seq_hashes)
      .Field("isl", e.isl)
      .Field("overlap_blocks", e.overlap_blocks)
      .Field("epoch", e.epoch);
  if (!e.session_id.empty()) w.Field("session_id", e.session_id);
  return std::move(w).Finish();
}

Result<KvMetrics> DecodeKvMetrics(std::span<const std::byte> body) {
  auto doc = ParseMsgpackMap(body, "kv_metrics");
  if (!doc.ok()) return doc.status();
  const msgpack::object& m = doc->get();
  KvMetrics k;
  FieldReads reads;
  ForEachKvMetricsField(k, FieldDecoder{m, reads});
  if (!reads.ok()) return reads.status();
  return k;
}

msgpack::sbuffer EncodeKvMetrics(const KvMetrics& k) {
  MapWriter w;
  ForEachKvMetricsField(k, FieldEncoder{w});
  return std::move(w).Finish();
}

}  // namespace kvrouter
