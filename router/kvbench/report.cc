#include "router/kvbench/report.h"

#include <nlohmann/json.hpp>

#include <fmt/format.h>

#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>

namespace kvrouter::bench {
namespace {

double Pct(std::vector<double>& v, double q) {
  if (v.empty()) return 0;
  return v[std::min(v.size() - 1, static_cast<std::size_t>(q * static_cast<double>(v.size())))];
}

}  // namespace

void TokenGaps::Add(double gap_ms, std::uint64_t tokens) {
  if (tokens == 0) return;
  // A gap is never negative; clocks that disagree by less than a microsecond give 0.
  const auto us = static_cast<std::int64_t>(std::llround(std::max(0.0, gap_ms) * 1000));
  per_us_[us] += tokens;
  total_ += tokens;
}

double TokenGaps::Quantile(double q) const {
  if (total_ == 0) return 0;
  const double wanted = std::floor(std::clamp(q, 0.0, 1.0) * static_cast<double>(total_));
  const std::uint64_t rank = std::min(total_ - 1, static_cast<std::uint64_t>(wanted));
  std::uint64_t below = 0;  // gaps before the current entry
  for (const auto& [us, n] : per_us_) {
    below += n;
    if (below > rank) return static_cast<double>(us) / 1000;
  }
  return static_cast<double>(per_us_.rbegin()->first) / 1000;
}

Summary Summarize(std::string mode, const std::vector<RequestRecord>& records,
                  const std::vector<std::uint64_t>& worker_ids, const SloTargets& slo) {
  Summary s;
  s.mode = std::move(mode);
  s.requests = records.size();
  s.slo = slo;
  std::vector<double> ttft, e2e, tpot;
  double prompt = 0, cached = 0, first = 1e300, last = 0;
  std::size_t good = 0;
  std::map<std::uint64_t, std::uint64_t> per_worker;
  for (const auto& r : records) {
    if (r.aborted) {
      ++s.aborted;
      continue;
    }
    if (r.error || r.first_token_ms < 0) {
      ++s.errors;
      continue;
    }
    prompt += r.prompt_tokens;
    cached += r.cached_tokens;
    const double request_ttft = r.first_token_ms - r.arrival_ms;
    ttft.push_back(request_ttft);
    if (r.finished_ms >= 0) {
      e2e.push_back(r.finished_ms - r.arrival_ms);
      last = std::max(last, r.finished_ms);
      bool tpot_met = true;  // a one-token request has no TPOT to miss
      if (r.output_tokens >= 2) {
        tpot.push_back((r.finished_ms - r.first_token_ms) / (r.output_tokens - 1));
        tpot_met = tpot.back() <= slo.tpot_ms;
      }
      good += request_ttft <= slo.ttft_ms && tpot_met;
    }
    first = std::min(first, r.arrival_ms);
    ++per_worker[r.worker_id];
  }
  std::sort(ttft.begin(), ttft.end());
  std::sort(e2e.begin(), e2e.end());
  std::sort(tpot.begin(), tpot.end());
  s.tpot_p50 = Pct(tpot, 0.5);
  s.tpot_p99 = Pct(tpot, 0.99);
  const std::size_t judged = records.size() - s.aborted;
  s.goodput = judged == 0 ? 0 : static_cast<double>(good) / static_cast<double>(judged);
  s.kv_hit_rate = prompt > 0 ? cached / prompt : 0;
  s.ttft_p50 = Pct(ttft, 0.5);
  s.ttft_p90 = Pct(ttft, 0.9);
  s.ttft_p99 = Pct(ttft, 0.99);
  s.e2e_p50 = Pct(e2e, 0.5);
  s.e2e_p90 = Pct(e2e, 0.9);
  s.e2e_p99 = Pct(e2e, 0.99);
  s.throughput_rps = last > first ? static_cast<double>(e2e.size()) / ((last - first) / 1000.0) : 0;
  for (std::uint64_t w : worker_ids) s.worker_requests.push_back(per_worker[w]);
  return s;
}

void SetTokenGaps(Summary& s, const TokenGaps& gaps) {
  if (gaps.count() == 0) return;
  s.itl_p50 = gaps.Quantile(0.5);
  s.itl_p99 = gaps.Quantile(0.99);
  s.itl_gaps = gaps.count();
}

void SetBusyTimes(Summary& s, std::vector<double> busy_ms, const std::vector<std::string>& pools) {
  s.pool_busy_ms.clear();
  double prefill_most = 0;
  std::size_t prefill_workers = 0;
  for (std::size_t w = 0; w < busy_ms.size() && w < pools.size(); ++w) {
    s.pool_busy_ms[pools[w]] += busy_ms[w];
    if (pools[w] != "prefill") continue;
    ++prefill_workers;
    prefill_most = std::max(prefill_most, busy_ms[w]);
  }
  s.prefill_busy_max_over_mean.reset();
  if (prefill_workers > 0) {
    const double total = s.pool_busy_ms["prefill"];
    s.prefill_busy_max_over_mean = total > 0 ? prefill_most / (total / static_cast<double>(prefill_workers)) : 0.0;
  }
  s.worker_busy_ms = std::move(busy_ms);
}

std::string SummaryJson(const Summary& s) {
  nlohmann::ordered_json j;
  j["mode"] = s.mode;  // the library escapes strings
  j["requests"] = s.requests;
  j["errors"] = s.errors;
  j["aborted"] = s.aborted;
  j["retries"] = s.retries;
  j["kv_hit_rate"] = s.kv_hit_rate;
  j["ttft_ms"] = {{"p50", s.ttft_p50}, {"p90", s.ttft_p90}, {"p99", s.ttft_p99}};
  j["e2e_ms"] = {{"p50", s.e2e_p50}, {"p90", s.e2e_p90}, {"p99", s.e2e_p99}};
  if (s.itl_p50 && s.itl_p99) j["itl_ms"] = {{"p50", *s.itl_p50}, {"p99", *s.itl_p99}, {"gaps", s.itl_gaps}};
  j["tpot_ms"] = {{"p50", s.tpot_p50}, {"p99", s.tpot_p99}};
  j["slo"] = {{"ttft_ms", s.slo.ttft_ms}, {"tpot_ms", s.slo.tpot_ms}};
  j["goodput"] = s.goodput;
  j["throughput_rps"] = s.throughput_rps;
  j["worker_requests"] = s.worker_requests;
  if (const auto busy = BusyTimeMaxOverMean(s)) {
    j["worker_busy_ms"] = s.worker_busy_ms;
    j["busy_time_max_over_mean"] = *busy;
  }
  if (!s.pool_busy_ms.empty()) j["pool_busy_ms"] = s.pool_busy_ms;
  if (s.prefill_busy_max_over_mean) j["prefill_busy_max_over_mean"] = *s.prefill_busy_max_over_mean;
  if (!s.disagg_decisions.empty()) j["disagg_decisions"] = s.disagg_decisions;
  if (s.bookings_left) {
    j["bookings_left"] = {{"requests", s.bookings_left->requests},
                          {"prefill_tokens", s.bookings_left->prefill_tokens},
                          {"blocks", s.bookings_left->blocks}};
  }
  if (s.pooled_lru_hit_rate) j["pooled_lru_hit_rate"] = *s.pooled_lru_hit_rate;
  return j.dump();
}

double BusiestShare(const Summary& s) {
  std::uint64_t total = 0, most = 0;
  for (auto n : s.worker_requests) {
    total += n;
    most = std::max(most, n);
  }
  if (total == 0 || s.worker_requests.empty()) return 0;
  return static_cast<double>(most) / (static_cast<double>(total) / static_cast<double>(s.worker_requests.size()));
}

std::optional<double> BusyTimeMaxOverMean(const Summary& s) {
  if (s.worker_busy_ms.empty()) return std::nullopt;
  double total = 0, most = 0;
  for (double b : s.worker_busy_ms) {
    total += b;
    most = std::max(most, b);
  }
  if (!(total > 0)) return 0.0;
  return most / (total / static_cast<double>(s.worker_busy_ms.size()));
}

std::string SummaryTable(const std::vector<Summary>& runs) {
  std::string out = fmt::format("{:<22} {:>8} {:>6} {:>8} {:>8} {:>10} {:>10} {:>10} {:>10} {:>8} {:>10} {:>13}\n",
                                "mode", "requests", "errors", "kv_hit", "of_bound", "ttft_p50", "ttft_p99", "e2e_p50",
                                "e2e_p99", "req/s", "max/share", "busy_max/mean");
  for (const auto& s : runs) {
    const std::string of_bound = s.pooled_lru_hit_rate && *s.pooled_lru_hit_rate > 0
                                     ? fmt::format("{:.2f}x", s.kv_hit_rate / *s.pooled_lru_hit_rate)
                                     : "-";
    const auto busy = BusyTimeMaxOverMean(s);
    out += fmt::format(
        "{:<22} {:>8} {:>6} {:>7.1f}% {:>8} {:>8.0f}ms {:>8.0f}ms {:>8.0f}ms {:>8.0f}ms {:>8.2f} {:>9.2f}x {:>13}\n",
        s.mode, s.requests, s.errors, 100 * s.kv_hit_rate, of_bound, s.ttft_p50, s.ttft_p99, s.e2e_p50, s.e2e_p99,
        s.throughput_rps, BusiestShare(s), busy ? fmt::format("{:.2f}x", *busy) : "-");
  }
  if (!runs.empty() && runs.front().pooled_lru_hit_rate) {
    out += fmt::format("pooled LRU bound (one cache as large as the fleet): {:.1f}%\n",
                       100 * *runs.front().pooled_lru_hit_rate);
  }
  if (runs.empty()) return out;
  out += fmt::format("\n{:<22} {:>10} {:>10} {:>10} {:>10} {:>8} {:>16} {:>24} {:>22}\n", "mode", "itl_p50", "itl_p99",
                     "tpot_p50", "tpot_p99", "goodput", "prefill_max/mean", "pool_busy_s", "disagg/local/fallback");
  for (const auto& s : runs) {
    const auto ms = [](const std::optional<double>& v) { return v ? fmt::format("{:.1f}ms", *v) : "-"; };
    std::string pools;
    for (const char* pool : {"prefill", "decode", "both"}) {
      const auto it = s.pool_busy_ms.find(pool);
      if (it == s.pool_busy_ms.end()) continue;
      pools += fmt::format("{}{}={:.0f}", pools.empty() ? "" : ",", pool, it->second / 1000);
    }
    const auto count = [&](const char* path) {
      const auto it = s.disagg_decisions.find(path);
      return it == s.disagg_decisions.end() ? std::uint64_t{0} : it->second;
    };
    const std::string decisions =
        s.disagg_decisions.empty() ? "-"
                                   : fmt::format("{}/{}/{}", count("disaggregated"), count("local"), count("fallback"));
    out += fmt::format("{:<22} {:>10} {:>10} {:>8.1f}ms {:>8.1f}ms {:>7.1f}% {:>16} {:>24} {:>22}\n", s.mode,
                       ms(s.itl_p50), ms(s.itl_p99), s.tpot_p50, s.tpot_p99, 100 * s.goodput,
                       s.prefill_busy_max_over_mean ? fmt::format("{:.2f}x", *s.prefill_busy_max_over_mean) : "-",
                       pools.empty() ? "-" : pools, decisions);
  }
  out += fmt::format("goodput: requests with TTFT <= {} ms and TPOT <= {} ms (errors miss; aborted ones are left out)\n", runs.front().slo.ttft_ms,
                     runs.front().slo.tpot_ms);
  for (const auto& s : runs) {
    if (s.aborted > 0) out += fmt::format("{}: {} requests aborted by the client on purpose\n", s.mode, s.aborted);
    if (!s.bookings_left || *s.bookings_left == BookingsLeft{}) continue;
    out += fmt::format("{}: the router still books {} requests, {} prefill tokens, {} blocks after the run\n", s.mode,
                       s.bookings_left->requests, s.bookings_left->prefill_tokens, s.bookings_left->blocks);
  }
  return out;
}

namespace {

// A string as a gnuplot double-quoted literal.
std::string GnuplotQuoted(std::string_view v) {
  std::string out = "\"";
  for (char c : v) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

}  // namespace

Status PlotSummaries(const std::vector<Summary>& runs, const std::string& title, const std::string& path) {
  if (runs.empty()) return InvalidArgument("--plot: no runs to draw");
  char dir_template[] = "/tmp/kvbench-plot-XXXXXX";
  const char* dir = mkdtemp(dir_template);
  if (dir == nullptr) return Status(StatusCode::kInternal, "--plot: cannot make a temporary directory");
  const std::string data = std::string(dir) + "/runs.dat";
  const std::string script = std::string(dir) + "/plot.gp";
  {
    std::ofstream d(data);
    for (const Summary& s : runs) {
      d << GnuplotQuoted(s.mode) << ' ' << 100 * s.kv_hit_rate << ' ' << std::max(s.ttft_p50, 0.1) << ' '
        << std::max(s.ttft_p99, 0.1) << '\n';
    }
    const bool svg = path.size() >= 4 && path.compare(path.size() - 4, 4, ".svg") == 0;
    std::ofstream g(script);
    g << (svg ? "set terminal svg size 1100,460 dynamic font 'sans,11'\n" : "set terminal png size 1100,460\n");
    g << "set output " << GnuplotQuoted(path) << "\n";
    g << "set multiplot layout 1,2 title " << GnuplotQuoted(title) << "\n";
    g << "set style data histograms\nset style histogram clustered gap 1\nset style fill solid 0.8 border -1\n";
    g << "set xtics rotate by -25 nomirror\nset key top left\nset grid ytics\n";
    g << "set title 'KV hit rate (%)'\nset yrange [0:100]\n";
    g << "plot " << GnuplotQuoted(data) << " using 2:xtic(1) title 'kv hit rate'";
    if (runs.front().pooled_lru_hit_rate) {
      g << ", " << 100 * *runs.front().pooled_lru_hit_rate << " with lines dt 2 lw 2 title 'pooled-LRU bound'";
    }
    g << "\nset title 'TTFT (ms, log scale)'\nset yrange [*:*]\nset logscale y\n";
    g << "plot " << GnuplotQuoted(data) << " using 3:xtic(1) title 'p50', '' using 4 title 'p99'\n";
    g << "unset multiplot\n";
  }
  const int rc = std::system(fmt::format("gnuplot {} 2>{}/gnuplot.err", GnuplotQuoted(script), dir).c_str());
  std::string err;
  {
    std::ifstream e(std::string(dir) + "/gnuplot.err");
    std::getline(e, err, '\0');
  }
  std::filesystem::remove_all(dir);
  if (rc != 0) {
    if (WIFEXITED(rc) && WEXITSTATUS(rc) == 127) {
      return Status(StatusCode::kNotFound, "--plot needs gnuplot (apt-get install gnuplot-nox)");
    }
    return Status(StatusCode::kInternal, fmt::format("--plot: gnuplot failed: {}", err));
  }
  return Status::Ok();
}

}  // namespace kvrouter::bench
