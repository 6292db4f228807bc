// BenchConfig: every kvbench flag, parsed once with the same helper as kvrouter's and
// kvmocker's (router/common/flags.h): each flag also reads DYN_<FLAG> from the environment
// (DYN_CONCURRENCY=32), --nats-server reads NATS_SERVER; the command line wins; unsigned flags
// refuse negative values. Plain values; ParseBenchConfig is thread-safe (the environment is
// read through the caller's lookup).
//
//   auto cfg = ParseBenchConfig(argc, argv, getenv);  if (!cfg.ok()) { print; exit(2); }
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "events/base/status.h"
#include "router/common/flags.h"
#include "router/kvbench/offline.h"
#include "router/kvbench/online.h"
#include "router/kvbench/trace.h"

namespace kvrouter::bench {

// One offline run: its label, the kvrouter flags that make it and its fleet's prefill workers
// (OfflineOptions::prefill_workers).
struct BenchRun {
  std::string label;
  std::vector<std::string> router_flags;
  std::uint32_t prefill_workers = 0;
};

// --router-disagg-policy's values (docs/protocol.md section 13), the default first: the P/D runs
// of --compare --prefill-workers, in this order.
inline constexpr const char* kDisaggPolicies[] = {"predicted",    "always",       "never",
                                                  "isl_bounding", "prefill_load", "isl_or_load"};

struct BenchConfig {
  bool offline = false;                   // --offline
  std::optional<std::string> trace_path;  // --trace (else --synthetic)
  SyntheticOptions synthetic;             // --sessions, --turns, --rate, --seed
  std::size_t max_requests = 0;           // --max-requests (0 = all)
  double speedup = 1;                     // --speedup: trace time divided by it (> 0)
  OnlineOptions online;                   // --nats-server, --namespace, --concurrency, ...
  OfflineOptions offline_base;            // --workers and the engine flags, --seed
  // Offline: one, or with --compare kv's two costs, round-robin, random and approximate mode;
  // with --compare --prefill-workers N, each of kDisaggPolicies on the P/D fleet, then the
  // aggregated fleet of the same size.
  std::vector<BenchRun> runs;
  std::optional<std::string> json_path;   // --json
  std::optional<std::string> plot_path;   // --plot (.svg or .png)
  std::string workload_name;              // the trace's file name or the synthetic shape
};

using ParsedBenchArgs = ProgramArgs<BenchConfig>;
// Parses argv (argv[0] is the program) and the environment. Bad values give InvalidArgument
// naming the flag.
Result<ParsedBenchArgs> ParseBenchConfig(int argc, const char* const* argv, const EnvLookup& env);

// The requests a config asks for: the trace or the synthetic workload, cut to --max-requests,
// time divided by --speedup.
Result<std::vector<TraceRequest>> LoadWorkload(const BenchConfig& config);

}  // namespace kvrouter::bench
