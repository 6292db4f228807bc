#include "events/router_endpoints_codec.h"

#include <fmt/format.h>

#include <algorithm>

#include "events/codec_detail.h"
#include "events/msgpack_reader.h"
#include "events/msgpack_writer.h"
#include "events/wire_fields.h"

namespace kvrouter {

namespace codec_detail {

// The map under `key`, or nullptr when absent or nil; a non-map is an error.
Result<const msgpack::object*> ReadOptionalMap(const msgpack::object& parent, std::string_view key) {
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

msgpack::sbuffer EncodeMmItems(std::span<const MmItem> items) {
  msgpack::sbuffer out;
  msgpack::packer<msgpack::sbuffer> pk(out);
  pk.pack_array(static_cast<std::uint32_t>(items.size()));
  for (const MmItem& i : items) {
    pk.pack_map(3);
    pk.pack("hash");
    pk.pack(i.hash);
    pk.pack("offset");
    pk.pack(i.offset);
    pk.pack("length");
    pk.pack(i.length);
  }
  return out;
}

msgpack::sbuffer EncodeOverlapByTier(const OverlapByTier& t) {
  MapWriter w;
  w.Field("device", t.device).Field("host_pinned", t.host_pinned).Field("disk", t.any_tier);
  return std::move(w).Finish();
}

// m's overlap_by_tier, when present, into `to`.
Status ReadOverlapByTier(const msgpack::object& m, OverlapByTier& to) {
  auto tiers = ReadOptionalMap(m, "overlap_by_tier");
  if (!tiers.ok()) return tiers.status();
  if (*tiers == nullptr) return Status::Ok();
  FieldReads reads;
  reads.Required(**tiers, "device", ReadU32, to.device);
  reads.Required(**tiers, "host_pinned", ReadU32, to.host_pinned);
  reads.Required(**tiers, "disk", ReadU32, to.any_tier);
  return reads.ok() ? Status::Ok() : InvalidArgument("overlap_by_tier: " + reads.status().message());
}

// A paged request's offset and limit (a larger limit reads as StatsRequest::kMaxLimit).
Status ReadPage(const msgpack::object& m, std::uint64_t& offset, std::uint32_t& limit) {
  FieldReads reads;
  reads.Optional(m, "offset", ReadU64, offset);
  std::uint64_t wanted = limit;
  reads.Optional(m, "limit", ReadU64, wanted);
  if (!reads.ok()) return reads.status();
  // 0 reads as the default: an empty page would point its next_offset at itself.
  if (wanted == 0) wanted = StatsRequest::kDefaultLimit;
  limit = static_cast<std::uint32_t>(std::min<std::uint64_t>(wanted, StatsRequest::kMaxLimit));
  return Status::Ok();
}

}  // namespace codec_detail

using namespace codec_detail;

namespace {

// token_ids is most of a route request (a 256-token prompt is 256 of its ~265 values), and
// building msgpack's object tree for it costs an allocation-heavy node per token. So a well-formed token_ids array
// (the first one, as FindKey finds it) is read straight from the bytes into `tokens`, and `rest`
// becomes the message with that array replaced by nil, for the tree. Anything unusual (no such
// array, a bad element, a non-string key before it) leaves `rest` empty: the whole message then
// goes through the tree, which says what is wrong.
void PullTokenIds(std::span<const std::byte> body, std::vector<std::uint32_t>& tokens, std::vector<std::byte>& rest) {
  if (body.size() > kMaxMessageBytes) return;
  MsgpackPull pull(body);
  std::uint32_t pairs = 0;
  if (!pull.MapHeader(pairs)) return;
  for (std::uint32_t i = 0; i < pairs; ++i) {
    std::string_view key;
    if (!pull.Str(key)) return;
    if (key != "token_ids") {
      if (!pull.Skip()) return;
      continue;
    }
    const std::size_t begin = pull.Offset();
    std::uint32_t n = 0;
    if (!pull.ArrayHeader(n)) return;
    std::vector<std::uint32_t> read;
    read.reserve(std::min<std::uint32_t>(n, 1u << 16));  // a declared size is not yet a promise
    for (std::uint32_t k = 0; k < n; ++k) {
      std::uint32_t t = 0;
      if (!pull.U32(t)) return;
      read.push_back(t);
    }
    tokens = std::move(read);
    const std::size_t end = pull.Offset();
    rest.reserve(body.size() - (end - begin) + 1);
    rest.insert(rest.end(), body.begin(), body.begin() + static_cast<std::ptrdiff_t>(begin));
    rest.push_back(std::byte{0xc0});  // nil
    rest.insert(rest.end(), body.begin() + static_cast<std::ptrdiff_t>(end), body.end());
    return;
  }
}

}  // namespace

Result<RouteRequest> DecodeRouteRequest(std::span<const std::byte> body) {
  RouteRequest req;
  std::vector<std::byte> rest;
  PullTokenIds(body, req.token_ids, rest);
  const bool pulled = !rest.empty();
  auto doc = ParseMsgpackMap(pulled ? std::span<const std::byte>(rest) : body, "route request");
  if (!doc.ok()) return doc.status();
  const msgpack::object& m = doc->get();
  FieldReads reads;
  reads.Optional(m, "request_id", ReadName, req.request_id);

  // The prompt: token_ids, or block_hashes plus isl. token_ids wins; the others are then ignored.
  const msgpack::object* token_ids = FindKey(m, "token_ids");
  const msgpack::object* block_hashes = FindKey(m, "block_hashes");
  if (pulled) {
    req.has_token_ids = true;
    req.isl = static_cast<std::uint32_t>(req.token_ids.size());
  } else if (!IsNil(token_ids)) {
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
  reads.Optional(m, "session_id", ReadName, req.session_id);
  reads.Optional(m, "excluded_worker_ids", ReadU64Array, req.excluded_worker_ids);
  if (!reads.ok()) return reads.status();
  if (const msgpack::object* items = FindKey(m, "mm_items"); !IsNil(items)) {
    auto list = ReadArray(items, "mm_items");
    if (!list.ok()) return list.status();
    if (list->size() > kMaxMmItems) {
      return InvalidArgument(fmt::format("{} mm_items; at most {}", list->size(), kMaxMmItems));
    }
    for (const msgpack::object& o : *list) {
      MmItem item;
      reads.Required(o, "hash", ReadU64Bits, item.hash);
      reads.Required(o, "offset", ReadU32, item.offset);
      reads.Required(o, "length", ReadU32, item.length);
      if (!reads.ok()) return InvalidArgument("mm_items: " + reads.status().message());
      req.mm_items.push_back(item);
    }
  }

  // Top-level priority / expected_output_tokens win over nvext.agent_hints.priority / osl.
  auto nvext = ReadOptionalMap(m, "nvext");
  if (!nvext.ok()) return nvext.status();
  if (*nvext != nullptr) {
    auto hints = ReadOptionalMap(**nvext, "agent_hints");
    if (!hints.ok()) return InvalidArgument("nvext: " + hints.status().message());
    if (*hints != nullptr) {
      reads.Optional(FindKey(**hints, "priority"), "nvext.agent_hints.priority", ReadI64, req.priority);
      reads.Optional(FindKey(**hints, "osl"), "nvext.agent_hints.osl", ReadU32, req.expected_output_tokens);
    }
  }
  reads.Optional(m, "priority", ReadI64, req.priority);
  reads.Optional(m, "expected_output_tokens", ReadU32, req.expected_output_tokens);

  auto override_map = ReadOptionalMap(m, "router_config_override");
  if (!override_map.ok()) return override_map.status();
  if (*override_map != nullptr) {
    const msgpack::object& o = **override_map;
    RouterConfigOverride& c = req.config_override;
    reads.Optional(o, "overlap_score_credit", ReadNonNegative, c.overlap_score_credit);
    reads.Optional(o, "prefill_load_scale", ReadNonNegative, c.prefill_load_scale);
    reads.Optional(o, "router_temperature", ReadNonNegative, c.router_temperature);
  }
  if (!reads.ok()) return reads.status();
  return req;
}

msgpack::sbuffer EncodeRouteRequest(const RouteRequest& req) {
  // Fields equal to their default (and unset optionals) are left out.
  MapWriter w;
  if (!req.request_id.empty()) w.Field("request_id", req.request_id);
  if (req.has_token_ids) {
    w.With("token_ids", [&](msgpack::sbuffer& out) { PackU32Array(out, req.token_ids); });
  } else {
    w.Field("block_hashes", req.block_hashes).Field("isl", req.isl);
  }
  if (!req.lora_name.empty()) w.Field("lora_name", req.lora_name);
  if (!req.mm_items.empty()) w.Packed("mm_items", AsBytes(EncodeMmItems(req.mm_items)));
  if (!req.update_states) w.Field("update_states", false);
  if (req.priority != 0) w.Field("priority", req.priority);
  if (req.expected_output_tokens) w.Field("expected_output_tokens", *req.expected_output_tokens);
  if (req.worker_id) w.Field("worker_id", *req.worker_id);
  if (req.dp_rank) w.Field("dp_rank", *req.dp_rank);
  if (req.allowed_worker_ids) w.Field("allowed_worker_ids", *req.allowed_worker_ids);
  const RouterConfigOverride& c = req.config_override;
  MapWriter overrides;
  if (c.overlap_score_credit) overrides.Field("overlap_score_credit", *c.overlap_score_credit);
  if (c.prefill_load_scale) overrides.Field("prefill_load_scale", *c.prefill_load_scale);
  if (c.router_temperature) overrides.Field("router_temperature", *c.router_temperature);
  if (overrides.fields() > 0) w.Map("router_config_override", overrides);
  if (req.timeout_ms) w.Field("timeout_ms", *req.timeout_ms);
  if (req.max_tokens) w.Field("max_tokens", *req.max_tokens);
  if (!req.session_id.empty()) w.Field("session_id", req.session_id);
  if (req.excluded_worker_ids) w.Field("excluded_worker_ids", *req.excluded_worker_ids);
  return std::move(w).Finish();
}

namespace {

// overlap_by_tier is written lifted: never below overlap_blocks, each figure at least the one before.
struct RouteReplyEncoder : FieldEncoder {
  std::uint32_t overlap_blocks;
  void Tiers(std::string_view key, const OverlapByTier& t) {
    const std::uint32_t device = std::max(t.device, overlap_blocks);
    const std::uint32_t host = std::max(t.host_pinned, device);
    w.Packed(key, AsBytes(EncodeOverlapByTier({device, host, std::max(t.any_tier, host)})));
  }
};

// overlap_by_tier is an optional extra: absent or malformed, it reads as overlap_blocks (read
// before it) three times rather than losing the decision.
struct RouteReplyDecoder : FieldDecoder {
  std::uint32_t& overlap_blocks;
  void Tiers(std::string_view key, OverlapByTier& to) {
    to = {overlap_blocks, overlap_blocks, overlap_blocks};
    if (OverlapByTier t; FindKey(map, key) != nullptr && ReadOverlapByTier(map, t).ok()) to = t;
  }
};

}  // namespace

msgpack::sbuffer EncodeRouteReply(const RouteReply& reply) {
  MapWriter w;
  ForEachRouteReplyField(reply, RouteReplyEncoder{{w}, reply.overlap_blocks});
  return std::move(w).Finish();
}

Result<RouteReply> DecodeRouteReply(std::span<const std::byte> body) {
  auto doc = ParseMsgpackMap(body, "route reply");
  if (!doc.ok()) return doc.status();
  const msgpack::object& m = doc->get();
  if (Status error = ErrorOfReply(m); !error.ok()) return error;
  RouteReply reply;
  FieldReads reads;
  ForEachRouteReplyField(reply, RouteReplyDecoder{{m, reads}, reply.overlap_blocks});
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
  MapWriter w;
  w.Field("request_id", request_id);
  return std::move(w).Finish();
}

msgpack::sbuffer EncodeLifecycleRequest(std::string_view request_id, const ResponseTiming& t) {
  MapWriter w;
  w.Field("request_id", request_id)
      .Field("ttfb_ms", t.ttfb_ms)
      .Field("chunks", t.chunks)
      .Field("inter_chunk_ms_mean", t.inter_chunk_ms_mean)
      .Field("inter_chunk_ms_max", t.inter_chunk_ms_max);
  return std::move(w).Finish();
}

std::optional<ResponseTiming> DecodeResponseTiming(std::span<const std::byte> body) {
  auto doc = ParseMsgpackMap(body, "lifecycle request");
  if (!doc.ok()) return std::nullopt;
  const msgpack::object& m = doc->get();
  if (IsNil(FindKey(m, "ttfb_ms"))) return std::nullopt;
  ResponseTiming t;
  FieldReads reads;
  reads.Required(m, "ttfb_ms", ReadNonNegative, t.ttfb_ms);
  reads.Optional(m, "chunks", ReadU32, t.chunks);
  reads.Optional(m, "inter_chunk_ms_mean", ReadNonNegative, t.inter_chunk_ms_mean);
  reads.Optional(m, "inter_chunk_ms_max", ReadNonNegative, t.inter_chunk_ms_max);
  if (!reads.ok()) return std::nullopt;
  return t;
}
Result<StatsRequest> DecodeStatsRequest(std::span<const std::byte> body) {
  StatsRequest req;
  if (body.empty()) return req;  // a bare request: the defaults
  auto doc = ParseMsgpack(body);
  if (!doc.ok()) return doc.status();
  if (doc->get().type == msgpack::type::NIL) return req;
  if (!IsMap(doc->get())) return InvalidArgument("stats request must be a map");
  if (Status s = ReadPage(doc->get(), req.offset, req.limit); !s.ok()) return s;
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
  ForEachWorkerStatsField(s, FieldEncoder{w});
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
  std::size_t keep = 0;
  auto body = EncodePage(
      "stats", "workers", entries, r.offset, r.workers_total, r.next_offset, max_bytes, [&] { return StatsHead(r); },
      keep);
  r.workers.resize(std::min(keep, r.workers.size()));
  return body;
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
    ForEachWorkerStatsField(w, FieldDecoder{o, reads});
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
  MapWriter error;
  error.Field("code", StatusCodeName(code));
  // A message may quote what a peer sent: keep the reply small whatever it quotes.
  error.Field("message", std::string_view(status.message()).substr(0, kMaxErrorMessageBytes));
  MapWriter w;
  w.Map("error", error);
  return std::move(w).Finish();
}

msgpack::sbuffer EncodeOkReply() {
  MapWriter w;
  w.Field("ok", true);
  return std::move(w).Finish();
}

Status DecodeErrorReply(std::span<const std::byte> body) {
  auto doc = ParseMsgpackMap(body, "reply");
  if (!doc.ok()) return doc.status();
  return ErrorOfReply(doc->get());
}

}  // namespace kvrouter
