#include "events/registration_codec.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <limits>

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

// A string naming one of `values` (as `name` spells them), else an InvalidArgument naming them.
template <typename E, std::size_t N>
Result<E> ReadOneOf(const msgpack::object* o, std::string_view field, const std::array<E, N>& values,
                    std::string_view (*name)(E)) {
  auto s = ReadStr(o, field);
  if (!s.ok()) return s.status();
  std::string allowed;
  for (E v : values) {
    if (*s == name(v)) return v;
    allowed += fmt::format("{}\"{}\"", allowed.empty() ? "" : ", ", name(v));
  }
  return InvalidArgument(fmt::format("field '{}' must be one of {}, not '{}'", field, allowed, s->substr(0, 32)));
}

Result<WorkerRole> ReadRole(const msgpack::object* o, std::string_view field) {
  return ReadOneOf(o, field, std::array{WorkerRole::kBoth, WorkerRole::kPrefill, WorkerRole::kDecode}, WorkerRoleName);
}

Result<KvConnector> ReadConnector(const msgpack::object* o, std::string_view field) {
  return ReadOneOf(o, field, std::array{KvConnector::kNixl, KvConnector::kSglang}, KvConnectorName);
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

}  // namespace

std::string_view WorkerRoleName(WorkerRole role) {
  switch (role) {
    case WorkerRole::kPrefill: return "prefill";
    case WorkerRole::kDecode: return "decode";
    case WorkerRole::kBoth: break;
  }
  return "both";
}

std::string_view KvConnectorName(KvConnector connector) {
  return connector == KvConnector::kSglang ? "sglang" : "nixl";
}

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
  reads.Optional(m, "role", ReadRole, reg.role);
  reads.Optional(m, "kv_connector", ReadConnector, reg.kv_connector);
  reads.Optional(m, "bootstrap_port", ReadU32, reg.bootstrap_port);
  if (!reads.ok()) return reads.status();
  if (reg.bootstrap_port > 65535) return InvalidArgument("field 'bootstrap_port' must be a port, at most 65535");
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
  if (reg.role != WorkerRole::kBoth) w.Field("role", WorkerRoleName(reg.role));
  if (reg.kv_connector != KvConnector::kNixl) w.Field("kv_connector", KvConnectorName(reg.kv_connector));
  if (reg.bootstrap_port != kDefaultBootstrapPort) w.Field("bootstrap_port", reg.bootstrap_port);
  return std::move(w).Finish();
}

}  // namespace kvrouter
