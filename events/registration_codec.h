// Codec of worker registration (docs/protocol.md section 4, with the keys section 11 adds):
// the map each worker publishes on InstancesSubject (events/subjects.h) every heartbeat.
// Decoding never throws. Thread-safe (pure functions).
//
// Grammar (a map keyed by field name, unknown keys ignored, integers of any width):
//   registration = {worker_id: u64, dp_start?: u32 (0), dp_size?: u32 (1), block_size?: u32,
//                   total_kv_blocks?: u64 (0), max_num_seqs?: u32 (256),
//                   max_num_batched_tokens?: u32 (8192), device?: str ("gpu"),
//                   lease_ms?: u32 (3000), status?: "up"|"leaving" ("up"),
//                   http_url?: str (""), models?: [str],                          (section 11)
//                   role?: "both"|"prefill"|"decode" ("both"),
//                   kv_connector?: "nixl"|"sglang" ("nixl"), bootstrap_port?: u32 (8998)}  (section 13)
// dp_size 0, dp_start + dp_size above 2^32-1, or another status is an InvalidArgument; lease_ms
// (any u64) is clamped to [kMinLeaseMs, kMaxLeaseMs]. The router's own bound on dp_size
// (--router-max-dp-size) is checked by the registry, not here. device is at most kMaxNameBytes
// bytes; http_url starts with http:// and is at most kMaxUrlBytes (trailing slashes dropped),
// models at most kMaxModels names of kMaxNameBytes. Another role or kv_connector, or a
// bootstrap_port above 65535, is an InvalidArgument. The encoder leaves out an unset block_size,
// an empty http_url, no models, and role, kv_connector and bootstrap_port at their defaults.
//
//   Result<WorkerRegistration> reg = DecodeWorkerRegistration(body);
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <msgpack.hpp>

#include "events/base/status.h"

namespace kvrouter {

inline constexpr std::uint32_t kMinLeaseMs = 100;
inline constexpr std::uint32_t kMaxLeaseMs = 3'600'000;

// A registration's `status` (section 4): a worker that is up, or one about to go.
enum class WorkerStatus { kUp, kLeaving };

// Section 13: the legs a worker serves. kBoth: an aggregated engine (whole requests); kPrefill:
// prefill legs only, never a request's (decode) worker; kDecode: decode legs, and whole requests
// when the prefill pool is skipped.
enum class WorkerRole : std::uint8_t { kBoth, kPrefill, kDecode };
std::string_view WorkerRoleName(WorkerRole role);  // "both", "prefill", "decode"
// Section 13: how the engines move KV from a prefill to a decode engine.
enum class KvConnector : std::uint8_t { kNixl, kSglang };
std::string_view KvConnectorName(KvConnector connector);  // "nixl", "sglang"
inline constexpr std::uint32_t kDefaultBootstrapPort = 8998;  // SGLang prefill engines' bootstrap

// Bounds on what a registration may carry (section 11), so a peer cannot grow a worker's entry.
inline constexpr std::size_t kMaxUrlBytes = 2048;
inline constexpr std::size_t kMaxModels = 64;

// dp ranks a worker may have, [0, kMaxDpRanks): the index keeps a rank's other storage tiers
// under the higher ranks (router/index/block_index.h, TierRank).
inline constexpr std::uint64_t kMaxDpRanks = 1u << 30;

struct WorkerRegistration {
  std::uint64_t worker_id = 0;
  std::uint32_t dp_start = 0;
  std::uint32_t dp_size = 1;                // must be >= 1
  std::optional<std::uint32_t> block_size;  // absent = the router's
  std::uint64_t total_kv_blocks = 0;        // 0 = unknown
  std::uint32_t max_num_seqs = 256;
  std::uint32_t max_num_batched_tokens = 8192;
  std::string device = "gpu";
  std::uint32_t lease_ms = 3000;
  bool leaving = false;  // status "leaving"
  // Section 11: the engine's OpenAI base URL ("http://host:port", no trailing slash; empty: it
  // serves no HTTP) and the model names it serves.
  std::string http_url;
  std::vector<std::string> models;
  // Section 13: its role in a disaggregated fleet, and (prefill and decode engines) its connector.
  WorkerRole role = WorkerRole::kBoth;
  KvConnector kv_connector = KvConnector::kNixl;
  std::uint32_t bootstrap_port = kDefaultBootstrapPort;  // SGLang prefill engines, at most 65535
  bool operator==(const WorkerRegistration&) const = default;
};
Result<WorkerRegistration> DecodeWorkerRegistration(std::span<const std::byte> body);
msgpack::sbuffer EncodeWorkerRegistration(const WorkerRegistration& reg);

}  // namespace kvrouter
