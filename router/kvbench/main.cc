// kvbench: replays a Mooncake-format trace (or a synthetic conversation workload) against the
// router and reports KV hit rate, TTFT / end-to-end percentiles, throughput and per-worker
// spread (docs/design.md "Load generator"). Online (default): through a running router's
// `generate` endpoint to running workers over NATS (router/kvbench/online.h), or with --gateway
// as HTTP clients of kvgateway (http_replay.h). --offline: the
// router's own logic and simulated engines on virtual time in one process (offline.h).
// Flags: router/kvbench/config.h (each also DYN_<FLAG>, NATS_SERVER).
//
//   kvbench --synthetic --concurrency 64 --json out.json          (online, NATS_SERVER)
//   kvbench --offline --trace trace.jsonl --workers 8 --compare --json out.json
// Exit codes: 0 done, 1 NATS or router failure (online) or a failed --plot, 2 bad flags or trace.
#include <fmt/format.h>

#include <cstdlib>
#include <fstream>

#include <nlohmann/json.hpp>

#include "router/kvbench/config.h"
#include "router/kvbench/http_replay.h"

namespace {

using namespace kvrouter;
using namespace kvrouter::bench;

// Prints the table, writes --json (one object, or an array for several runs) and draws --plot.
// Returns 1 when the plot fails.
int Report(const BenchConfig& c, const std::vector<Summary>& results) {
  fmt::print("{}", SummaryTable(results));
  if (c.json_path) {
    std::ofstream out(*c.json_path);
    if (results.size() == 1) {
      out << SummaryJson(results[0]) << "\n";
    } else {
      nlohmann::json all = nlohmann::json::array();
      for (const Summary& s : results) all.push_back(nlohmann::json::parse(SummaryJson(s)));
      out << all.dump(1) << "\n";
    }
  }
  if (c.plot_path) {
    const std::string title =
        c.offline ? fmt::format("{}: {} requests, {} workers x {} blocks", c.workload_name, results.front().requests,
                                c.offline_base.workers, c.offline_base.engine.num_gpu_blocks)
                  : fmt::format("{}: {} requests", c.workload_name, results.front().requests);
    if (Status s = PlotSummaries(results, title, *c.plot_path); !s.ok()) {
      fmt::print(stderr, "kvbench: {}\n", s.message());
      return 1;
    }
  }
  return 0;
}

int RunOfflineModes(const BenchConfig& c, const std::vector<TraceRequest>& trace) {
  const OfflineOptions& base = c.offline_base;
  const double pooled =
      PooledLruHitRate(trace, std::uint64_t{base.workers} * base.engine.num_gpu_blocks, base.engine.block_size);
  std::vector<Summary> results;
  for (const BenchRun& run : c.runs) {
    OfflineOptions o = base;
    o.label = run.label;
    o.router_flags = run.router_flags;
    o.prefill_workers = run.prefill_workers;
    auto s = RunOffline(trace, o);
    if (!s.ok()) {
      fmt::print(stderr, "kvbench: {}\n", s.status().message());
      return 2;
    }
    s->pooled_lru_hit_rate = pooled;
    results.push_back(std::move(s).value());
  }
  return Report(c, results);
}

}  // namespace

int main(int argc, char** argv) {
  auto parsed = ParseBenchConfig(argc, argv, [](const char* name) { return std::getenv(name); });
  if (!parsed.ok()) {
    fmt::print(stderr, "kvbench: {}\n(see kvbench --help)\n", parsed.status().message());
    return 2;
  }
  if (parsed->help) {
    fmt::print("{}", parsed->help_text);
    return 0;
  }
  const BenchConfig& c = parsed->config;
  auto trace = LoadWorkload(c);
  if (!trace.ok()) {
    fmt::print(stderr, "kvbench: {}\n", trace.status().message());
    return 2;
  }
  if (c.offline) return RunOfflineModes(c, *trace);
  auto s = c.online.gateway_url.empty() ? RunOnline(*trace, c.online) : RunThroughGateway(*trace, c.online);
  if (!s.ok()) {
    fmt::print(stderr, "kvbench: {}\n", s.status().message());
    return 1;
  }
  const int rc = Report(c, {*s});
  if (s->retries > 0) fmt::print("{} requests were sent again (--retries)\n", s->retries);
  return rc;
}
