#include "events/message_codec.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "events/msgpack_reader.h"
#include "events/msgpack_writer.h"

namespace kvrouter {
namespace {

using Packer = msgpack::packer<msgpack::sbuffer>;


Result<bool> ReadLeaving(const msgpack::object* o, std::string_view field) {
  auto status = ReadStr(o, field);
  if (!status.ok()) return status.status();
  if (*status == "up") return false;
  if (*status == "leaving") return true;
  return InvalidArgument(fmt::format("field '{}' must be \"up\" or \"leaving\", not '{}'", field,
                                     status->substr(0, 32)));
}

// A router_config_override weight: a finite, non-negative number (float or int).
Result<double> ReadWeight(const msgpack::object* o, std::string_view field) {
  auto v = ReadF64(o, field);
  if (!v.ok()) return v.status();
  if (!std::isfinite(*v) || *v < 0) {
    return InvalidArgument(fmt::format("field '{}' must be a finite non-negative number", field));
  }
  return *v;
}

// The map under `key`, or nullptr when absent or nil; a non-map is an error.
Result<const msgpack::object*> ReadOptionalMap(const msgpack::object& parent,
                                               std::string_view key) {
  const msgpack::object* o = FindKey(parent, key);
  if (IsNil(o)) return static_cast<const msgpack::object*>(nullptr);
  if (!IsMap(*o)) return InvalidArgument(fmt::format("field '{}' must be a map", key));
  return o;
}

// The Status of an error reply `root`, or OK when root has no "error" key.
Status ErrorOfReply(const msgpack::object& root) {
  const msgpack::object* error = FindKey(root, "error");
  if (error == nullptr) return Status::Ok();
  std::string_view code;
  std::string_view message;
  FieldReads reads;
  if (!IsMap(*error)) reads.Fail(InvalidArgument("field 'error' must be a map"));
  reads.Required(*error, "code", ReadStr, code);
  reads.Optional(*error, "message", ReadStr, message);
  if (!reads.ok()) return Internal("malformed error reply: " + reads.status().message());
  StatusCode status_code = StatusCodeFromName(code);
  if (status_code == StatusCode::kOk) status_code = StatusCode::kInternal;  // "ok" is no error
  return {status_code, std::string(message)};
}

void PackU64Array(Packer& pk, const std::vector<std::uint64_t>& values) {
  pk.pack_array(static_cast<std::uint32_t>(values.size()));
  for (std::uint64_t v : values) pk.pack_uint64(v);
}

}  // namespace

Result<WorkerRegistration> DecodeWorkerRegistration(std::span<const std::byte> body) {
  auto doc = ParseMsgpackMap(body, "worker registration");
  if (!doc.ok()) return doc.status();
  const msgpack::object& m = doc->get();
  WorkerRegistration reg;
  FieldReads reads;
  reads.Required(m, "worker_id", ReadU64, reg.worker_id);
  reads.Optional(m, "dp_start", ReadU32, reg.dp_start);
  reads.Optional(m, "dp_size", ReadU32, reg.dp_size);
  reads.Optional(m, "block_size", ReadU32, reg.block_size);
  reads.Optional(m, "total_kv_blocks", ReadU64, reg.total_kv_blocks);
  reads.Optional(m, "max_num_seqs", ReadU32, reg.max_num_seqs);
  reads.Optional(m, "max_num_batched_tokens", ReadU32, reg.max_num_batched_tokens);
  reads.Optional(m, "device", ReadName, reg.device);
  std::uint64_t lease_ms = reg.lease_ms;
  reads.Optional(m, "lease_ms", ReadU64, lease_ms);
  reads.Optional(m, "status", ReadLeaving, reg.leaving);
  if (!reads.ok()) return reads.status();
  if (reg.dp_size == 0) return InvalidArgument("field 'dp_size' must be at least 1");
  if (std::uint64_t{reg.dp_start} + reg.dp_size > std::numeric_limits<std::uint32_t>::max()) {
    return InvalidArgument("fields 'dp_start' + 'dp_size' overflow the u32 dp rank range");
  }
  reg.lease_ms = static_cast<std::uint32_t>(std::clamp<std::uint64_t>(lease_ms, kMinLeaseMs, kMaxLeaseMs));
  return reg;
}

msgpack::sbuffer EncodeWorkerRegistration(const WorkerRegistration& reg) {
  msgpack::sbuffer buf;
  Packer pk(buf);
  pk.pack_map(reg.block_size ? 10 : 9);
  PackKey(pk, "worker_id");
  pk.pack_uint64(reg.worker_id);
  PackKey(pk, "dp_start");
  pk.pack_uint32(reg.dp_start);
  PackKey(pk, "dp_size");
  pk.pack_uint32(reg.dp_size);
  if (reg.block_size) {
    PackKey(pk, "block_size");
    pk.pack_uint32(*reg.block_size);
  }
  PackKey(pk, "total_kv_blocks");
  pk.pack_uint64(reg.total_kv_blocks);
  PackKey(pk, "max_num_seqs");
  pk.pack_uint32(reg.max_num_seqs);
  PackKey(pk, "max_num_batched_tokens");
  pk.pack_uint32(reg.max_num_batched_tokens);
  PackKey(pk, "device");
  pk.pack(reg.device);
  PackKey(pk, "lease_ms");
  pk.pack_uint32(reg.lease_ms);
  PackKey(pk, "status");
  pk.pack(reg.leaving ? "leaving" : "up");
  return buf;
}

Result<RouteRequest> DecodeRouteRequest(std::span<const std::byte> body) {
  auto doc = ParseMsgpackMap(body, "route request");
  if (!doc.ok()) return doc.status();
  const msgpack::object& m = doc->get();
  RouteRequest req;
  FieldReads reads;
  reads.Optional(m, "request_id", ReadName, req.request_id);

  // The prompt: token_ids, or block_hashes plus isl. token_ids wins; the others are then ignored.
  const msgpack::object* token_ids = FindKey(m, "token_ids");
  const msgpack::object* block_hashes = FindKey(m, "block_hashes");
  if (!IsNil(token_ids)) {
    reads.Required(token_ids, "token_ids", ReadU32Array, req.token_ids);
    req.has_token_ids = true;
    // Cannot overflow: a message is at most kMaxMessageBytes and a token takes one byte.
    req.isl = static_cast<std::uint32_t>(req.token_ids.size());
  } else if (!IsNil(block_hashes)) {
    reads.Required(block_hashes, "block_hashes", ReadU64BitsArray, req.block_hashes);
    reads.Required(m, "isl", ReadU32, req.isl);
  } else {
    reads.Fail(InvalidArgument("route request needs 'token_ids' or 'block_hashes' with 'isl'"));
  }

  reads.Optional(m, "lora_name", ReadStr, req.lora_name);
  reads.Optional(m, "update_states", ReadBool, req.update_states);
  reads.Optional(m, "worker_id", ReadU64, req.worker_id);
  reads.Optional(m, "dp_rank", ReadU32, req.dp_rank);
  reads.Optional(m, "allowed_worker_ids", ReadU64Array, req.allowed_worker_ids);
  reads.Optional(m, "timeout_ms", ReadU32, req.timeout_ms);
  reads.Optional(m, "max_tokens", ReadU32, req.max_tokens);
  if (!reads.ok()) return reads.status();

  // Top-level priority / expected_output_tokens win over nvext.agent_hints.priority / osl.
  auto nvext = ReadOptionalMap(m, "nvext");
  if (!nvext.ok()) return nvext.status();
  if (*nvext != nullptr) {
    auto hints = ReadOptionalMap(**nvext, "agent_hints");
    if (!hints.ok()) return InvalidArgument("nvext: " + hints.status().message());
    if (*hints != nullptr) {
      reads.Optional(FindKey(**hints, "priority"), "nvext.agent_hints.priority", ReadI64,
                     req.priority);
      reads.Optional(FindKey(**hints, "osl"), "nvext.agent_hints.osl", ReadU32,
                     req.expected_output_tokens);
    }
  }
  reads.Optional(m, "priority", ReadI64, req.priority);
  reads.Optional(m, "expected_output_tokens", ReadU32, req.expected_output_tokens);

  auto override_map = ReadOptionalMap(m, "router_config_override");
  if (!override_map.ok()) return override_map.status();
  if (*override_map != nullptr) {
    const msgpack::object& o = **override_map;
    RouterConfigOverride& c = req.config_override;
    reads.Optional(o, "overlap_score_credit", ReadWeight, c.overlap_score_credit);
    reads.Optional(o, "prefill_load_scale", ReadWeight, c.prefill_load_scale);
    reads.Optional(o, "router_temperature", ReadWeight, c.router_temperature);
  }
  if (!reads.ok()) return reads.status();
  return req;
}

msgpack::sbuffer EncodeRouteRequest(const RouteRequest& req) {
  // Fields equal to their default (and unset optionals) are left out.
  const RouterConfigOverride& c = req.config_override;
  const std::uint32_t overrides = (c.overlap_score_credit ? 1 : 0) +
                                  (c.prefill_load_scale ? 1 : 0) + (c.router_temperature ? 1 : 0);
  const std::uint32_t fields =
      (req.request_id.empty() ? 0 : 1) + (req.has_token_ids ? 1 : 2) +
      (req.lora_name.empty() ? 0 : 1) + (req.update_states ? 0 : 1) + (req.priority != 0 ? 1 : 0) +
      (req.expected_output_tokens ? 1 : 0) + (req.worker_id ? 1 : 0) + (req.dp_rank ? 1 : 0) +
      (req.allowed_worker_ids ? 1 : 0) + (overrides > 0 ? 1 : 0) + (req.timeout_ms ? 1 : 0) +
      (req.max_tokens ? 1 : 0);

  msgpack::sbuffer buf;
  Packer pk(buf);
  pk.pack_map(fields);
  if (!req.request_id.empty()) {
    PackKey(pk, "request_id");
    pk.pack(req.request_id);
  }
  if (req.has_token_ids) {
    PackKey(pk, "token_ids");
    pk.pack(req.token_ids);
  } else {
    PackKey(pk, "block_hashes");
    PackU64Array(pk, req.block_hashes);
    PackKey(pk, "isl");
    pk.pack_uint32(req.isl);
  }
  if (!req.lora_name.empty()) {
    PackKey(pk, "lora_name");
    pk.pack(req.lora_name);
  }
  if (!req.update_states) {
    PackKey(pk, "update_states");
    pk.pack_false();
  }
  if (req.priority != 0) {
    PackKey(pk, "priority");
    pk.pack_int64(req.priority);
  }
  if (req.expected_output_tokens) {
    PackKey(pk, "expected_output_tokens");
    pk.pack_uint32(*req.expected_output_tokens);
  }
  if (req.worker_id) {
    PackKey(pk, "worker_id");
    pk.pack_uint64(*req.worker_id);
  }
  if (req.dp_rank) {
    PackKey(pk, "dp_rank");
    pk.pack_uint32(*req.dp_rank);
  }
  if (req.allowed_worker_ids) {
    PackKey(pk, "allowed_worker_ids");
    PackU64Array(pk, *req.allowed_worker_ids);
  }
  if (overrides > 0) {
    PackKey(pk, "router_config_override");
    pk.pack_map(overrides);
    auto pack_weight = [&pk](std::string_view key, const std::optional<double>& v) {
      if (!v) return;
      PackKey(pk, key);
      pk.pack_double(*v);
    };
    pack_weight("overlap_score_credit", c.overlap_score_credit);
    pack_weight("prefill_load_scale", c.prefill_load_scale);
    pack_weight("router_temperature", c.router_temperature);
  }
  if (req.timeout_ms) {
    PackKey(pk, "timeout_ms");
    pk.pack_uint32(*req.timeout_ms);
  }
  if (req.max_tokens) {
    PackKey(pk, "max_tokens");
    pk.pack_uint32(*req.max_tokens);
  }
  return buf;
}

msgpack::sbuffer EncodeRouteReply(const RouteReply& reply) {
  msgpack::sbuffer buf;
  Packer pk(buf);
  pk.pack_map(6);
  PackKey(pk, "worker_id");
  pk.pack_uint64(reply.worker_id);
  PackKey(pk, "dp_rank");
  pk.pack_uint32(reply.dp_rank);
  PackKey(pk, "overlap_blocks");
  pk.pack_uint32(reply.overlap_blocks);
  PackKey(pk, "request_blocks");
  pk.pack_uint32(reply.request_blocks);
  PackKey(pk, "cached_tokens");
  pk.pack_uint32(reply.cached_tokens);
  PackKey(pk, "queued_ms");
  pk.pack_double(reply.queued_ms);
  return buf;
}

Result<RouteReply> DecodeRouteReply(std::span<const std::byte> body) {
  auto doc = ParseMsgpackMap(body, "route reply");
  if (!doc.ok()) return doc.status();
  const msgpack::object& m = doc->get();
  if (Status error = ErrorOfReply(m); !error.ok()) return error;
  RouteReply reply;
  FieldReads reads;
  reads.Required(m, "worker_id", ReadU64, reply.worker_id);
  reads.Required(m, "dp_rank", ReadU32, reply.dp_rank);
  reads.Required(m, "overlap_blocks", ReadU32, reply.overlap_blocks);
  reads.Required(m, "request_blocks", ReadU32, reply.request_blocks);
  reads.Required(m, "cached_tokens", ReadU32, reply.cached_tokens);
  reads.Required(m, "queued_ms", ReadF64, reply.queued_ms);
  if (!reads.ok()) return reads.status();
  return reply;
}

Result<std::string> DecodeLifecycleRequest(std::span<const std::byte> body) {
  auto doc = ParseMsgpackMap(body, "lifecycle request");
  if (!doc.ok()) return doc.status();
  auto id = ReadName(FindKey(doc->get(), "request_id"), "request_id");
  if (!id.ok()) return id.status();
  if (id->empty()) return InvalidArgument("field 'request_id' must not be empty");
  return std::string(*id);
}

msgpack::sbuffer EncodeLifecycleRequest(std::string_view request_id) {
  msgpack::sbuffer buf;
  Packer pk(buf);
  pk.pack_map(1);
  PackKey(pk, "request_id");
  pk.pack(request_id);
  return buf;
}

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
  if (!reads.ok()) return reads.status();
  if (request_id.empty()) return InvalidArgument("field 'request_id' must not be empty");
  e.request_id = std::string(request_id);
  if (kind == "add") e.kind = ActiveSequenceEvent::Kind::kAdd;
  else if (kind == "prefill_done") e.kind = ActiveSequenceEvent::Kind::kPrefillDone;
  else if (kind == "free") e.kind = ActiveSequenceEvent::Kind::kFree;
  else return InvalidArgument(fmt::format("field 'kind' must be add, prefill_done or free, not '{}'", kind.substr(0, 32)));
  return e;
}

msgpack::sbuffer EncodeActiveSequenceEvent(const ActiveSequenceEvent& e) {
  msgpack::sbuffer buf;
  Packer pk(buf);
  pk.pack_map(8);
  PackKey(pk, "router_id");
  pk.pack(e.router_id);
  PackKey(pk, "request_id");
  pk.pack(e.request_id);
  PackKey(pk, "worker_id");
  pk.pack(e.worker_id);
  PackKey(pk, "dp_rank");
  pk.pack(e.dp_rank);
  PackKey(pk, "kind");
  pk.pack(e.kind == ActiveSequenceEvent::Kind::kAdd           ? "add"
          : e.kind == ActiveSequenceEvent::Kind::kPrefillDone ? "prefill_done"
                                                              : "free");
  PackKey(pk, "seq_hashes");
  pk.pack(e.seq_hashes);
  PackKey(pk, "isl");
  pk.pack(e.isl);
  PackKey(pk, "overlap_blocks");
  pk.pack(e.overlap_blocks);
  return buf;
}

Result<StatsRequest> DecodeStatsRequest(std::span<const std::byte> body) {
  StatsRequest req;
  if (body.empty()) return req;  // a bare request: the defaults
  auto doc = ParseMsgpack(body);
  if (!doc.ok()) return doc.status();
  if (doc->get().type == msgpack::type::NIL) return req;
  if (!IsMap(doc->get())) return InvalidArgument("stats request must be a map");
  FieldReads reads;
  reads.Optional(doc->get(), "offset", ReadU64, req.offset);
  std::uint64_t limit = req.limit;
  reads.Optional(doc->get(), "limit", ReadU64, limit);
  if (!reads.ok()) return reads.status();
  req.limit = static_cast<std::uint32_t>(std::min<std::uint64_t>(limit, StatsRequest::kMaxLimit));
  return req;
}

msgpack::sbuffer EncodeStatsRequest(const StatsRequest& req) {
  MapWriter w;
  if (req.offset != 0) w.Field("offset", req.offset);
  if (req.limit != StatsRequest::kDefaultLimit) w.Field("limit", req.limit);
  return std::move(w).Finish();
}

namespace {

msgpack::sbuffer EncodeWorkerStats(const WorkerStats& s) {
  MapWriter w;
  w.Field("worker_id", s.worker_id)
      .Field("dp_rank", s.dp_rank)
      .Field("blocks", s.blocks)
      .Field("active_blocks", s.active_blocks)
      .Field("active_prefill_tokens", s.active_prefill_tokens)
      .Field("active_requests", s.active_requests)
      .Field("device", s.device)
      .Field("routed_requests", s.routed_requests);
  return std::move(w).Finish();
}

// The reply without its workers array (written last by the caller).
MapWriter StatsHead(const StatsReply& r) {
  MapWriter w;
  w.Field("workers_total", r.workers_total).Field("offset", r.offset);
  if (r.next_offset) w.Field("next_offset", *r.next_offset);
  for (const auto& [name, value] : r.counters) w.Field(name, value);
  for (const auto& [name, counts] : r.breakdowns) w.Field(name, counts);
  return w;
}

}  // namespace

Result<msgpack::sbuffer> EncodeStatsReply(StatsReply& r, std::size_t max_bytes) {
  std::vector<msgpack::sbuffer> entries;
  entries.reserve(r.workers.size());
  for (const WorkerStats& s : r.workers) entries.push_back(EncodeWorkerStats(s));
  // Worst case for the fixed part: next_offset present, the map header at its widest.
  if (!r.next_offset && !r.workers.empty()) r.next_offset = r.offset + r.workers.size();
  const std::size_t head = StatsHead(r).body_size() + 5 /* map header */ + 10 /* "workers" key */ +
                           5 /* array header */;
  if (head > max_bytes) {
    return Internal(fmt::format("the stats reply needs {} bytes without workers; the limit is {}", head, max_bytes));
  }
  std::size_t used = head;
  std::size_t keep = 0;
  while (keep < entries.size() && used + entries[keep].size() <= max_bytes) used += entries[keep++].size();
  r.workers.resize(keep);
  if (r.offset + keep >= r.workers_total) {
    r.next_offset.reset();
  } else {
    r.next_offset = r.offset + keep;
  }
  msgpack::sbuffer workers(used - head + 5);
  msgpack::packer<msgpack::sbuffer>(workers).pack_array(static_cast<std::uint32_t>(keep));
  for (std::size_t i = 0; i < keep; ++i) workers.write(entries[i].data(), entries[i].size());
  MapWriter w = StatsHead(r);
  w.Packed("workers", AsBytes(workers));
  return std::move(w).Finish();
}

Result<StatsReply> DecodeStatsReply(std::span<const std::byte> body) {
  auto doc = ParseMsgpackMap(body, "stats reply");
  if (!doc.ok()) return doc.status();
  const msgpack::object& m = doc->get();
  if (Status error = ErrorOfReply(m); !error.ok()) return error;
  StatsReply r;
  FieldReads reads;
  std::optional<std::uint64_t> total;  // absent from routers that did not page: all ranks came
  reads.Optional(m, "workers_total", ReadU64, total);
  reads.Optional(m, "offset", ReadU64, r.offset);
  reads.Optional(m, "next_offset", ReadU64, r.next_offset);
  auto workers = ReadArray(FindKey(m, "workers"), "workers");
  if (!workers.ok()) reads.Fail(workers.status());
  if (!reads.ok()) return reads.status();
  for (const msgpack::object& o : *workers) {
    WorkerStats w;
    reads.Required(o, "worker_id", ReadU64, w.worker_id);
    reads.Required(o, "dp_rank", ReadU32, w.dp_rank);
    reads.Optional(o, "blocks", ReadU64, w.blocks);
    reads.Optional(o, "active_blocks", ReadU64, w.active_blocks);
    reads.Optional(o, "active_prefill_tokens", ReadU64, w.active_prefill_tokens);
    reads.Optional(o, "active_requests", ReadU32, w.active_requests);
    reads.Optional(o, "device", ReadStr, w.device);
    reads.Optional(o, "routed_requests", ReadU64, w.routed_requests);
    if (!reads.ok()) return InvalidArgument("workers: " + reads.status().message());
    r.workers.push_back(std::move(w));
  }
  r.workers_total = total.value_or(r.offset + r.workers.size());
  // Everything else: unsigned counters, and maps of them.
  for (std::uint32_t i = 0; i < m.via.map.size; ++i) {
    const msgpack::object_kv& kv = m.via.map.ptr[i];
    auto key = ReadStr(&kv.key, "key");
    if (!key.ok() || *key == "workers" || *key == "workers_total" || *key == "offset" || *key == "next_offset") {
      continue;
    }
    if (auto v = ReadU64(&kv.val, *key); v.ok()) {
      r.counters[std::string(*key)] = *v;
    } else if (IsMap(kv.val)) {
      auto& counts = r.breakdowns[std::string(*key)];
      for (std::uint32_t j = 0; j < kv.val.via.map.size; ++j) {
        auto name = ReadStr(&kv.val.via.map.ptr[j].key, *key);
        auto n = ReadU64(&kv.val.via.map.ptr[j].val, *key);
        if (name.ok() && n.ok()) counts[std::string(*name)] = *n;
      }
    }
  }
  return r;
}

msgpack::sbuffer EncodeErrorReply(const Status& status) {
  // An OK status here is a caller bug; it goes out as "internal" rather than as "ok".
  const StatusCode code = status.ok() ? StatusCode::kInternal : status.code();
  msgpack::sbuffer buf;
  Packer pk(buf);
  pk.pack_map(1);
  PackKey(pk, "error");
  pk.pack_map(2);
  PackKey(pk, "code");
  pk.pack(StatusCodeName(code));
  PackKey(pk, "message");
  // A message may quote what a peer sent: keep the reply small whatever it quotes.
  pk.pack(std::string_view(status.message()).substr(0, kMaxErrorMessageBytes));
  return buf;
}

msgpack::sbuffer EncodeOkReply() {
  msgpack::sbuffer buf;
  Packer pk(buf);
  pk.pack_map(1);
  PackKey(pk, "ok");
  pk.pack_true();
  return buf;
}

Status DecodeErrorReply(std::span<const std::byte> body) {
  auto doc = ParseMsgpackMap(body, "reply");
  if (!doc.ok()) return doc.status();
  return ErrorOfReply(doc->get());
}

}  // namespace kvrouter
