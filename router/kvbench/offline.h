// kvbench's offline mode: the real router service (selection, index, load tracking, queue,
// approximate mode) on an in-memory bus, and simulated engines (MockEngine), all on one
// virtual clock in one thread, so a whole trace replays in seconds. Engines publish their KV
// events through the bus exactly as kvmocker does over NATS; the index is flushed before every
// routing decision, so runs are deterministic for a seed.
//
//   auto s = RunOffline(trace, {.router_flags = {"--router-mode", "kv"}, .workers = 8});
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "router/engine/mock_engine.h"
#include "router/kvbench/report.h"
#include "router/kvbench/trace.h"

namespace kvrouter::bench {

struct OfflineOptions {
  std::string label;                      // the run's name in reports
  std::vector<std::string> router_flags;  // kvrouter flags, e.g. {"--router-mode", "kv"}
  std::uint32_t workers = 8;
  MockEngineConfig engine;  // every worker's (workers are 1..workers, dp rank 0), but for its speed:
  // Each worker's speed relative to engine.speedup_ratio: worker i's engine runs at
  // engine.speedup_ratio * worker_speedups[i]. Empty: every worker at engine.speedup_ratio; else
  // one finite value > 0 per worker (RunOffline refuses another count).
  std::vector<double> worker_speedups;
  // A disaggregated fleet: workers 1..prefill_workers register with role prefill, the rest with
  // role decode (docs/protocol.md section 13). 0: every worker has role both (aggregated).
  // Below `workers`.
  std::uint32_t prefill_workers = 0;
  SloTargets slo;  // what SLO goodput counts
  std::uint64_t seed = 1;
  bool progress = false;  // progress lines on stderr
};

// InvalidArgument naming --worker-speedups unless worker_speedups is empty or has one finite
// value > 0 per worker (and each times engine.speedup_ratio is finite).
Status CheckWorkerSpeedups(const OfflineOptions& options);
// InvalidArgument naming --prefill-workers and `workers_flag` (the flag that gave `workers`) unless
// prefill_workers < workers (a P/D fleet needs a decode worker).
Status CheckPrefillWorkers(std::uint32_t prefill_workers, std::uint32_t workers,
                           std::string_view workers_flag = "--workers");

// Replays `trace` (timestamps relative to its first request). Fails on bad router flags, worker
// speedups or prefill workers. The summary has every gap between tokens (each running request
// makes one token per engine step, so a later token's gap is its step's duration), the busy
// times per worker and pool, and the router's decision counts.
Result<Summary> RunOffline(const std::vector<TraceRequest>& trace, const OfflineOptions& options);

// Hit rate of one LRU prefix cache of `total_blocks` blocks serving every request in order:
// the bound a router over the same total cache can approach.
double PooledLruHitRate(const std::vector<TraceRequest>& trace, std::uint64_t total_blocks, std::uint32_t block_size);

}  // namespace kvrouter::bench
