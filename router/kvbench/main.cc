// kvbench: replays a Mooncake-format trace (or a synthetic conversation workload) against the
// router and reports KV hit rate, TTFT / end-to-end percentiles, throughput and per-worker
// spread (DESIGN.md "Load generator"). Online (default): through a running router's
// `generate` endpoint to running workers over NATS (router/kvbench/online.h). --offline: the
// router's own logic and simulated engines on virtual time in one process (offline.h).
//
//   kvbench --synthetic --concurrency 64 --json out.json          (online, NATS_SERVER)
//   kvbench --offline --trace trace.jsonl --workers 8 --compare --json out.json
// Exit codes: 0 done, 1 NATS or router failure (online), 2 bad flags or trace.
#include <boost/program_options.hpp>
#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <fstream>

#include "router/kvbench/offline.h"
#include "router/kvbench/online.h"

namespace po = boost::program_options;
using namespace kvrouter;
using namespace kvrouter::bench;

int main(int argc, char** argv) {
  po::options_description desc("kvbench options");
  // clang-format off
  desc.add_options()
    ("help,h", "print this help")
    ("offline", po::bool_switch(), "simulate the router and engines on virtual time in this process")
    ("nats-server", po::value<std::string>(), "online: NATS URL (default NATS_SERVER or nats://127.0.0.1:4222)")
    ("namespace", po::value<std::string>()->default_value("dynamo"), "online: the router's namespace")
    ("concurrency", po::value<std::size_t>()->default_value(64), "online: requests in flight at most")
    ("timeout", po::value<double>()->default_value(600), "online: seconds to wait for the last responses")
    ("label", po::value<std::string>()->default_value("online"), "online: the run's name in the report")
    ("wait-workers", po::value<std::size_t>()->default_value(0), "online: first wait until the router knows this many worker ranks")
    ("trace", po::value<std::string>(), "Mooncake JSONL trace")
    ("synthetic", po::bool_switch(), "use the synthetic multi-turn conversation workload instead of a trace")
    ("sessions", po::value<std::uint32_t>()->default_value(200), "synthetic: conversations")
    ("turns", po::value<std::uint32_t>()->default_value(6), "synthetic: requests per conversation")
    ("rate", po::value<double>()->default_value(10), "synthetic: requests per second")
    ("max-requests", po::value<std::size_t>()->default_value(0), "replay at most this many requests (0 = all)")
    ("speedup", po::value<double>()->default_value(1), "divide trace inter-arrival times by this")
    ("workers", po::value<std::uint32_t>()->default_value(8), "simulated workers")
    ("num-gpu-blocks", po::value<std::uint32_t>()->default_value(16384), "KV blocks per worker")
    ("block-size", po::value<std::uint32_t>()->default_value(64), "tokens per KV block")
    ("max-num-seqs", po::value<std::uint32_t>()->default_value(256), "running sequences per worker")
    ("max-num-batched-tokens", po::value<std::uint32_t>()->default_value(8192), "tokens per engine step")
    ("speedup-ratio", po::value<double>()->default_value(1), "engine speed-up (divides every duration)")
    ("router-mode", po::value<std::string>()->default_value("kv"), "router mode of the run")
    ("no-router-kv-events", po::bool_switch(), "approximate mode")
    ("router-kv-overlap-score-credit", po::value<std::string>(), "passed to the router")
    ("router-prefill-load-scale", po::value<std::string>(), "passed to the router")
    ("router-temperature", po::value<std::string>(), "passed to the router")
    ("router-queue-threshold", po::value<std::string>(), "passed to the router")
    ("router-queue-policy", po::value<std::string>(), "passed to the router")
    ("compare", po::bool_switch(), "run kv, round-robin, random and approximate mode and print one table")
    ("json", po::value<std::string>(), "write the summary (an array with --compare) as JSON here")
    ("seed", po::value<std::uint64_t>()->default_value(1), "random seed (router tie-breaks, synthetic workload)");
  // clang-format on
  po::variables_map vm;
  try {
    po::store(po::parse_command_line(argc, argv, desc), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    fmt::print(stderr, "kvbench: {}\n", e.what());
    return 2;
  }
  if (vm.count("help")) {
    std::cout << desc;
    return 0;
  }
  const bool offline = vm["offline"].as<bool>();
  if (!offline && vm["compare"].as<bool>()) {
    fmt::print(stderr, "kvbench: --compare runs several router modes and needs --offline (online, the running "
                       "router's mode is what you measure)\n");
    return 2;
  }

  std::vector<TraceRequest> trace;
  if (vm.count("trace")) {
    auto t = ReadMooncakeTrace(vm["trace"].as<std::string>());
    if (!t.ok()) {
      fmt::print(stderr, "kvbench: {}\n", t.status().message());
      return 2;
    }
    trace = std::move(t).value();
  } else if (vm["synthetic"].as<bool>()) {
    trace = SyntheticConversations({.sessions = vm["sessions"].as<std::uint32_t>(),
                                    .turns = vm["turns"].as<std::uint32_t>(),
                                    .requests_per_second = vm["rate"].as<double>(),
                                    .seed = vm["seed"].as<std::uint64_t>()});
  } else {
    fmt::print(stderr, "kvbench: give --trace PATH or --synthetic\n");
    return 2;
  }
  if (const auto max = vm["max-requests"].as<std::size_t>(); max > 0 && trace.size() > max) trace.resize(max);
  if (const double speedup = vm["speedup"].as<double>(); speedup > 0 && speedup != 1) {
    for (auto& r : trace) r.timestamp_ms /= speedup;
  }

  if (!offline) {
    OnlineOptions o;
    o.label = vm["label"].as<std::string>();
    const char* env = std::getenv("NATS_SERVER");
    o.nats_url = vm.count("nats-server") ? vm["nats-server"].as<std::string>() : (env ? env : o.nats_url);
    o.ns = vm["namespace"].as<std::string>();
    o.concurrency = std::max<std::size_t>(1, vm["concurrency"].as<std::size_t>());
    o.timeout_s = vm["timeout"].as<double>();
    o.wait_workers = vm["wait-workers"].as<std::size_t>();
    auto s = RunOnline(trace, o);
    if (!s.ok()) {
      fmt::print(stderr, "kvbench: {}\n", s.status().message());
      return 1;
    }
    fmt::print("{}", SummaryTable({*s}));
    if (vm.count("json")) std::ofstream(vm["json"].as<std::string>()) << SummaryJson(*s) << "\n";
    return 0;
  }

  OfflineOptions base;
  base.workers = vm["workers"].as<std::uint32_t>();
  base.engine.num_gpu_blocks = vm["num-gpu-blocks"].as<std::uint32_t>();
  base.engine.block_size = vm["block-size"].as<std::uint32_t>();
  base.engine.max_num_seqs = vm["max-num-seqs"].as<std::uint32_t>();
  base.engine.max_num_batched_tokens = vm["max-num-batched-tokens"].as<std::uint32_t>();
  base.engine.speedup_ratio = vm["speedup-ratio"].as<double>();
  base.seed = vm["seed"].as<std::uint64_t>();
  base.progress = true;
  std::vector<std::string> tuning;
  for (const char* f : {"router-kv-overlap-score-credit", "router-prefill-load-scale", "router-temperature",
                        "router-queue-threshold", "router-queue-policy"}) {
    if (vm.count(f)) {
      tuning.push_back(std::string("--") + f);
      tuning.push_back(vm[f].as<std::string>());
    }
  }

  struct Run {
    std::string label;
    std::vector<std::string> flags;
  };
  std::vector<Run> runs;
  if (vm["compare"].as<bool>()) {
    runs = {{"kv", {"--router-mode", "kv"}},
            {"round-robin", {"--router-mode", "round-robin"}},
            {"random", {"--router-mode", "random"}},
            {"kv-approx", {"--router-mode", "kv", "--no-router-kv-events"}}};
  } else {
    Run r{vm["router-mode"].as<std::string>(), {"--router-mode", vm["router-mode"].as<std::string>()}};
    if (vm["no-router-kv-events"].as<bool>()) {
      r.flags.push_back("--no-router-kv-events");
      r.label += "-approx";
    }
    runs.push_back(std::move(r));
  }

  const double pooled = PooledLruHitRate(trace, std::uint64_t{base.workers} * base.engine.num_gpu_blocks,
                                         base.engine.block_size);
  std::vector<Summary> results;
  for (auto& run : runs) {
    OfflineOptions o = base;
    o.label = run.label;
    o.router_flags = run.flags;
    o.router_flags.insert(o.router_flags.end(), tuning.begin(), tuning.end());
    auto s = RunOffline(trace, o);
    if (!s.ok()) {
      fmt::print(stderr, "kvbench: {}\n", s.status().message());
      return 2;
    }
    s->pooled_lru_hit_rate = pooled;
    results.push_back(std::move(s).value());
  }
  fmt::print("{}", SummaryTable(results));
  if (vm.count("json")) {
    std::ofstream out(vm["json"].as<std::string>());
    if (results.size() == 1) {
      out << SummaryJson(results[0]) << "\n";
    } else {
      out << "[";
      for (std::size_t i = 0; i < results.size(); ++i) out << (i ? ",\n " : "") << SummaryJson(results[i]);
      out << "]\n";
    }
  }
  return 0;
}
