// kvmocker's configuration: every flag of the kvmocker program (docs/design.md "Mock worker") in one
// typed struct, parsed once from the command line and the DYN_* environment (router/common/flags.h).
// Thread-safe (pure; the environment is read through the caller's lookup).
//
//   auto parsed = ParseMockerConfig(argc, argv, [](const char* n) { return std::getenv(n); });
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "events/base/status.h"
#include "events/registration_codec.h"
#include "router/common/flags.h"
#include "router/engine/mock_engine.h"

namespace kvrouter {

enum class MockEventFormat { kDynamo, kVllm };

// Every kvmocker flag. Each can also come from the environment: DYN_<FLAG_IN_UPPER_SNAKE_CASE>
// (DYN_NUM_WORKERS=4), NATS_SERVER for --nats-server; the command line wins.
struct MockerConfig {
  std::string nats_server = "nats://127.0.0.1:4222";  // --nats-server / NATS_SERVER
  NatsSecurity nats_security;                         // --nats-creds, --nats-user, ... --nats-tls-*
  std::string ns = "dynamo";                          // --namespace
  std::string component = "backend";                  // --component
  std::uint32_t num_workers = 1;                      // --num-workers [1, 1024]
  // --worker-id-base: worker i has id base + i. nullopt (the default): a random number in
  // [1, 2^48) chosen by the fleet, so two processes do not collide.
  std::optional<std::uint64_t> worker_id_base;
  std::uint32_t dp_size = 1;                    // --dp-size [1, 64]: ranks [0, dp_size)
  std::uint32_t num_gpu_blocks = 16384;         // --num-gpu-blocks >= 1, per rank
  std::uint32_t block_size = 64;                // --block-size [1, 65536]
  std::uint32_t max_num_seqs = 256;             // --max-num-seqs >= 1
  std::uint32_t max_num_batched_tokens = 8192;  // --max-num-batched-tokens >= 1
  // --chunked-prefill: vLLM V1's chunked prefill (MockEngineConfig::chunked_prefill); off: each
  // prompt is prefilled whole in the step that admits it.
  bool chunked_prefill = false;
  // --speedup-ratio: divides every simulated duration; each value finite and > 0. One value
  // applies to every worker; a comma-separated list has exactly num_workers values, worker i
  // running at the i-th ("8,8,2,2": a mixed fleet in one process). WorkerEngineConfig reads it.
  std::vector<double> speedup_ratio = {1.0};
  MockEventFormat event_format = MockEventFormat::kDynamo;  // --event-format dynamo|vllm
  std::uint32_t heartbeat_ms = 1000;                        // --heartbeat-ms >= 10
  std::uint32_t lease_ms = 3000;                            // --lease-ms > heartbeat-ms
  std::string device = "gpu";                               // --device, non-empty
  std::uint32_t metrics_port = 9092;                        // --metrics-port: /metrics, /health (0: off)
  std::string metrics_host = "0.0.0.0";                     // --metrics-host

  // The OpenAI HTTP face (docs/protocol.md section 11, design.md "Mock worker"): worker i of the
  // process listens on http_port + i and announces http_url and models in its registration.
  std::uint32_t http_port = 0;        // --http-port [0, 65535]: 0 = off; http_port + num_workers - 1 <= 65535
  std::string http_host = "0.0.0.0";  // --http-host: the address the HTTP ports listen on
  // --http-advertise-host: the host in the announced http_url (a docker-compose service name,
  // say). Default: 127.0.0.1 when http_host is a wildcard (0.0.0.0, ::) or 127.0.0.1, else
  // http_host. Filled in by the parser, so it is never empty after it.
  std::string http_advertise_host;
  std::string model = "mock";                            // --model: the served model name, 1..256 bytes
  std::uint64_t http_max_body_bytes = 16 * 1024 * 1024;  // --http-max-body-bytes >= 1: above it, 413

  // Disaggregated serving (docs/protocol.md section 13, "kvmocker's roles"): every worker of the
  // process announces role and kv_connector; every engine prices KV pulls and pins with the rest.
  WorkerRole role = WorkerRole::kBoth;            // --role both|prefill|decode
  KvConnector kv_connector = KvConnector::kNixl;  // --kv-connector nixl|sglang
  std::uint64_t kv_bytes_per_token = 131072;      // --kv-bytes-per-token >= 1
  double kv_transfer_gbps = 400;                  // --kv-transfer-gbps: Gbit/s, finite and > 0
  std::uint32_t kv_lease_ms = 30000;              // --kv-lease-ms: a prefill leg's pin at most (over the speedup)
  // --bootstrap-port [1, 65535]: announced by every worker; with --role prefill, --kv-connector
  // sglang and --http-port, the process's bootstrap listener (SGLang's legs meet there by room).
  std::uint32_t bootstrap_port = kDefaultBootstrapPort;
};
// num_workers * dp_size is at most this: every rank costs a subscription (a nats.c thread).
inline constexpr std::uint32_t kMaxMockRanks = 1024;

// Worker `worker_index`'s OpenAI base URL, "http://{advertise host}:{http_port + worker_index}"
// (an IPv6 literal in brackets); "" when the HTTP face is off.
std::string WorkerHttpUrl(const MockerConfig& config, std::uint32_t worker_index);

// The engine of every rank of worker `worker_index` (< num_workers): the cache and scheduler
// flags (chunked prefill included), the worker's own speedup ratio, the KV transfer and lease flags, and every token
// reported when the HTTP face streams.
MockEngineConfig WorkerEngineConfig(const MockerConfig& config, std::uint32_t worker_index);

using ParsedMockerArgs = ProgramArgs<MockerConfig>;
// Parses argv (argv[0] is the program) and the environment. Unknown flags and bad values give
// InvalidArgument naming the flag (and the variable, for a value from the environment).
Result<ParsedMockerArgs> ParseMockerConfig(int argc, const char* const* argv, const EnvLookup& env);

}  // namespace kvrouter
