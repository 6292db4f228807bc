#include "events/message_codec.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "events/event_codec.h"
#include "events/msgpack_reader.h"
#include "events/msgpack_writer.h"

namespace kvrouter {
namespace {

Result<bool> ReadLeaving(const msgpack::object* o, std::string_view field) {
  auto status = ReadStr(o, field);
  if (!status.ok()) return status.status();
  if (*status == "up") return false;
  if (*status == "leaving") return true;
  return InvalidArgument(
      fmt::format("field '{}' must be \"up\" or \"leaving\", not '{}'", field, status->substr(0, 32)));
}

// An engine's OpenAI base URL: http://, at most kMaxUrlBytes, trailing slashes dropped.
Result<std::string> ReadHttpUrl(const msgpack::object* o, std::string_view field) {
  auto s = ReadStr(o, field);
  if (!s.ok()) return s.status();
  if (s->size() > kMaxUrlBytes)
    return InvalidArgument(fmt::format("field '{}' is longer than {} bytes", field, kMaxUrlBytes));
  if (!s->empty() && !s->starts_with("http://")) {
    return InvalidArgument(fmt::format("field '{}' must start with http://", field));
  }
  std::string url(*s);
  while (url.ends_with('/')) url.pop_back();
  return url;
}

// Model names: at most kMaxModels, each a name (ReadName).
Result<std::vector<std::string>> ReadModels(const msgpack::object* o, std::string_view field) {
  auto items = ReadArray(o, field);
  if (!items.ok()) return items.status();
  if (items->size() > kMaxModels)
    return InvalidArgument(fmt::format("field '{}' has more than {} names", field, kMaxModels));
  std::vector<std::string> names;
  for (const msgpack::object& item : *items) {
    auto name = ReadName(&item, field);
    if (!name.ok()) return name.status();
    names.emplace_back(*name);
  }
  return names;
}

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
  reads.Optional(m, "http_url", ReadHttpUrl, reg.http_url);
  reads.Optional(m, "models", ReadModels, reg.models);
  if (!reads.ok()) return reads.status();
  if (reg.dp_size == 0) return InvalidArgument("field 'dp_size' must be at least 1");
  if (std::uint64_t{reg.dp_start} + reg.dp_size > std::numeric_limits<std::uint32_t>::max()) {
    return InvalidArgument("fields 'dp_start' + 'dp_size' overflow the u32 dp rank range");
  }
  reg.lease_ms = static_cast<std::uint32_t>(std::clamp<std::uint64_t>(lease_ms, kMinLeaseMs, kMaxLeaseMs));
  return reg;
}

msgpack::sbuffer EncodeWorkerRegistration(const WorkerRegistration& reg) {
  MapWriter w;
  w.Field("worker_id", reg.worker_id).Field("dp_start", reg.dp_start).Field("dp_size", reg.dp_size);
  if (reg.block_size) w.Field("block_size", *reg.block_size);
  w.Field("total_kv_blocks", reg.total_kv_blocks)
      .Field("max_num_seqs", reg.max_num_seqs)
      .Field("max_num_batched_tokens", reg.max_num_batched_tokens)
      .Field("device", reg.device)
      .Field("lease_ms", reg.lease_ms)
      .Field("status", std::string_view(reg.leaving ? "leaving" : "up"));
  if (!reg.http_url.empty()) w.Field("http_url", reg.http_url);
  if (!reg.models.empty()) w.Field("models", reg.models);
  return std::move(w).Finish();
}

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

namespace {

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
    w.Field("token_ids", req.token_ids);
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

msgpack::sbuffer EncodeOverlapByTier(const OverlapByTier& t) {
  MapWriter w;
  w.Field("device", t.device).Field("host_pinned", t.host_pinned).Field("disk", t.disk);
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
  reads.Required(**tiers, "disk", ReadU32, to.disk);
  return reads.ok() ? Status::Ok() : InvalidArgument("overlap_by_tier: " + reads.status().message());
}

}  // namespace

msgpack::sbuffer EncodeRouteReply(const RouteReply& reply) {
  MapWriter w;
  w.Field("worker_id", reply.worker_id)
      .Field("dp_rank", reply.dp_rank)
      .Field("overlap_blocks", reply.overlap_blocks)
      .Field("request_blocks", reply.request_blocks)
      .Field("cached_tokens", reply.cached_tokens)
      .Field("queued_ms", reply.queued_ms);
  if (!reply.http_url.empty()) w.Field("http_url", reply.http_url);
  const std::uint32_t device = std::max(reply.overlap_by_tier.device, reply.overlap_blocks);
  const std::uint32_t host = std::max(reply.overlap_by_tier.host_pinned, device);
  w.Packed("overlap_by_tier", AsBytes(EncodeOverlapByTier({device, host, std::max(reply.overlap_by_tier.disk, host)})));
  return std::move(w).Finish();
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
  reads.Optional(m, "http_url", ReadStr, reply.http_url);
  // An optional extra: a malformed one reads as absent rather than losing the decision.
  reply.overlap_by_tier = {reply.overlap_blocks, reply.overlap_blocks, reply.overlap_blocks};
  if (OverlapByTier t; FindKey(m, "overlap_by_tier") != nullptr && ReadOverlapByTier(m, t).ok()) {
    reply.overlap_by_tier = t;
  }
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
  reads.Required(doc->get(), "router_id", ReadU64, h.router_id);
  reads.Optional(doc->get(), "interval_ms", ReadU32, h.interval_ms);
  reads.Optional(doc->get(), "epoch", ReadU32, h.epoch);
  if (!reads.ok()) return reads.status();
  return h;
}

msgpack::sbuffer EncodeRouterHeartbeat(const RouterHeartbeat& h) {
  MapWriter w;
  w.Field("router_id", h.router_id).Field("interval_ms", h.interval_ms).Field("epoch", h.epoch);
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
  reads.Required(m, "worker_id", ReadU64, k.worker_id);
  reads.Optional(m, "dp_rank", ReadU32, k.dp_rank);
  reads.Required(m, "active_decode_blocks", ReadU64, k.active_decode_blocks);
  reads.Required(m, "active_prefill_tokens", ReadU64, k.active_prefill_tokens);
  if (!reads.ok()) return reads.status();
  return k;
}

msgpack::sbuffer EncodeKvMetrics(const KvMetrics& k) {
  MapWriter w;
  w.Field("worker_id", k.worker_id)
      .Field("dp_rank", k.dp_rank)
      .Field("active_decode_blocks", k.active_decode_blocks)
      .Field("active_prefill_tokens", k.active_prefill_tokens);
  return std::move(w).Finish();
}

namespace {

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

}  // namespace

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
      .Field("routed_requests", s.routed_requests)
      .Field("prefill_tokens_per_second", s.prefill_tokens_per_second)
      .Field("decode_step_seconds", s.decode_step_seconds)
      .Field("rate_observations", s.rate_observations);
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

namespace {

// One page of a paged reply: its head (head() reads the reply's next_offset) and, under `key`,
// as many of `entries` (encoded, in order) as fit in max_bytes. Sets next_offset to the first
// rank left out, or resets it when the page reaches the last rank; `keep` is how many went in.
template <typename Head>
Result<msgpack::sbuffer> EncodePage(std::string_view what, std::string_view key,
                                    const std::vector<msgpack::sbuffer>& entries, std::uint64_t offset,
                                    std::uint64_t total, std::optional<std::uint64_t>& next_offset,
                                    std::size_t max_bytes, const Head& head_of, std::size_t& keep) {
  // Worst case for the fixed part: next_offset present, the map header at its widest.
  if (!next_offset && !entries.empty()) next_offset = offset + entries.size();
  const std::size_t head = head_of().body_size() + 5 /* map header */ + key.size() + 2 + 5 /* array header */;
  if (head > max_bytes) {
    return Internal(fmt::format("the {} reply needs {} bytes without {}; the limit is {}", what, head, key, max_bytes));
  }
  std::size_t used = head;
  keep = 0;
  while (keep < entries.size() && used + entries[keep].size() <= max_bytes) used += entries[keep++].size();
  if (offset + keep >= total) {
    next_offset.reset();
  } else {
    next_offset = offset + keep;
  }
  msgpack::sbuffer array(used - head + 5);
  msgpack::packer<msgpack::sbuffer>(array).pack_array(static_cast<std::uint32_t>(keep));
  for (std::size_t i = 0; i < keep; ++i) array.write(entries[i].data(), entries[i].size());
  MapWriter w = head_of();
  w.Packed(key, AsBytes(array));
  return std::move(w).Finish();
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
    reads.Optional(o, "prefill_tokens_per_second", ReadF64, w.prefill_tokens_per_second);
    reads.Optional(o, "decode_step_seconds", ReadF64, w.decode_step_seconds);
    reads.Optional(o, "rate_observations", ReadU64, w.rate_observations);
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
