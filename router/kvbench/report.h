// What kvbench measured: per-request records in, the summary of docs/design.md "Load generator" out
// (table on stdout, JSON on request). Plain values; thread-compatible.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "events/base/status.h"

namespace kvrouter::bench {

struct RequestRecord {
  double arrival_ms = 0;
  double first_token_ms = -1;  // -1: never (error)
  double finished_ms = -1;
  std::uint32_t prompt_tokens = 0;
  std::uint32_t cached_tokens = 0;
  std::uint64_t worker_id = 0;
  bool error = false;
};

struct Summary {
  std::string mode;
  std::size_t requests = 0;
  std::size_t errors = 0;
  double kv_hit_rate = 0;  // cached prompt tokens / prompt tokens
  double ttft_p50 = 0, ttft_p90 = 0, ttft_p99 = 0;
  double e2e_p50 = 0, e2e_p90 = 0, e2e_p99 = 0;
  double throughput_rps = 0;
  std::size_t retries = 0;                     // online: requests sent again
  std::vector<std::uint64_t> worker_requests;  // per worker, in worker order
  // Per worker, in worker order: its busy time in ms, the summed durations of the engine steps
  // it ran (prefill and decode). Offline only; empty online, where kvbench sees no engine steps.
  std::vector<double> worker_busy_ms;
  std::optional<double> pooled_lru_hit_rate;  // offline only
};

Summary Summarize(std::string mode, const std::vector<RequestRecord>& records,
                  const std::vector<std::uint64_t>& worker_ids);
std::string SummaryJson(const Summary& s);
// One table for several runs side by side (with each hit rate's share of the pooled-LRU bound
// when the runs know it). Balance has two columns: max/share (BusiestShare) and busy_max/mean
// (BusyTimeMaxOverMean, "-" when unknown).
std::string SummaryTable(const std::vector<Summary>& runs);
// The busiest worker's requests over a fair share (total / workers); 0 without requests.
double BusiestShare(const Summary& s);
// The busiest worker's busy time over the mean busy time (1 = even, up to the number of
// workers); nullopt when the busy times are unknown (online), 0 when no worker was busy.
std::optional<double> BusyTimeMaxOverMean(const Summary& s);

// Draws kv hit rate (with the pooled-LRU bound) and TTFT p50 / p99 by run with gnuplot
// (gnuplot-nox from Debian) into path: SVG when it ends in .svg, else PNG. A missing gnuplot or
// a failed plot is an error naming it.
Status PlotSummaries(const std::vector<Summary>& runs, const std::string& title, const std::string& path);

}  // namespace kvrouter::bench
