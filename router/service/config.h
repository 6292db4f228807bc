// RouterConfig: every kvrouter flag, parsed once (Boost.Program_options) into typed values.
// Each flag can also come from the environment: DYN_<FLAG_IN_UPPER_SNAKE_CASE> (for example
// DYN_ROUTER_MODE=kv), NATS_SERVER for --nats-server, DYN_ROUTER_USE_KV_EVENTS=true|false for
// --router-kv-events/--no-router-kv-events and DYN_ROUTER_TRACK_PREFILL_TOKENS=false for
// --no-router-track-prefill-tokens. The command line wins over the environment.
// Bad values are refused with a message naming the flag and its allowed range.
// Plain value; ParseRouterConfig is thread-safe (reads the environment through a callback).
//
//   auto cfg = ParseRouterConfig(argc, argv, getenv);  if (!cfg.ok()) { print; exit(2); }
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include "events/base/status.h"
#include "router/common/flags.h"
#include "router/scheduling/cost_disagg.h"
#include "router/scheduling/policy.h"
#include "router/scheduling/scheduler.h"

namespace kvrouter {

struct RouterConfig {
  // Connection and naming.
  std::string nats_server = "nats://127.0.0.1:4222";  // --nats-server / NATS_SERVER
  NatsSecurity nats_security;                         // --nats-creds, --nats-user, ... --nats-tls-*
  std::uint32_t metrics_port = 9091;                  // --metrics-port: /metrics, /health, /ready (0: off)
  std::string metrics_host = "0.0.0.0";               // --metrics-host: the address it listens on
  std::string ns = "dynamo";                          // --namespace
  std::string component = "backend";                  // --component
  std::uint32_t block_size = 64;                      // --block-size, tokens per KV block [1, 65536]

  // Selection (Dynamo's names and defaults).
  RouterMode mode = RouterMode::kRoundRobin;  // --router-mode
  bool load_aware = false;                    // --load-aware: kv cost, credit 0, no events
  // The kv cost: kPredicted unless credit or scale is set explicitly (then Dynamo's formula).
  CostModel cost_model = CostModel::kPredicted;
  double overlap_score_credit = 1.0;  // --router-kv-overlap-score-credit >= 0
  double prefill_load_scale = 1.0;    // --router-prefill-load-scale >= 0
  bool use_kv_events = true;          // --router-kv-events / --no-router-kv-events
  bool track_prefill_tokens = true;   // --no-router-track-prefill-tokens
  double temperature = 0.0;           // --router-temperature >= 0

  // Queue (off unless a threshold is given).
  std::optional<double> queue_threshold;          // --router-queue-threshold > 0
  QueuePolicy queue_policy = QueuePolicy::kFcfs;  // --router-queue-policy fcfs|wspt|lcfs
  std::uint32_t queue_max = 10000;                // --router-queue-max >= 1

  // Approximate mode (no KV events).
  double ttl_secs = 120;                  // --router-ttl-secs > 0
  std::uint64_t max_tree_size = 1 << 20;  // --router-max-tree-size >= 1
  double prune_target_ratio = 0.8;        // --router-prune-target-ratio in (0, 1]

  // Bounds on what peers can make the router hold (docs/protocol.md sections 4 and 5).
  std::uint32_t max_dp_size = 1024;           // --router-max-dp-size [1, 65536]: dp ranks per worker
  std::uint64_t max_worker_ranks = 1 << 18;   // --router-max-worker-ranks >= 1: (worker, dp_rank) pairs
  std::uint64_t max_workers = 1 << 16;        // --router-max-workers >= 1: known workers past
                                              //   which events from unknown ids are refused
  std::uint32_t max_active_requests = 65536;  // --router-max-active-requests >= 1: booked requests
  std::uint64_t max_active_blocks = 1 << 22;  // --router-max-active-blocks >= 1: blocks of booked
                                              //   requests, and again of queued ones
  std::uint32_t max_prompt_tokens = 1 << 20;  // --router-max-prompt-tokens >= 1
  std::uint64_t max_worker_blocks = 1 << 22;  // --router-max-worker-blocks >= 1: indexed blocks
                                              //   per rank of a worker that announces no
                                              //   total_kv_blocks (else twice that)

  // Recovery (docs/protocol.md section 6): ask workers for what the router missed.
  bool recovery = true;                   // --no-router-recovery turns it off
  std::uint32_t recovery_wait_ms = 1000;  // --router-recovery-wait-ms: a route waits
                                          //   this long at most for start-up dumps

  // Session affinity (docs/protocol.md section 11): a route's session_id goes to the rank the
  // session last went to while the binding is younger than this (0: off).
  double session_affinity_ttl_secs = 0;  // --router-session-affinity-ttl-secs >= 0
  std::uint64_t max_sessions = 100000;   // --router-max-sessions >= 1: bindings kept (LRU)

  bool replica_sync = false;            // --router-replica-sync
  std::uint64_t router_id = 0;          // --router-id: this replica's id (0: random)
  double device_ratio = 8;              // --device-ratio > 0
  double host_cache_hit_weight = 0.75;  // --router-host-cache-hit-weight in [0, 1]
  double disk_cache_hit_weight = 0.25;  // --router-disk-cache-hit-weight in [0, 1]
  std::uint32_t index_shards = 2;       // --router-index-shards [1, 64]

  // Disaggregated prefill and decode (docs/protocol.md section 13): --router-disagg-policy,
  // Dynamo's --router-conditional-disagg*, --router-decode-fallback, --router-kv-bytes-per-token,
  // --router-kv-transfer-gbps.
  DisaggOptions disagg;
};

// Parses argv (argv[0] is the program) and the environment. Unknown flags and bad values give
// InvalidArgument naming the flag; --help gives help = true and the help text.
using ParsedArgs = ProgramArgs<RouterConfig>;
// The scheduling half of the configuration (mode, costs, queue threshold, bounds, approximate
// mode's predictions when KV events are off and --load-aware is not set).
SchedulerOptions SchedulerOptionsOf(const RouterConfig& config);
Result<ParsedArgs> ParseRouterConfig(int argc, const char* const* argv, const EnvLookup& env);

}  // namespace kvrouter
