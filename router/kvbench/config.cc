#include "router/kvbench/config.h"

#include <boost/program_options.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>

namespace kvrouter::bench {
namespace po = boost::program_options;

namespace {

constexpr const char* kTuningFlags[] = {
    "router-kv-overlap-score-credit", "router-prefill-load-scale", "router-temperature",
    "router-queue-threshold",         "router-queue-policy",       "router-conditional-disagg-prefill-busy-threshold",
    "router-kv-bytes-per-token",      "router-kv-transfer-gbps"};

// Dynamo's default --router-queue-threshold, which its prefill_load reads: given to the policies
// that need a prefill busy threshold when neither that flag nor the busy threshold is.
constexpr const char* kDynamoQueueThreshold = "4";

po::options_description Describe() {
  const OnlineOptions on;
  const OfflineOptions off;
  const SyntheticOptions syn;
  po::options_description desc("kvbench options (each also read from DYN_<FLAG> in the environment)");
  // clang-format off
  desc.add_options()
    ("help,h", "print this help")
    ("offline", po::bool_switch(), "simulate the router and engines on virtual time in this process; only then does the report have each worker's busy time (its engine steps summed) and busy_max/mean: online runs do not see the engines' steps")
    ("nats-server", po::value<std::string>()->default_value(on.nats_url), "online: NATS URL (env NATS_SERVER)")
    ("namespace", po::value<std::string>()->default_value(on.ns), "online: the router's namespace")
    ("concurrency", po::value<std::uint32_t>()->default_value(static_cast<std::uint32_t>(on.concurrency)), "online: requests in flight at most (>= 1)")
    ("timeout", po::value<double>()->default_value(on.timeout_s), "online: seconds to wait for the last responses (> 0)")
    ("label", po::value<std::string>()->default_value(on.label), "online: the run's name in the report")
    ("request-timeout", po::value<double>()->default_value(on.request_timeout_s), "online: seconds a request may go without a message before it is tried again (0 = never)")
    ("retries", po::value<std::uint32_t>()->default_value(on.retries), "online: tries after the first, on no responders, no_workers, timeout or --request-timeout")
    ("gateway", po::value<std::string>(), "online through HTTP: kvgateway's base URL (http://host:port); requests go to its /v1/completions, streamed, with prompts of one token per byte as kvmocker's HTTP face reads them; the router's stats still come over --nats-server")
    ("model", po::value<std::string>()->default_value(on.model), "--gateway: the model asked for")
    ("abort-fraction", po::value<double>()->default_value(on.abort_fraction), "--gateway: the share of requests (in [0, 1), chosen by --seed) whose client goes away at a random point, counted as aborted, not as errors")
    ("wait-workers", po::value<std::uint32_t>()->default_value(0), "online: first wait until the router knows this many worker ranks")
    ("prefill-workers", po::value<std::uint32_t>()->default_value(0), "a disaggregated fleet: offline, the first N of --workers register as prefill workers and the rest as decode workers (N < --workers); online, the wait for --wait-workers ranks (> N) also waits until N of them are prefill workers. 0: aggregated")
    ("slo-ttft-ms", po::value<double>()->default_value(SloTargets{}.ttft_ms), "SLO goodput: a request's TTFT at most this (ms, > 0)")
    ("slo-tpot-ms", po::value<double>()->default_value(SloTargets{}.tpot_ms), "SLO goodput: a request's time per output token after the first at most this (ms, > 0)")
    ("trace", po::value<std::string>(), "Mooncake JSONL trace")
    ("synthetic", po::bool_switch(), "use a synthetic workload (--workload) instead of a trace")
    ("workload", po::value<std::string>()->default_value("chat"), "synthetic: chat, system-prompts, agentic, bursts or fanout (implies --synthetic)")
    ("sessions", po::value<std::uint32_t>()->default_value(syn.sessions), "synthetic: conversations (system-prompts: users; bursts: bursts); default per workload")
    ("turns", po::value<std::uint32_t>()->default_value(syn.turns), "synthetic: requests per conversation (bursts: per burst); default per workload")
    ("rate", po::value<double>()->default_value(syn.requests_per_second), "synthetic: requests per second (> 0); default per workload")
    ("max-requests", po::value<std::uint64_t>()->default_value(0), "replay at most this many requests (0 = all)")
    ("speedup", po::value<double>()->default_value(1), "divide trace inter-arrival times by this (> 0)")
    ("workers", po::value<std::uint32_t>()->default_value(off.workers), "offline: simulated workers (>= 1)")
    ("num-gpu-blocks", po::value<std::uint32_t>()->default_value(off.engine.num_gpu_blocks), "offline: KV blocks per worker")
    ("block-size", po::value<std::uint32_t>()->default_value(off.engine.block_size), "offline: tokens per KV block")
    ("max-num-seqs", po::value<std::uint32_t>()->default_value(off.engine.max_num_seqs), "offline: running sequences per worker")
    ("max-num-batched-tokens", po::value<std::uint32_t>()->default_value(off.engine.max_num_batched_tokens), "offline: tokens per engine step")
    ("chunked-prefill", po::bool_switch(), "offline: engines prefill long prompts in chunks over several steps, decode tokens first, as vLLM V1 does (default: each prompt whole in one step)")
    ("speedup-ratio", po::value<double>()->default_value(off.engine.speedup_ratio), "offline: engine speed-up of every worker (divides every duration; finite, > 0)")
    ("kv-bytes-per-token", po::value<std::uint64_t>()->default_value(off.engine.kv_bytes_per_token), "offline: KV bytes of one token, priced by a decode engine's pull (>= 1; the router's --router-kv-bytes-per-token unless that is given)")
    ("kv-transfer-gbps", po::value<double>()->default_value(off.engine.kv_transfer_gbps), "offline: Gbit/s a decode engine pulls KV at (finite, > 0; the router's --router-kv-transfer-gbps unless that is given)")
    ("kv-lease-ms", po::value<std::uint32_t>()->default_value(off.engine.kv_lease_ms), "offline: ms a prefill engine keeps a leg's blocks for the pull, divided by --speedup-ratio")
    ("worker-speedups", po::value<NumberList>(), "offline: one speed per worker, separated by commas, exactly --workers of them (1,1,0.25,0.25 with --workers 4): worker i's engine speedup is --speedup-ratio x the i-th value (each finite, > 0; default: 1 for every worker)")
    ("router-mode", po::value<std::string>()->default_value("kv"), "offline: router mode of the run")
    ("no-router-kv-events", po::bool_switch(), "offline: approximate mode")
    ("router-kv-overlap-score-credit", po::value<std::string>(), "offline: passed to the router")
    ("router-prefill-load-scale", po::value<std::string>(), "offline: passed to the router")
    ("router-temperature", po::value<std::string>(), "offline: passed to the router")
    ("router-queue-threshold", po::value<std::string>(), "offline: passed to the router")
    ("router-queue-policy", po::value<std::string>(), "offline: passed to the router")
    ("router-disagg-policy", po::value<std::string>(), "offline: passed to the router (one run; --compare --prefill-workers runs each policy)")
    ("router-conditional-disagg-prefill-busy-threshold", po::value<std::string>(), "offline: passed to the router; prefill_load and isl_or_load get Dynamo's default queue threshold, 4, when neither this nor --router-queue-threshold is given")
    ("router-kv-bytes-per-token", po::value<std::string>(), "offline: passed to the router")
    ("router-kv-transfer-gbps", po::value<std::string>(), "offline: passed to the router")
    ("compare", po::bool_switch(), "offline: run kv (both costs), round-robin, random and approximate mode and print one table; with --prefill-workers, each --router-disagg-policy on the P/D fleet and the aggregated fleet of the same size")
    ("json", po::value<std::string>(), "write the summary (an array with --compare) as JSON here (worker_busy_ms and busy_time_max_over_mean offline only)")
    ("plot", po::value<std::string>(), "draw kv hit rate and TTFT p50/p99 by mode into this file (.svg, else PNG) with gnuplot")
    ("seed", po::value<std::uint64_t>()->default_value(syn.seed), "random seed (router tie-breaks, synthetic workload, --abort-fraction's draws)");
  // clang-format on
  AddNatsSecurityFlags(desc);
  return desc;
}

// The offline runs: --compare's modes (or with --prefill-workers its policies and the
// aggregated fleet), or the one --router-mode (+ approximate, + --router-disagg-policy) asks
// for, each with the tuning flags passed through.
std::vector<BenchRun> Runs(const po::variables_map& vm) {
  std::vector<BenchRun> runs;
  const std::uint32_t prefill_workers = vm["prefill-workers"].as<std::uint32_t>();
  if (vm["compare"].as<bool>() && prefill_workers > 0) {
    for (const char* policy : kDisaggPolicies) {
      runs.push_back({fmt::format("P/D {}{}", policy, runs.empty() ? " (default)" : ""),
                      {"--router-mode", "kv", "--router-disagg-policy", policy},
                      prefill_workers});
    }
    runs.push_back({"aggregated", {"--router-mode", "kv"}, 0});
  } else if (vm["compare"].as<bool>()) {
    runs = {{"kv (default)", {"--router-mode", "kv"}},
            {"kv, Dynamo's cost", {"--router-mode", "kv", "--router-prefill-load-scale", "1"}},
            {"round-robin", {"--router-mode", "round-robin"}},
            {"random", {"--router-mode", "random"}},
            {"kv-approx", {"--router-mode", "kv", "--no-router-kv-events"}}};
  } else {
    const std::string mode = vm["router-mode"].as<std::string>();
    BenchRun r{mode, {"--router-mode", mode}};
    if (vm["no-router-kv-events"].as<bool>()) {
      r.router_flags.push_back("--no-router-kv-events");
      r.label += "-approx";
    }
    if (vm.count("router-disagg-policy")) {
      r.router_flags.push_back("--router-disagg-policy");
      r.router_flags.push_back(vm["router-disagg-policy"].as<std::string>());
      r.label += " " + r.router_flags.back();
    }
    r.prefill_workers = prefill_workers;
    runs.push_back(std::move(r));
  }
  const bool busy_threshold_given =
      vm.count("router-queue-threshold") || vm.count("router-conditional-disagg-prefill-busy-threshold");
  for (BenchRun& r : runs) {
    for (const char* f : kTuningFlags) {
      if (!vm.count(f)) continue;
      r.router_flags.push_back(std::string("--") + f);
      r.router_flags.push_back(vm[f].as<std::string>());
    }
    const auto policy = std::find(r.router_flags.begin(), r.router_flags.end(), "--router-disagg-policy");
    const bool needs_busy_threshold = policy != r.router_flags.end() && policy + 1 != r.router_flags.end() &&
                                      (policy[1] == "prefill_load" || policy[1] == "isl_or_load");
    if (needs_busy_threshold && !busy_threshold_given) {
      r.router_flags.insert(r.router_flags.end(),
                            {"--router-conditional-disagg-prefill-busy-threshold", kDynamoQueueThreshold});
    }
  }
  return runs;
}

Status ReadBenchConfig(const po::variables_map& vm, BenchConfig& c) {
  c.offline = vm["offline"].as<bool>();
  if (!c.offline && vm["compare"].as<bool>()) {
    return InvalidArgument(
        "--compare runs several router modes and needs --offline (online, the running router's "
        "mode is what you measure)");
  }
  if (vm["compare"].as<bool>() && vm.count("router-disagg-policy")) {
    return InvalidArgument("--router-disagg-policy picks one policy; --compare --prefill-workers runs each");
  }
  const bool workload_given = !vm["workload"].defaulted();
  if (vm.count("trace")) {
    if (workload_given) return InvalidArgument("--workload is a synthetic workload; it cannot go with --trace");
    c.trace_path = vm["trace"].as<std::string>();
  } else if (!vm["synthetic"].as<bool>() && !workload_given) {
    return InvalidArgument("give --trace PATH, --synthetic or --workload NAME");
  }
  auto shape = WorkloadFromName(vm["workload"].as<std::string>());
  if (!shape) return FlagOutOfRange("workload", "one of chat, system-prompts, agentic, bursts, fanout");
  // The shape's defaults; the flags given explicitly win.
  c.synthetic = WorkloadDefaults(*shape);
  if (!vm["sessions"].defaulted()) c.synthetic.sessions = vm["sessions"].as<std::uint32_t>();
  if (!vm["turns"].defaulted()) c.synthetic.turns = vm["turns"].as<std::uint32_t>();
  if (!vm["rate"].defaulted()) c.synthetic.requests_per_second = vm["rate"].as<double>();
  c.synthetic.seed = vm["seed"].as<std::uint64_t>();
  if (!(c.synthetic.requests_per_second > 0)) return FlagOutOfRange("rate", "> 0");
  c.max_requests = vm["max-requests"].as<std::uint64_t>();
  c.speedup = vm["speedup"].as<double>();
  if (!(c.speedup > 0)) return FlagOutOfRange("speedup", "> 0");

  OnlineOptions& on = c.online;
  on.label = vm["label"].as<std::string>();
  on.nats_url = vm["nats-server"].as<std::string>();
  on.nats_security = ReadNatsSecurity(vm);
  on.ns = vm["namespace"].as<std::string>();
  on.concurrency = vm["concurrency"].as<std::uint32_t>();
  if (on.concurrency < 1) return FlagOutOfRange("concurrency", ">= 1");
  on.timeout_s = vm["timeout"].as<double>();
  if (!(on.timeout_s > 0)) return FlagOutOfRange("timeout", "> 0");
  on.wait_workers = vm["wait-workers"].as<std::uint32_t>();
  on.request_timeout_s = vm["request-timeout"].as<double>();
  if (!(on.request_timeout_s >= 0)) return FlagOutOfRange("request-timeout", ">= 0");
  on.retries = vm["retries"].as<std::uint32_t>();
  if (vm.count("gateway")) on.gateway_url = vm["gateway"].as<std::string>();
  on.model = vm["model"].as<std::string>();
  on.abort_fraction = vm["abort-fraction"].as<double>();
  if (!(on.abort_fraction >= 0 && on.abort_fraction < 1)) return FlagOutOfRange("abort-fraction", "in [0, 1)");
  if (on.gateway_url.empty() && on.abort_fraction > 0) {
    return InvalidArgument("--abort-fraction needs --gateway: only HTTP clients can go away mid-request");
  }
  if (!on.gateway_url.empty() && c.offline) return InvalidArgument("--gateway and --offline exclude each other");
  if (!on.gateway_url.empty() && (on.request_timeout_s > 0 || on.retries > 0)) {
    return InvalidArgument("--request-timeout and --retries are NATS mode's: through --gateway the gateway retries");
  }
  on.seed = vm["seed"].as<std::uint64_t>();
  const std::uint32_t prefill_workers = vm["prefill-workers"].as<std::uint32_t>();
  on.prefill_workers = prefill_workers;
  if (!c.offline && prefill_workers > 0) {
    if (on.wait_workers == 0) {
      return InvalidArgument(
          "--prefill-workers online is checked against the router's fleet: give --wait-workers, the ranks "
          "of the whole fleet");
    }
    if (Status s = CheckPrefillWorkers(prefill_workers, static_cast<std::uint32_t>(on.wait_workers), "--wait-workers");
        !s.ok()) {
      return s;
    }
  }
  SloTargets slo{.ttft_ms = vm["slo-ttft-ms"].as<double>(), .tpot_ms = vm["slo-tpot-ms"].as<double>()};
  if (!(slo.ttft_ms > 0) || !std::isfinite(slo.ttft_ms)) return FlagOutOfRange("slo-ttft-ms", "a finite number > 0");
  if (!(slo.tpot_ms > 0) || !std::isfinite(slo.tpot_ms)) return FlagOutOfRange("slo-tpot-ms", "a finite number > 0");
  on.slo = slo;

  OfflineOptions& off = c.offline_base;
  off.workers = vm["workers"].as<std::uint32_t>();
  if (off.workers < 1) return FlagOutOfRange("workers", ">= 1");
  off.engine.num_gpu_blocks = vm["num-gpu-blocks"].as<std::uint32_t>();
  off.engine.block_size = vm["block-size"].as<std::uint32_t>();
  off.engine.max_num_seqs = vm["max-num-seqs"].as<std::uint32_t>();
  off.engine.max_num_batched_tokens = vm["max-num-batched-tokens"].as<std::uint32_t>();
  off.engine.chunked_prefill = vm["chunked-prefill"].as<bool>();
  off.engine.speedup_ratio = vm["speedup-ratio"].as<double>();
  if (off.engine.num_gpu_blocks < 1) return FlagOutOfRange("num-gpu-blocks", ">= 1");
  if (off.engine.block_size < 1) return FlagOutOfRange("block-size", ">= 1");
  if (!(off.engine.speedup_ratio > 0) || !std::isfinite(off.engine.speedup_ratio)) {
    return FlagOutOfRange("speedup-ratio", "a finite number > 0");
  }
  off.engine.kv_bytes_per_token = vm["kv-bytes-per-token"].as<std::uint64_t>();
  if (off.engine.kv_bytes_per_token < 1) return FlagOutOfRange("kv-bytes-per-token", ">= 1");
  off.engine.kv_transfer_gbps = vm["kv-transfer-gbps"].as<double>();
  if (!(off.engine.kv_transfer_gbps > 0) || !std::isfinite(off.engine.kv_transfer_gbps)) {
    return FlagOutOfRange("kv-transfer-gbps", "a finite number > 0");
  }
  off.engine.kv_lease_ms = vm["kv-lease-ms"].as<std::uint32_t>();
  if (vm.count("worker-speedups")) {
    off.worker_speedups = vm["worker-speedups"].as<NumberList>().values;
    if (Status s = CheckWorkerSpeedups(off); !s.ok()) return s;
  }
  if (c.offline) {
    if (Status s = CheckPrefillWorkers(prefill_workers, off.workers); !s.ok()) return s;
  }
  off.prefill_workers = prefill_workers;
  off.slo = slo;
  off.seed = vm["seed"].as<std::uint64_t>();
  off.progress = true;
  c.runs = Runs(vm);
  if (vm.count("json")) c.json_path = vm["json"].as<std::string>();
  if (vm.count("plot")) c.plot_path = vm["plot"].as<std::string>();
  c.workload_name = c.trace_path ? std::filesystem::path(*c.trace_path).filename().string()
                                 : std::string("synthetic ") + WorkloadName(c.synthetic.shape);
  return Status::Ok();
}

}  // namespace

Result<ParsedBenchArgs> ParseBenchConfig(int argc, const char* const* argv, const EnvLookup& env) {
  return ParseProgram<BenchConfig>(Describe(), argc, argv, env, {}, ReadBenchConfig);
}

Result<std::vector<TraceRequest>> LoadWorkload(const BenchConfig& c) {
  std::vector<TraceRequest> trace;
  if (c.trace_path) {
    auto t = ReadMooncakeTrace(*c.trace_path);
    if (!t.ok()) return t.status();
    trace = std::move(t).value();
  } else {
    trace = SyntheticConversations(c.synthetic);
  }
  if (c.max_requests > 0 && trace.size() > c.max_requests) trace.resize(c.max_requests);
  if (c.speedup != 1) {
    for (auto& r : trace) r.timestamp_ms /= c.speedup;
  }
  return trace;
}

}  // namespace kvrouter::bench
