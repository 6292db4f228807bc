// kvmocker's side of a disaggregated request's legs (docs/protocol.md section 13, "kvmocker's
// roles"): the kv_transfer_params a prefill leg answers with and a decode leg brings (vLLM
// NixlConnector's field names, kvmocker's meaning of their values), SGLang's bootstrap fields, and
// the bodies of kvmocker's own endpoints between a decode and a prefill process (not a vLLM or
// SGLang contract). Pure functions, thread-safe; exceptions of the JSON library stay in the .cc.
//
//   auto leg = ParseLegFields(R"({"kv_transfer_params": {"do_remote_decode": true}})");
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "events/base/status.h"
#include "events/block_hash.h"

namespace kvrouter {

// The prefill rank that pinned a leg's blocks: remote_engine_id "{worker_id}_dp{dp_rank}" (vLLM
// names a data-parallel engine "{engine_id}_dp{rank}").
struct RemoteEngine {
  std::uint64_t worker_id = 0;
  std::uint32_t dp_rank = 0;
  bool operator==(const RemoteEngine&) const = default;
};
std::string FormatRemoteEngineId(const RemoteEngine& engine);
Result<RemoteEngine> ParseRemoteEngineId(std::string_view id);

// What a prefill engine answers and a decode engine pulls by:
//   {"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": "{worker}_dp{rank}",
//    "remote_block_ids": [u64...]   the pinned blocks' sequence hashes (protocol.md section 1),
//    "remote_host": str, "remote_port": u16   where POST /kvmocker/kv_pulled reaches the prefill
//                                             process (its HTTP face, or its bootstrap listener),
//    "remote_request_id": str        the prefill engine's id of the leg (its pin's key),
//    "tp_size": 1}
struct KvTransferParams {
  RemoteEngine remote_engine;
  std::vector<SequenceHash> remote_block_ids;
  std::string remote_host;
  std::uint16_t remote_port = 0;
  std::string remote_request_id;
};
std::string KvTransferParamsJson(const KvTransferParams& params);
// The object above: every field present and of its type, do_remote_prefill true, remote_port in
// [1, 65535]; anything else is an InvalidArgument naming the field.
Result<KvTransferParams> ParseKvTransferParams(std::string_view json);

// SGLang's fields of both legs' body.
struct SglangBootstrap {
  std::string host;
  std::uint16_t port = 0;
  std::uint64_t room = 0;
};

// What a generation body asks of the engine's legs.
struct LegFields {
  enum class Nixl {
    kNone,           // no kv_transfer_params (or null, or neither do_remote_* true): a whole request
    kPrefill,        // do_remote_decode true: a prefill leg
    kDecode,         // do_remote_prefill true and every field valid: `params`
    kInvalidDecode,  // do_remote_prefill true and a field missing or bad: `invalid` says which
  };
  Nixl nixl = Nixl::kNone;
  std::optional<KvTransferParams> params;
  std::string invalid;
  std::optional<SglangBootstrap> bootstrap;  // bootstrap_host, bootstrap_port and bootstrap_room all there
};
// The leg fields of a generation body: `json` is an object holding those of kv_transfer_params,
// bootstrap_host, bootstrap_port and bootstrap_room that the body has (the body itself will do).
// A kv_transfer_params that is neither null nor an object, or bootstrap fields present but not
// all three (a string, a port in [1, 65535], an unsigned 64-bit room), is an InvalidArgument:
// the request is refused with 400, as any bad field is.
Result<LegFields> ParseLegFields(std::string_view json);
// The body fields that ParseLegFields reads.
inline constexpr std::string_view kLegFieldNames[] = {"kv_transfer_params", "bootstrap_host", "bootstrap_port",
                                                      "bootstrap_room"};

// kvmocker's endpoints between processes (docs/protocol.md section 13, "kvmocker's roles"):
//   POST /kvmocker/kv_pulled {"remote_engine_id", "remote_request_id"} -> 200 {"released": bool}
//     on a prefill process's HTTP face and its bootstrap listener: the decode engine pulled.
//   GET /kvmocker/bootstrap/rooms/{room} on the bootstrap listener -> 200 the room's
//     KvTransferParams once its prefill leg is done (held until then), 502 when that leg failed.
inline constexpr std::string_view kKvPulledPath = "/kvmocker/kv_pulled";
inline constexpr std::string_view kBootstrapRoomsPath = "/kvmocker/bootstrap/rooms/";
std::string KvPulledJson(const RemoteEngine& engine, std::string_view remote_request_id);
struct KvPulled {
  RemoteEngine engine;
  std::string remote_request_id;
};
Result<KvPulled> ParseKvPulled(std::string_view json);

}  // namespace kvrouter
