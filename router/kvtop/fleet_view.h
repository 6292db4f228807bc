// What kvtop shows: samples of the router's `stats` (docs/protocol.md section 5, every page, so a
// fleet of any size), two samples made into a view (fleet totals and rates, a row per worker
// rank, sorted), and the view as lines of text. The text is the same on the screen and with
// --once; nothing here touches a terminal. Plain values and functions; thread-compatible.
//
//   auto a = ReadFleet(nc, "dynamo", now);  ...  auto b = ReadFleet(nc, "dynamo", later);
//   for (auto& line : RenderLines(MakeView(&*a, *b, SortKey::kLoad), 120, 0, 50)) puts(line);
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "events/base/clock.h"
#include "events/base/status.h"
#include "events/router_endpoints_codec.h"
#include "transport/nats_client.h"

namespace kvrouter::top {

enum class SortKey { kLoad, kCache, kRate };
std::string_view SortKeyName(SortKey k);
std::optional<SortKey> SortKeyFromName(std::string_view name);

// One reading of the router's stats: every rank, and the counters kvtop totals.
struct FleetSample {
  SteadyTime at{};
  std::vector<WorkerStats> ranks;  // ascending (worker_id, dp_rank)
  std::map<std::string, std::uint64_t> counters;
  std::uint64_t decisions = 0;       // the `routed` breakdown summed over modes
  std::uint64_t events_dropped = 0;  // the `events_dropped` breakdown summed over reasons
  std::map<std::string, std::uint64_t> disagg_decisions;
};

// Pages through `namespace.{ns}.router.stats` (kMaxLimit ranks a page); the time is `at`.
Result<FleetSample> ReadFleet(NatsClient& nc, const std::string& ns, SteadyTime at);

struct RankRow {
  WorkerStats stats;
  double decisions_per_s = 0;  // requests routed to it per second between the samples
};

struct FleetView {
  std::size_t ranks = 0, prefill_ranks = 0, decode_ranks = 0, silent_workers = 0;
  double decisions_per_s = 0;
  std::optional<double> hit_rate;  // cached / prompt blocks of the decisions between the samples
  double events_per_s = 0;
  std::uint64_t queue_length = 0, active_requests = 0, events_dropped = 0;
  std::map<std::string, std::uint64_t> disagg_decisions;  // since the router started
  bool rates = false;  // two samples: the per-second figures mean something
  SortKey sort = SortKey::kLoad;
  std::vector<RankRow> rows;  // sorted by `sort`, then (worker_id, dp_rank)
};

// `prev` (nullptr: one sample only, no rates) and `cur` into a view sorted by `sort`.
FleetView MakeView(const FleetSample* prev, const FleetSample& cur, SortKey sort);

// The view as lines of at most `width` characters: the fleet totals, a column header, then rows
// [first_row, first_row + max_rows) of the sorted ranks, each with a bar of its cache against the
// fullest rank's. The last line says which rows are shown when not all are.
std::vector<std::string> RenderLines(const FleetView& view, std::size_t width, std::size_t first_row,
                                     std::size_t max_rows);
// Lines before the first row (totals and the column header).
inline constexpr std::size_t kHeaderLines = 4;

}  // namespace kvrouter::top
