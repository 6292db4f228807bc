#include "router/service/config.h"

#include <boost/program_options.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cctype>
#include <sstream>
#include <vector>

namespace kvrouter {
namespace po = boost::program_options;

namespace {

Status OutOfRange(std::string_view flag, std::string_view range) { return FlagOutOfRange(flag, range); }

po::options_description Describe() {
  const RouterConfig d;
  po::options_description desc("kvrouter options (each also read from DYN_<FLAG> in the environment)");
  // clang-format off
  desc.add_options()
    ("help,h", "print this help and exit")
    ("nats-server", po::value<std::string>()->default_value(d.nats_server), "NATS server URL (env NATS_SERVER)")
    ("metrics-port", po::value<std::uint32_t>()->default_value(d.metrics_port), "HTTP port of /metrics, /health and /ready (0 turns it off) [0, 65535]")
    ("metrics-host", po::value<std::string>()->default_value(d.metrics_host), "address the metrics port listens on")
    ("namespace", po::value<std::string>()->default_value(d.ns), "namespace of the subjects")
    ("component", po::value<std::string>()->default_value(d.component), "worker component name")
    ("block-size", po::value<std::uint32_t>()->default_value(d.block_size), "tokens per KV block [1, 65536]")
    ("router-mode", po::value<std::string>()->default_value(std::string(RouterModeName(d.mode))),
       "kv | round-robin | random | power-of-two | least-loaded | device-aware-weighted | direct")
    ("load-aware", po::bool_switch(), "kv cost with overlap credit 0, no KV events, no prediction")
    ("router-kv-overlap-score-credit", po::value<double>()->default_value(d.overlap_score_credit), "prefill blocks credited per cached block (>= 0)")
    ("router-prefill-load-scale", po::value<double>()->default_value(d.prefill_load_scale), "weight of prefill blocks against decode blocks (>= 0)")
    ("router-kv-events", po::bool_switch(), "use KV events from workers (default; env DYN_ROUTER_USE_KV_EVENTS=true|false)")
    ("no-router-kv-events", po::bool_switch(), "approximate mode: predict caches from routing decisions")
    ("no-router-track-prefill-tokens", po::bool_switch(), "leave active prefill tokens out of the load")
    ("router-temperature", po::value<double>()->default_value(d.temperature), "0 = lowest cost; > 0 = softmax sampling")
    ("router-queue-threshold", po::value<double>(), "queue when every rank has prefill > t * max_num_batched_tokens (> 0; off by default)")
    ("router-queue-policy", po::value<std::string>()->default_value(std::string(QueuePolicyName(d.queue_policy))), "fcfs | wspt | lcfs")
    ("router-queue-max", po::value<std::uint32_t>()->default_value(d.queue_max), "queued requests before 'overloaded' (>= 1)")
    ("router-ttl-secs", po::value<double>()->default_value(d.ttl_secs), "approximate mode: seconds a predicted block lives (> 0)")
    ("router-max-tree-size", po::value<std::uint64_t>()->default_value(d.max_tree_size), "approximate mode: predicted blocks before pruning (>= 1)")
    ("router-session-affinity-ttl-secs", po::value<double>()->default_value(d.session_affinity_ttl_secs), "a session_id sticks to its worker this long after its last use (0: off; >= 0)")
    ("router-max-sessions", po::value<std::uint64_t>()->default_value(d.max_sessions), "session bindings kept, the least recently used dropped first (>= 1)")
    ("router-prune-target-ratio", po::value<double>()->default_value(d.prune_target_ratio), "approximate mode: prune down to ratio * max (0, 1]")
    ("router-max-dp-size", po::value<std::uint32_t>()->default_value(d.max_dp_size), "dp ranks a worker may register; larger registrations are refused [1, 65536]")
    ("router-max-worker-ranks", po::value<std::uint64_t>()->default_value(d.max_worker_ranks), "(worker, dp_rank) pairs tracked; new workers beyond it are refused (>= 1)")
    ("router-max-workers", po::value<std::uint64_t>()->default_value(d.max_workers), "workers known (registered or not) past which events from unknown worker ids are refused; registrations are bounded by --router-max-worker-ranks (>= 1)")
    ("router-max-active-requests", po::value<std::uint32_t>()->default_value(d.max_active_requests), "booked requests before route answers 'overloaded' (>= 1)")
    ("router-max-active-blocks", po::value<std::uint64_t>()->default_value(d.max_active_blocks), "prompt blocks of booked requests (and, separately, of queued ones) before 'overloaded' (>= 1)")
    ("router-max-prompt-tokens", po::value<std::uint32_t>()->default_value(d.max_prompt_tokens), "longest prompt; longer ones get 'invalid_argument' (>= 1)")
    ("router-max-worker-blocks", po::value<std::uint64_t>()->default_value(d.max_worker_blocks), "indexed blocks per worker rank when it announces no total_kv_blocks (else twice that); stored events beyond it are dropped (>= 1)")
    ("no-router-recovery", po::bool_switch(), "never ask workers for missed events or dumps (gaps are only counted)")
    ("router-recovery-wait-ms", po::value<std::uint32_t>()->default_value(d.recovery_wait_ms), "after start, a route waits at most this long for the start-up dumps")
    ("router-replica-sync", po::bool_switch(), "share active-request bookings with other router replicas")
    ("router-id", po::value<std::uint64_t>()->default_value(0), "this replica's id in replica sync and on its own stats subject router.stats.<id> (0: random)")
    ("device-ratio", po::value<double>()->default_value(d.device_ratio), "device-aware-weighted: accelerator weight vs CPU (> 0)")
    ("router-host-cache-hit-weight", po::value<double>()->default_value(d.host_cache_hit_weight), "overlap credit of a block a worker holds on host (CPU) only, against 1 on device [0, 1]")
    ("router-disk-cache-hit-weight", po::value<double>()->default_value(d.disk_cache_hit_weight), "overlap credit of a block a worker holds on disk or external storage only [0, 1]")
    ("router-index-shards", po::value<std::uint32_t>()->default_value(d.index_shards), "index shards, one thread each [1, 64]")
    ("router-disagg-policy", po::value<std::string>()->default_value(std::string(DisaggPolicyName(d.disagg.policy))),
       "when a request with prefill and decode workers skips the prefill pool: predicted | always | never | isl_bounding | prefill_load | isl_or_load")
    ("router-conditional-disagg", po::bool_switch(), "Dynamo's switch: --router-conditional-disagg-policy (isl_bounding) instead of --router-disagg-policy")
    ("router-conditional-disagg-policy", po::value<std::string>()->default_value("isl_bounding"), "with --router-conditional-disagg: isl_bounding | prefill_load | isl_or_load")
    ("router-conditional-disagg-eff-isl-threshold", po::value<double>()->default_value(d.disagg.eff_isl_threshold), "isl_bounding: skip the prefill pool below this many uncached tokens (>= 0)")
    ("router-conditional-disagg-eff-isl-ratio-threshold", po::value<double>()->default_value(d.disagg.eff_isl_ratio_threshold), "isl_bounding: and below this uncached share of the prompt [0, 1]")
    ("router-conditional-disagg-prefill-busy-threshold", po::value<double>(), "prefill_load: skip the prefill pool when its chosen rank has prefill > t * max_num_batched_tokens (> 0; default --router-queue-threshold)")
    ("router-decode-fallback", po::value<std::string>()->default_value("true")->implicit_value("true"), "route to a decode worker whole when no prefill worker is usable (true | false)")
    ("router-kv-bytes-per-token", po::value<double>()->default_value(d.disagg.kv_bytes_per_token), "KV bytes of one token, for the transfer's prior (> 0)")
    ("router-kv-transfer-gbps", po::value<double>()->default_value(d.disagg.kv_transfer_gbps), "prefill-to-decode KV bandwidth in Gbit/s, for the transfer's prior (> 0)");
  // clang-format on
  AddNatsSecurityFlags(desc);
  return desc;
}

// Connection, selection and queue flags, validated.
Status ReadRouting(const po::variables_map& vm, RouterConfig& c) {
  c.nats_server = vm["nats-server"].as<std::string>();
  c.nats_security = ReadNatsSecurity(vm);
  c.metrics_port = vm["metrics-port"].as<std::uint32_t>();
  if (c.metrics_port > 65535) return OutOfRange("metrics-port", "in [0, 65535]");
  c.metrics_host = vm["metrics-host"].as<std::string>();
  c.ns = vm["namespace"].as<std::string>();
  c.component = vm["component"].as<std::string>();
  c.block_size = vm["block-size"].as<std::uint32_t>();
  if (c.block_size < 1 || c.block_size > 65536) return OutOfRange("block-size", "in [1, 65536]");
  auto m = RouterModeFromName(vm["router-mode"].as<std::string>());
  if (!m)
    return OutOfRange("router-mode",
                      "one of kv, round-robin, random, power-of-two, least-loaded, device-aware-weighted, direct");
  c.mode = *m;
  // Either of Dynamo's weights, given on the command line or in the environment, selects Dynamo's
  // formula with exactly those values (a user migrating from Dynamo gets Dynamo's decisions).
  const bool dynamo_weights =
      !vm["router-kv-overlap-score-credit"].defaulted() || !vm["router-prefill-load-scale"].defaulted();
  c.cost_model = dynamo_weights ? CostModel::kKvBlocks : CostModel::kPredicted;
  c.overlap_score_credit = vm["router-kv-overlap-score-credit"].as<double>();
  if (!(c.overlap_score_credit >= 0)) return OutOfRange("router-kv-overlap-score-credit", ">= 0");
  c.prefill_load_scale = vm["router-prefill-load-scale"].as<double>();
  if (!(c.prefill_load_scale >= 0)) return OutOfRange("router-prefill-load-scale", ">= 0");
  if (vm["router-kv-events"].as<bool>() && vm["no-router-kv-events"].as<bool>()) {
    return InvalidArgument("--router-kv-events and --no-router-kv-events contradict each other");
  }
  c.use_kv_events = !vm["no-router-kv-events"].as<bool>();
  c.track_prefill_tokens = !vm["no-router-track-prefill-tokens"].as<bool>();
  c.temperature = vm["router-temperature"].as<double>();
  if (!(c.temperature >= 0)) return OutOfRange("router-temperature", ">= 0");
  if (vm.count("router-queue-threshold")) {
    c.queue_threshold = vm["router-queue-threshold"].as<double>();
    if (!(*c.queue_threshold > 0)) return OutOfRange("router-queue-threshold", "> 0");
  }
  const std::string policy = vm["router-queue-policy"].as<std::string>();
  if (policy == "fcfs")
    c.queue_policy = QueuePolicy::kFcfs;
  else if (policy == "wspt")
    c.queue_policy = QueuePolicy::kWspt;
  else if (policy == "lcfs")
    c.queue_policy = QueuePolicy::kLcfs;
  else
    return OutOfRange("router-queue-policy", "one of fcfs, wspt, lcfs");
  c.queue_max = vm["router-queue-max"].as<std::uint32_t>();
  if (c.queue_max < 1) return OutOfRange("router-queue-max", ">= 1");
  return Status::Ok();
}

// Disaggregated prefill and decode (section 13), validated.
Status ReadDisagg(const po::variables_map& vm, RouterConfig& c) {
  DisaggOptions& o = c.disagg;
  const bool conditional = vm["router-conditional-disagg"].as<bool>();
  const std::string flag = conditional ? "router-conditional-disagg-policy" : "router-disagg-policy";
  const auto policy = DisaggPolicyFromName(vm[flag].as<std::string>());
  if (!policy) return OutOfRange(flag, "one of predicted, always, never, isl_bounding, prefill_load, isl_or_load");
  if (conditional && (*policy == DisaggPolicy::kPredicted || *policy == DisaggPolicy::kAlways ||
                      *policy == DisaggPolicy::kNever)) {
    return OutOfRange(flag, "one of isl_bounding, prefill_load, isl_or_load");
  }
  o.policy = *policy;
  o.eff_isl_threshold = vm["router-conditional-disagg-eff-isl-threshold"].as<double>();
  if (!(o.eff_isl_threshold >= 0)) return OutOfRange("router-conditional-disagg-eff-isl-threshold", ">= 0");
  o.eff_isl_ratio_threshold = vm["router-conditional-disagg-eff-isl-ratio-threshold"].as<double>();
  if (!(o.eff_isl_ratio_threshold >= 0 && o.eff_isl_ratio_threshold <= 1)) {
    return OutOfRange("router-conditional-disagg-eff-isl-ratio-threshold", "in [0, 1]");
  }
  if (vm.count("router-conditional-disagg-prefill-busy-threshold")) {
    o.prefill_busy_threshold = vm["router-conditional-disagg-prefill-busy-threshold"].as<double>();
    if (!(*o.prefill_busy_threshold > 0)) return OutOfRange("router-conditional-disagg-prefill-busy-threshold", "> 0");
  } else {
    o.prefill_busy_threshold = c.queue_threshold;
  }
  if ((o.policy == DisaggPolicy::kPrefillLoad || o.policy == DisaggPolicy::kIslOrLoad) && !o.prefill_busy_threshold) {
    return InvalidArgument(fmt::format(
        "--{} {} needs --router-conditional-disagg-prefill-busy-threshold or --router-queue-threshold", flag,
        DisaggPolicyName(o.policy)));
  }
  const auto fallback = ParseBoolValue(vm["router-decode-fallback"].as<std::string>());
  if (!fallback) return OutOfRange("router-decode-fallback", "true or false");
  o.decode_fallback = *fallback;
  o.kv_bytes_per_token = vm["router-kv-bytes-per-token"].as<double>();
  if (!(o.kv_bytes_per_token > 0) || !std::isfinite(o.kv_bytes_per_token)) {
    return OutOfRange("router-kv-bytes-per-token", "> 0");
  }
  o.kv_transfer_gbps = vm["router-kv-transfer-gbps"].as<double>();
  if (!(o.kv_transfer_gbps > 0) || !std::isfinite(o.kv_transfer_gbps)) {
    return OutOfRange("router-kv-transfer-gbps", "> 0");
  }
  return Status::Ok();
}

// Approximate mode, bounds and the rest, validated.
Status ReadLimits(const po::variables_map& vm, RouterConfig& c) {
  c.ttl_secs = vm["router-ttl-secs"].as<double>();
  if (!(c.ttl_secs > 0)) return OutOfRange("router-ttl-secs", "> 0");
  c.max_tree_size = vm["router-max-tree-size"].as<std::uint64_t>();
  if (c.max_tree_size < 1) return OutOfRange("router-max-tree-size", ">= 1");
  c.session_affinity_ttl_secs = vm["router-session-affinity-ttl-secs"].as<double>();
  if (!(c.session_affinity_ttl_secs >= 0) || !std::isfinite(c.session_affinity_ttl_secs)) {
    return OutOfRange("router-session-affinity-ttl-secs", ">= 0");
  }
  c.max_sessions = vm["router-max-sessions"].as<std::uint64_t>();
  if (c.max_sessions < 1) return OutOfRange("router-max-sessions", ">= 1");
  c.prune_target_ratio = vm["router-prune-target-ratio"].as<double>();
  if (!(c.prune_target_ratio > 0 && c.prune_target_ratio <= 1))
    return OutOfRange("router-prune-target-ratio", "in (0, 1]");
  c.max_dp_size = vm["router-max-dp-size"].as<std::uint32_t>();
  if (c.max_dp_size < 1 || c.max_dp_size > 65536) return OutOfRange("router-max-dp-size", "in [1, 65536]");
  c.max_worker_ranks = vm["router-max-worker-ranks"].as<std::uint64_t>();
  if (c.max_worker_ranks < 1) return OutOfRange("router-max-worker-ranks", ">= 1");
  c.max_workers = vm["router-max-workers"].as<std::uint64_t>();
  if (c.max_workers < 1) return OutOfRange("router-max-workers", ">= 1");
  c.max_active_requests = vm["router-max-active-requests"].as<std::uint32_t>();
  if (c.max_active_requests < 1) return OutOfRange("router-max-active-requests", ">= 1");
  c.max_active_blocks = vm["router-max-active-blocks"].as<std::uint64_t>();
  if (c.max_active_blocks < 1) return OutOfRange("router-max-active-blocks", ">= 1");
  c.max_prompt_tokens = vm["router-max-prompt-tokens"].as<std::uint32_t>();
  if (c.max_prompt_tokens < 1) return OutOfRange("router-max-prompt-tokens", ">= 1");
  c.max_worker_blocks = vm["router-max-worker-blocks"].as<std::uint64_t>();
  if (c.max_worker_blocks < 1) return OutOfRange("router-max-worker-blocks", ">= 1");
  c.recovery = !vm["no-router-recovery"].as<bool>();
  c.recovery_wait_ms = vm["router-recovery-wait-ms"].as<std::uint32_t>();
  c.replica_sync = vm["router-replica-sync"].as<bool>();
  c.router_id = vm["router-id"].as<std::uint64_t>();
  c.device_ratio = vm["device-ratio"].as<double>();
  if (!(c.device_ratio > 0)) return OutOfRange("device-ratio", "> 0");
  c.host_cache_hit_weight = vm["router-host-cache-hit-weight"].as<double>();
  if (!(c.host_cache_hit_weight >= 0 && c.host_cache_hit_weight <= 1))
    return OutOfRange("router-host-cache-hit-weight", "in [0, 1]");
  c.disk_cache_hit_weight = vm["router-disk-cache-hit-weight"].as<double>();
  if (!(c.disk_cache_hit_weight >= 0 && c.disk_cache_hit_weight <= 1))
    return OutOfRange("router-disk-cache-hit-weight", "in [0, 1]");
  c.index_shards = vm["router-index-shards"].as<std::uint32_t>();
  if (c.index_shards < 1 || c.index_shards > 64) return OutOfRange("router-index-shards", "in [1, 64]");
  if (Status s = ReadDisagg(vm, c); !s.ok()) return s;
  c.load_aware = vm["load-aware"].as<bool>();
  if (c.load_aware) {  // docs/design.md: pure load balancing on tracked load
    c.mode = RouterMode::kKv;
    c.overlap_score_credit = 0;
    c.cost_model = CostModel::kKvBlocks;
    c.use_kv_events = false;
  }
  return Status::Ok();
}

}  // namespace

Result<ParsedArgs> ParseRouterConfig(int argc, const char* const* argv, const EnvLookup& env) {
  // Environment values for flags not given on the command line. Two flags read Dynamo's
  // variable names: DYN_ROUTER_USE_KV_EVENTS=true|false, DYN_ROUTER_TRACK_PREFILL_TOKENS=false.
  auto boolean_rule = [](std::string variable, std::string if_true, std::string if_false) {
    return EnvRule{
        std::move(variable),
        [t = std::move(if_true), f = std::move(if_false)](std::string_view v) -> Result<std::optional<std::string>> {
          auto b = ParseBoolValue(std::string(v));
          if (!b) return InvalidArgument("must be true or false");
          const std::string& arg = *b ? t : f;
          return arg.empty() ? std::nullopt : std::optional<std::string>(arg);
        }};
  };
  const std::map<std::string, EnvRule> rules = {
      {"router-kv-events", boolean_rule("DYN_ROUTER_USE_KV_EVENTS", "--router-kv-events", "--no-router-kv-events")},
      {"no-router-kv-events", EnvRule{"", nullptr}},  // read through DYN_ROUTER_USE_KV_EVENTS
      {"no-router-track-prefill-tokens",
       boolean_rule("DYN_ROUTER_TRACK_PREFILL_TOKENS", "", "--no-router-track-prefill-tokens")},
  };
  return ParseProgram<RouterConfig>(Describe(), argc, argv, env, rules,
                                    [](const po::variables_map& vm, RouterConfig& c) {
                                      if (Status s = ReadRouting(vm, c); !s.ok()) return s;
                                      return ReadLimits(vm, c);
                                    });
}

SchedulerOptions SchedulerOptionsOf(const RouterConfig& c) {
  SchedulerOptions o{.mode = c.mode,
                     .block_size = c.block_size,
                     .cost = {.model = c.cost_model,
                              .block_size = c.block_size,
                              .overlap_score_credit = c.overlap_score_credit,
                              .prefill_load_scale = c.prefill_load_scale,
                              .temperature = c.temperature,
                              .track_prefill_tokens = c.track_prefill_tokens,
                              .device_ratio = c.device_ratio,
                              .host_weight = c.host_cache_hit_weight,
                              .disk_weight = c.disk_cache_hit_weight},
                     .use_kv_events = c.use_kv_events,
                     .queue_threshold = c.queue_threshold,
                     .max_prompt_tokens = c.max_prompt_tokens,
                     .max_active_requests = c.max_active_requests,
                     .max_active_blocks = c.max_active_blocks,
                     .disagg = c.disagg};
  if (!c.use_kv_events && !c.load_aware) {
    o.predictions =
        SchedulerOptions::Predictions{.ttl = std::chrono::milliseconds(static_cast<std::int64_t>(c.ttl_secs * 1000)),
                                      .max_blocks = c.max_tree_size,
                                      .prune_target_ratio = c.prune_target_ratio};
  }
  return o;
}

}  // namespace kvrouter
