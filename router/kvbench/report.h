// What kvbench measured: per-request records in, the summary of docs/design.md "Load generator" out
// (table on stdout, JSON on request). Plain values; thread-compatible.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "events/base/status.h"

namespace kvrouter::bench {

struct RequestRecord {
  double arrival_ms = 0;
  double first_token_ms = -1;  // -1: never (error)
  double finished_ms = -1;
  std::uint32_t prompt_tokens = 0;
  std::uint32_t cached_tokens = 0;
  std::uint32_t output_tokens = 0;  // generated, the first included
  std::uint64_t worker_id = 0;
  bool error = false;
  bool aborted = false;  // the client went away on purpose (kvbench --abort-fraction): no latency, no error
};

// The router's `stats` breakdown of P/D decisions by path (docs/protocol.md section 13).
inline constexpr std::string_view kDisaggDecisions = "disagg_decisions";

// The service-level objective a request meets for SLO goodput: TTFT <= ttft_ms and TPOT <=
// tpot_ms (kvbench --slo-ttft-ms, --slo-tpot-ms).
struct SloTargets {
  double ttft_ms = 1000;
  double tpot_ms = 50;
};

// Every inter-token gap of a run (a token's arrival minus its request's previous token's), kept
// as a count per microsecond of gap: memory grows with the distinct gaps, not with the tokens,
// and many tokens of one gap (every request of one engine step) are one Add.
class TokenGaps {
 public:
  void Add(double gap_ms, std::uint64_t tokens = 1);
  std::uint64_t count() const { return total_; }
  // The q-quantile (q in [0, 1]) as the other percentiles are taken: the gap at 0-based rank
  // floor(q * count) of the sorted gaps (the largest when that is count), to the microsecond.
  // 0 without gaps.
  double Quantile(double q) const;

 private:
  std::map<std::int64_t, std::uint64_t> per_us_;  // gap in whole microseconds -> tokens
  std::uint64_t total_ = 0;
};

// The router's bookings summed over its ranks (docs/design.md "Glossary": booking, prefill part).
struct BookingsLeft {
  std::uint64_t requests = 0;
  std::uint64_t prefill_tokens = 0;
  std::uint64_t blocks = 0;
  bool operator==(const BookingsLeft&) const = default;
};

struct Summary {
  std::string mode;
  std::size_t requests = 0;
  std::size_t errors = 0;
  std::size_t aborted = 0;  // requests the client abandoned on purpose: in no latency, error or goodput figure
  double kv_hit_rate = 0;  // cached prompt tokens / prompt tokens
  double ttft_p50 = 0, ttft_p90 = 0, ttft_p99 = 0;
  double e2e_p50 = 0, e2e_p90 = 0, e2e_p99 = 0;
  // Inter-token latency over every gap of every request (not per-request means); nullopt when
  // the run did not see each token (online with workers that answer the later tokens together).
  std::optional<double> itl_p50, itl_p99;
  std::uint64_t itl_gaps = 0;
  // Time per output token of each finished request of >= 2 tokens: (finish - first token) /
  // (tokens - 1); 0 when there is none.
  double tpot_p50 = 0, tpot_p99 = 0;
  // SLO goodput: the share of the requests not aborted that met `slo` (TTFT and TPOT; a one-token
  // request meets the TPOT part; errors and unfinished requests miss).
  SloTargets slo;
  double goodput = 0;
  double throughput_rps = 0;
  std::size_t retries = 0;                     // online: requests sent again
  std::vector<std::uint64_t> worker_requests;  // per worker, in worker order
  // Per worker, in worker order: its busy time in ms, the summed durations of the engine steps
  // it ran (prefill and decode). Offline only; empty online, where kvbench sees no engine steps.
  std::vector<double> worker_busy_ms;
  // Offline only, from SetBusyTimes: per pool (the workers' role: "prefill", "decode", or "both"
  // in an aggregated fleet) its workers' busy times summed; and the herding measure of a prefill
  // pool, its busiest rank's busy time over the pool's mean (nullopt without a prefill pool).
  std::map<std::string, double> pool_busy_ms;
  std::optional<double> prefill_busy_max_over_mean;
  // The router's `stats` breakdown kDisaggDecisions (docs/protocol.md section 13: disaggregated,
  // local, fallback) counted over the run; empty when the router reports none.
  std::map<std::string, std::uint64_t> disagg_decisions;
  // The router's bookings after the run (online: once they are 0, 5 s at most), all 0 when
  // every request released what it booked (the table says so when not).
  std::optional<BookingsLeft> bookings_left;
  std::optional<double> pooled_lru_hit_rate;  // offline only
};

Summary Summarize(std::string mode, const std::vector<RequestRecord>& records,
                  const std::vector<std::uint64_t>& worker_ids, const SloTargets& slo = {});
// Sets itl_p50, itl_p99 and itl_gaps from a run's gaps (left unset when there are none).
void SetTokenGaps(Summary& s, const TokenGaps& gaps);
// Sets worker_busy_ms, pool_busy_ms and prefill_busy_max_over_mean from each worker's busy time
// and pool, both in worker order (same length).
void SetBusyTimes(Summary& s, std::vector<double> busy_ms, const std::vector<std::string>& pools);
std::string SummaryJson(const Summary& s);
// One table for several runs side by side (with each hit rate's share of the pooled-LRU bound
// when the runs know it). Balance has two columns: max/share (BusiestShare) and busy_max/mean
// (BusyTimeMaxOverMean, "-" when unknown). A second table below, a row per run: ITL and TPOT
// percentiles, SLO goodput, busy seconds per pool, the prefill pool's busy max/mean and the
// decision counts ("-" when unknown).
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
