// kvgateway's flags (docs/protocol.md section 11; each also from DYN_<FLAG>, NATS_SERVER for
// --nats-server), parsed once into GatewayConfig:
//   kvgateway [--http-port 8000] [--http-host 0.0.0.0] [--nats-server URL] [--namespace dynamo]
//             [--component backend] [--metrics-port 9094] [--render-url URL] [--retries 2]
//             [--max-body-bytes 16777216] [--route-timeout-ms 10000] [--engine-timeout-ms 300000]
//             [--engine-connect-timeout-ms 2000] [--render-timeout-ms 10000]
//             [--engine-idle-timeout-ms 4000] [--io-threads 2] [--max-connections 50000]
//             [--drain-timeout-secs 30] [--router-fallback least-loaded]
//             [--nats-creds ... --nats-tls-*]
// Plain value; ParseGatewayConfig is thread-safe (reads the environment through a callback).
//
//   auto parsed = ParseGatewayConfig(argc, argv, getenv);  if (!parsed.ok()) { print; exit(2); }
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "router/common/flags.h"

namespace kvrouter {

// What the gateway does while no router answers (Gateway::RouterDown).
enum class RouterFallback {
  kLeastLoaded,  // "least-loaded": each request to the engine with the fewest of the gateway's own in flight
  kNone,         // "none": 503 no_workers
};

struct GatewayConfig {
  std::uint32_t http_port = 8000;                     // --http-port [1, 65535] (0 in tests: any free port)
  std::string http_host = "0.0.0.0";                  // --http-host
  std::string nats_server = "nats://127.0.0.1:4222";  // --nats-server / NATS_SERVER
  NatsSecurity nats_security;                         // --nats-creds, --nats-user, ... --nats-tls-*
  std::string ns = "dynamo";                          // --namespace
  std::string component = "backend";                  // --component
  std::uint32_t metrics_port = 9094;                  // --metrics-port: /metrics, /health, /ready (0: off)
  std::string metrics_host = "0.0.0.0";               // --metrics-host
  std::string render_url;                             // --render-url: token ids from here ("" = the engines)
  std::uint32_t retries = 2;                          // --retries [0, 16]: other workers tried before 502
  std::uint64_t max_body_bytes = 16ull << 20;         // --max-body-bytes >= 1
  std::uint32_t route_timeout_ms = 10'000;            // --route-timeout-ms >= 1: the router's answer (queue included)
  std::uint32_t engine_timeout_ms = 300'000;          // --engine-timeout-ms >= 1: engine silent this long fails
  // --engine-connect-timeout-ms >= 1: a TCP connect to an engine (or render host); one that
  // times out is the engine's failure and the request goes to another one.
  std::uint32_t engine_connect_timeout_ms = 2'000;
  // --render-timeout-ms >= 1: a render or /tokenize call silent this long (before or between
  // chunks) is given up and the next engine serving the model asked. Rendering is tokenizing,
  // not generating: milliseconds, seconds when the engine's API server is loaded or fetches a
  // prompt's images; the router's own wait (--route-timeout-ms) has the same default.
  std::uint32_t render_timeout_ms = 10'000;
  // --engine-idle-timeout-ms >= 1: a pooled engine connection unused this long is closed, below
  // the engines' own keep-alive (uvicorn, under vLLM and SGLang: 5 s) so that they rarely close
  // one first and a pick rarely finds it dead.
  std::uint32_t engine_idle_timeout_ms = 4'000;
  std::uint32_t io_threads = 2;            // --io-threads [1, 64]: HTTP threads (no thread per connection)
  std::uint32_t max_connections = 50'000;  // --max-connections >= 1: client connections open at once
  std::uint32_t drain_timeout_secs = 30;   // --drain-timeout-secs [0, 3600]: SIGTERM's wait for requests
  RouterFallback router_fallback = RouterFallback::kLeastLoaded;  // --router-fallback least-loaded | none
};

using ParsedGatewayArgs = ProgramArgs<GatewayConfig>;
Result<ParsedGatewayArgs> ParseGatewayConfig(int argc, const char* const* argv, const EnvLookup& env);

}  // namespace kvrouter
