#include "router/kvtop/fleet_view.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <tuple>

#include "events/msgpack_reader.h"
#include "events/subjects.h"

namespace kvrouter::top {
namespace {

constexpr std::size_t kBarWidth = 12;

std::uint64_t Sum(const std::map<std::string, std::uint64_t>& m) {
  std::uint64_t n = 0;
  for (const auto& [k, v] : m) n += v;
  return n;
}

std::uint64_t Counter(const FleetSample& s, const char* name) {
  const auto it = s.counters.find(name);
  return it == s.counters.end() ? 0 : it->second;
}

// `now - before` per second (0 when the counter went back: a restarted router).
double PerSecond(std::uint64_t now, std::uint64_t before, double seconds) {
  return now >= before && seconds > 0 ? static_cast<double>(now - before) / seconds : 0;
}

// 12,345 -> "12.3k": columns stay narrow on large fleets.
std::string Short(double v) {
  if (v >= 1e9) return fmt::format("{:.1f}G", v / 1e9);
  if (v >= 1e6) return fmt::format("{:.1f}M", v / 1e6);
  if (v >= 1e4) return fmt::format("{:.1f}k", v / 1e3);
  return fmt::format("{:.0f}", v);
}

std::string Bar(std::uint64_t value, std::uint64_t most) {
  const std::size_t filled =
      most == 0 ? 0 : static_cast<std::size_t>((static_cast<double>(value) / static_cast<double>(most)) * kBarWidth + 0.5);
  return "[" + std::string(std::min(filled, kBarWidth), '#') + std::string(kBarWidth - std::min(filled, kBarWidth), ' ') +
         "]";
}

std::string Fit(std::string line, std::size_t width) {
  if (line.size() > width) line.resize(width);
  return line;
}

}  // namespace

std::string_view SortKeyName(SortKey k) {
  switch (k) {
    case SortKey::kLoad: return "load";
    case SortKey::kCache: return "cache";
    case SortKey::kRate: return "rate";
  }
  return "load";
}

std::optional<SortKey> SortKeyFromName(std::string_view name) {
  for (SortKey k : {SortKey::kLoad, SortKey::kCache, SortKey::kRate}) {
    if (SortKeyName(k) == name) return k;
  }
  return std::nullopt;
}

Result<FleetSample> ReadFleet(NatsClient& nc, const std::string& ns, SteadyTime at) {
  FleetSample out;
  out.at = at;
  std::optional<std::uint64_t> next = 0;
  bool first = true;
  while (next) {
    auto reply = nc.Request(RouterEndpointSubject(ns, router_endpoint::kStats),
                            AsBytes(EncodeStatsRequest({.offset = *next, .limit = StatsRequest::kMaxLimit})),
                            std::chrono::seconds(5));
    if (!reply.ok()) return Status(reply.status().code(), "router.stats: " + reply.status().message());
    auto page = DecodeStatsReply(*reply);
    if (!page.ok()) return Status(page.status().code(), "router.stats: " + page.status().message());
    for (WorkerStats& w : page->workers) out.ranks.push_back(std::move(w));
    if (first) {  // the counters of the first page (every page carries the same)
      out.counters = page->counters;
      if (auto it = page->breakdowns.find("routed"); it != page->breakdowns.end()) out.decisions = Sum(it->second);
      if (auto it = page->breakdowns.find("events_dropped"); it != page->breakdowns.end()) {
        out.events_dropped = Sum(it->second);
      }
      if (auto it = page->breakdowns.find("disagg_decisions"); it != page->breakdowns.end()) {
        out.disagg_decisions = it->second;
      }
      first = false;
    }
    next = page->next_offset;
  }
  return out;
}

FleetView MakeView(const FleetSample* prev, const FleetSample& cur, SortKey sort) {
  FleetView v;
  v.sort = sort;
  v.ranks = cur.ranks.size();
  v.queue_length = Counter(cur, "queue_length");
  v.active_requests = Counter(cur, "active_requests");
  v.events_dropped = cur.events_dropped;
  v.silent_workers = Counter(cur, "workers_without_events");
  v.disagg_decisions = cur.disagg_decisions;
  const double dt = prev ? std::chrono::duration<double>(cur.at - prev->at).count() : 0;
  v.rates = prev != nullptr && dt > 0;
  std::map<std::pair<std::uint64_t, std::uint32_t>, std::uint64_t> routed_before;
  if (v.rates) {
    v.decisions_per_s = PerSecond(cur.decisions, prev->decisions, dt);
    v.events_per_s = PerSecond(Counter(cur, "events_applied"), Counter(*prev, "events_applied"), dt);
    const std::uint64_t blocks = Counter(cur, "routed_request_blocks") - std::min(Counter(cur, "routed_request_blocks"),
                                                                                  Counter(*prev, "routed_request_blocks"));
    const std::uint64_t cached = Counter(cur, "routed_cached_blocks") - std::min(Counter(cur, "routed_cached_blocks"),
                                                                                 Counter(*prev, "routed_cached_blocks"));
    if (blocks > 0) v.hit_rate = static_cast<double>(std::min(cached, blocks)) / static_cast<double>(blocks);
    for (const WorkerStats& w : prev->ranks) routed_before[{w.worker_id, w.dp_rank}] = w.routed_requests;
  }
  for (const WorkerStats& w : cur.ranks) {
    v.prefill_ranks += w.role == "prefill";
    v.decode_ranks += w.role == "decode";
    RankRow row{.stats = w};
    if (v.rates) {
      const auto b = routed_before.find({w.worker_id, w.dp_rank});
      row.decisions_per_s = PerSecond(w.routed_requests, b == routed_before.end() ? 0 : b->second, dt);
    }
    v.rows.push_back(std::move(row));
  }
  const auto key = [sort](const RankRow& r) {
    const WorkerStats& w = r.stats;
    switch (sort) {
      case SortKey::kCache: return std::make_tuple(static_cast<double>(w.blocks), static_cast<double>(w.active_requests));
      case SortKey::kRate: return std::make_tuple(r.decisions_per_s, static_cast<double>(w.active_requests));
      case SortKey::kLoad: break;
    }
    return std::make_tuple(static_cast<double>(w.active_requests),
                           static_cast<double>(w.active_blocks + w.active_prefill_tokens));
  };
  std::stable_sort(v.rows.begin(), v.rows.end(), [&](const RankRow& a, const RankRow& b) { return key(a) > key(b); });
  return v;
}

std::vector<std::string> RenderLines(const FleetView& v, std::size_t width, std::size_t first_row,
                                     std::size_t max_rows) {
  std::vector<std::string> out;
  const auto rate = [&](double x) { return v.rates ? Short(x) + "/s" : std::string("-"); };
  std::string pools = fmt::format("{} ranks", v.ranks);
  if (v.prefill_ranks + v.decode_ranks > 0) pools += fmt::format(" ({} prefill, {} decode)", v.prefill_ranks, v.decode_ranks);
  out.push_back(Fit(fmt::format("kvtop  {}  decisions {}  hit {}  queue {}  active {}", pools, rate(v.decisions_per_s),
                                v.hit_rate ? fmt::format("{:.1f}%", 100 * *v.hit_rate) : std::string("-"),
                                v.queue_length, v.active_requests),
                    width));
  std::string second = fmt::format("events {}  dropped {}  silent workers {}", rate(v.events_per_s), v.events_dropped,
                                   v.silent_workers);
  if (!v.disagg_decisions.empty()) {
    std::string paths;
    for (const auto& [path, n] : v.disagg_decisions) paths += fmt::format("{}{} {}", paths.empty() ? "" : ", ", path, n);
    second += "  P/D: " + paths;
  }
  out.push_back(Fit(second, width));
  out.push_back(Fit(fmt::format("sorted by {} (l load, c cache, r rate; arrows scroll; q quits)", SortKeyName(v.sort)),
                    width));
  out.push_back(Fit(fmt::format("{:>16} {:>4} {:<7} {:>7} {:<14} {:>6} {:>8} {:>8} {:>8} {:>9} {:>8}  {}", "WORKER", "DP",
                                "ROLE", "BLOCKS", "CACHE", "ACTIVE", "ACT_BLK", "PREFILL", "DEC/S", "PF_TOK/S",
                                "STEP_MS", "NOTE"),
                    width));
  std::uint64_t most = 0;
  for (const RankRow& r : v.rows) most = std::max(most, r.stats.blocks);
  const std::size_t end = std::min(v.rows.size(), first_row + max_rows);
  for (std::size_t i = first_row; i < end; ++i) {
    const WorkerStats& w = v.rows[i].stats;
    out.push_back(Fit(fmt::format("{:>16} {:>4} {:<7} {:>7} {} {:>6} {:>8} {:>8} {:>8} {:>9} {:>8.2f}  {}", w.worker_id,
                                  w.dp_rank, w.role, Short(static_cast<double>(w.blocks)), Bar(w.blocks, most),
                                  w.active_requests, Short(static_cast<double>(w.active_blocks)),
                                  Short(static_cast<double>(w.active_prefill_tokens)),
                                  v.rates ? fmt::format("{:.1f}", v.rows[i].decisions_per_s) : std::string("-"),
                                  Short(w.prefill_tokens_per_second), w.decode_step_seconds * 1000,
                                  w.without_events ? "NO KV EVENTS" : ""),
                      width));
    // Trailing spaces of an empty note are not content.
    while (!out.back().empty() && out.back().back() == ' ') out.back().pop_back();
  }
  if (first_row > 0 || end < v.rows.size()) {
    out.push_back(Fit(fmt::format("ranks {}-{} of {}", v.rows.empty() ? 0 : first_row + 1, end, v.rows.size()), width));
  }
  return out;
}

}  // namespace kvrouter::top
