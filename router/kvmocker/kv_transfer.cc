#include "router/kvmocker/kv_transfer.h"

#include <fmt/format.h>

#include <charconv>
#include <limits>
#include <nlohmann/json.hpp>

namespace kvrouter {

namespace {

using Json = nlohmann::json;

std::string Dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

Result<Json> ParseObject(std::string_view text, std::string_view what) {
  Json j = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return InvalidArgument(fmt::format("{} must be a JSON object", what));
  return j;
}

// A present, non-null field.
const Json* Field(const Json& object, std::string_view key) {
  const auto it = object.find(key);
  return it == object.end() || it->is_null() ? nullptr : &*it;
}

Result<std::string> StringField(const Json& object, std::string_view key, std::string_view where) {
  const Json* v = Field(object, key);
  if (v == nullptr || !v->is_string()) return InvalidArgument(fmt::format("{}.{} must be a string", where, key));
  return v->get<std::string>();
}

Result<std::uint16_t> PortField(const Json& object, std::string_view key, std::string_view where) {
  const Json* v = Field(object, key);
  if (v == nullptr || !v->is_number_unsigned() || v->get<std::uint64_t>() < 1 || v->get<std::uint64_t>() > 65535) {
    return InvalidArgument(fmt::format("{}.{} must be a port in [1, 65535]", where, key));
  }
  return static_cast<std::uint16_t>(v->get<std::uint64_t>());
}

bool IsTrue(const Json& object, std::string_view key) {
  const Json* v = Field(object, key);
  return v != nullptr && v->is_boolean() && v->get<bool>();
}

Result<KvTransferParams> ParamsFrom(const Json& j) {
  constexpr std::string_view kWhere = "kv_transfer_params";
  if (!IsTrue(j, "do_remote_prefill")) return InvalidArgument("kv_transfer_params.do_remote_prefill must be true");
  KvTransferParams p;
  auto engine_id = StringField(j, "remote_engine_id", kWhere);
  if (!engine_id.ok()) return engine_id.status();
  auto engine = ParseRemoteEngineId(*engine_id);
  if (!engine.ok()) return engine.status();
  p.remote_engine = *engine;
  const Json* blocks = Field(j, "remote_block_ids");
  if (blocks == nullptr || !blocks->is_array()) {
    return InvalidArgument("kv_transfer_params.remote_block_ids must be a list of unsigned 64-bit block ids");
  }
  p.remote_block_ids.reserve(blocks->size());
  for (const Json& b : *blocks) {
    if (!b.is_number_unsigned()) {
      return InvalidArgument("kv_transfer_params.remote_block_ids must be a list of unsigned 64-bit block ids");
    }
    p.remote_block_ids.push_back(b.get<std::uint64_t>());
  }
  auto host = StringField(j, "remote_host", kWhere);
  if (!host.ok()) return host.status();
  if (host->empty()) return InvalidArgument("kv_transfer_params.remote_host must not be empty");
  p.remote_host = std::move(host).value();
  auto port = PortField(j, "remote_port", kWhere);
  if (!port.ok()) return port.status();
  p.remote_port = *port;
  auto request = StringField(j, "remote_request_id", kWhere);
  if (!request.ok()) return request.status();
  p.remote_request_id = std::move(request).value();
  return p;
}

Result<SglangBootstrap> BootstrapFrom(const Json& j) {
  constexpr std::string_view kWhere = "body";
  SglangBootstrap b;
  auto host = StringField(j, "bootstrap_host", kWhere);
  if (!host.ok() || host->empty()) return InvalidArgument("bootstrap_host must be a non-empty string");
  b.host = std::move(host).value();
  auto port = PortField(j, "bootstrap_port", kWhere);
  if (!port.ok()) return InvalidArgument("bootstrap_port must be a port in [1, 65535]");
  b.port = *port;
  const Json* room = Field(j, "bootstrap_room");
  if (room == nullptr || !room->is_number_unsigned()) {
    return InvalidArgument("bootstrap_room must be an unsigned 64-bit integer");
  }
  b.room = room->get<std::uint64_t>();
  return b;
}

}  // namespace

std::string FormatRemoteEngineId(const RemoteEngine& engine) {
  return fmt::format("{}_dp{}", engine.worker_id, engine.dp_rank);
}

Result<RemoteEngine> ParseRemoteEngineId(std::string_view id) {
  const auto bad = [&] {
    return InvalidArgument(
        fmt::format("remote_engine_id '{}' is not kvmocker's '{{worker_id}}_dp{{rank}}'", id.substr(0, 64)));
  };
  const std::size_t sep = id.find("_dp");
  if (sep == std::string_view::npos) return bad();
  RemoteEngine e;
  const std::string_view worker = id.substr(0, sep);
  const std::string_view rank = id.substr(sep + 3);
  auto [w_end, w_ec] = std::from_chars(worker.data(), worker.data() + worker.size(), e.worker_id);
  auto [r_end, r_ec] = std::from_chars(rank.data(), rank.data() + rank.size(), e.dp_rank);
  if (worker.empty() || rank.empty() || w_ec != std::errc() || r_ec != std::errc() ||
      w_end != worker.data() + worker.size() || r_end != rank.data() + rank.size()) {
    return bad();
  }
  return e;
}

std::string KvTransferParamsJson(const KvTransferParams& p) {
  return Dump({{"do_remote_prefill", true},
               {"do_remote_decode", false},
               {"remote_engine_id", FormatRemoteEngineId(p.remote_engine)},
               {"remote_block_ids", p.remote_block_ids},
               {"remote_host", p.remote_host},
               {"remote_port", p.remote_port},
               {"remote_request_id", p.remote_request_id},
               {"tp_size", 1}});
}

Result<KvTransferParams> ParseKvTransferParams(std::string_view json) {
  try {
    auto j = ParseObject(json, "kv_transfer_params");
    if (!j.ok()) return j.status();
    return ParamsFrom(*j);
  } catch (const Json::exception& e) {
    return InvalidArgument(fmt::format("kv_transfer_params: {}", e.what()));
  }
}

Result<LegFields> ParseLegFields(std::string_view json) {
  try {
    auto j = ParseObject(json, "the body");
    if (!j.ok()) return j.status();
    LegFields out;
    if (const Json* kv = Field(*j, "kv_transfer_params")) {
      if (!kv->is_object()) return InvalidArgument("'kv_transfer_params' must be an object");
      if (IsTrue(*kv, "do_remote_decode")) {
        out.nixl = LegFields::Nixl::kPrefill;
      } else if (IsTrue(*kv, "do_remote_prefill")) {
        auto params = ParamsFrom(*kv);
        if (params.ok()) {
          out.nixl = LegFields::Nixl::kDecode;
          out.params = std::move(params).value();
        } else {
          out.nixl = LegFields::Nixl::kInvalidDecode;
          out.invalid = params.status().message();
        }
      }
    }
    if (Field(*j, "bootstrap_host") || Field(*j, "bootstrap_port") || Field(*j, "bootstrap_room")) {
      auto bootstrap = BootstrapFrom(*j);
      if (!bootstrap.ok()) return bootstrap.status();
      out.bootstrap = std::move(bootstrap).value();
    }
    return out;
  } catch (const Json::exception& e) {
    return InvalidArgument(e.what());
  }
}

std::string KvPulledJson(const RemoteEngine& engine, std::string_view remote_request_id) {
  return Dump({{"remote_engine_id", FormatRemoteEngineId(engine)}, {"remote_request_id", remote_request_id}});
}

Result<KvPulled> ParseKvPulled(std::string_view json) {
  try {
    auto j = ParseObject(json, "the body");
    if (!j.ok()) return j.status();
    auto engine_id = StringField(*j, "remote_engine_id", "body");
    if (!engine_id.ok()) return engine_id.status();
    auto engine = ParseRemoteEngineId(*engine_id);
    if (!engine.ok()) return engine.status();
    auto request = StringField(*j, "remote_request_id", "body");
    if (!request.ok()) return request.status();
    return KvPulled{.engine = *engine, .remote_request_id = std::move(request).value()};
  } catch (const Json::exception& e) {
    return InvalidArgument(e.what());
  }
}

}  // namespace kvrouter
