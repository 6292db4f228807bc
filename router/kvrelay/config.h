// kvrelay's flags (each also from DYN_<FLAG>, NATS_SERVER for --nats-server):
//   kvrelay --nats-server URL --zmq-endpoint tcp://HOST:5557 [--zmq-replay-endpoint tcp://HOST:5558]
//           [--zmq-topic T] --worker-id ID [--dp-rank R] --block-size BS [--total-kv-blocks N]
//           [--max-num-seqs N] [--max-num-batched-tokens N] [--namespace ns] [--component comp]
//           [--device gpu] [--heartbeat-ms 1000] [--lease-ms 3000] [--metrics-port 9093]
//           [--engine-url http://HOST:PORT --model NAME[,NAME...] [--model NAME]...
//            [--health-interval-ms 1000] [--health-timeout-ms =interval] [--health-failures 2]]
//           [--role both|prefill|decode] [--kv-connector nixl|sglang] [--bootstrap-port 8998]
#pragma once

#include <optional>
#include <string>

#include "router/common/flags.h"
#include "router/kvrelay/engine_watch.h"
#include "router/kvrelay/relay.h"

namespace kvrouter {

struct RelayConfig {
  std::string nats_server = "nats://127.0.0.1:4222";
  NatsSecurity nats_security;  // --nats-creds, --nats-user, ... --nats-tls-*
  std::string zmq_endpoint;    // required
  std::optional<std::string> zmq_replay_endpoint;
  std::string zmq_topic;
  RelayOptions relay;  // worker_id and block_size required
  // --engine-url (relay.http_url: checked by ParseHttpUrl, without a trailing slash) and --model
  // (relay.models) are in `relay`; empty: the relay announces no HTTP and watches nothing. With
  // them relay.register_when is kEngineUp and `health` says how the engine's /health is watched:
  // --health-interval-ms (1,000), --health-timeout-ms (default: the interval), --health-failures (2).
  EngineWatchOptions health;
  std::uint32_t metrics_port = 9093;  // /metrics, /health, /ready (0: off)
  std::string metrics_host = "0.0.0.0";
};

using ParsedRelayArgs = ProgramArgs<RelayConfig>;
Result<ParsedRelayArgs> ParseRelayConfig(int argc, const char* const* argv, const EnvLookup& env);

}  // namespace kvrouter
