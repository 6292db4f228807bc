#include "router/kvbench/report.h"

#include <nlohmann/json.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <map>

namespace kvrouter::bench {
namespace {

double Pct(std::vector<double>& v, double q) {
  if (v.empty()) return 0;
  return v[std::min(v.size() - 1, static_cast<std::size_t>(q * static_cast<double>(v.size())))];
}

}  // namespace

Summary Summarize(std::string mode, const std::vector<RequestRecord>& records,
                  const std::vector<std::uint64_t>& worker_ids) {
  Summary s;
  s.mode = std::move(mode);
  s.requests = records.size();
  std::vector<double> ttft, e2e;
  double prompt = 0, cached = 0, first = 1e300, last = 0;
  std::map<std::uint64_t, std::uint64_t> per_worker;
  for (const auto& r : records) {
    if (r.error || r.first_token_ms < 0) {
      ++s.errors;
      continue;
    }
    prompt += r.prompt_tokens;
    cached += r.cached_tokens;
    ttft.push_back(r.first_token_ms - r.arrival_ms);
    if (r.finished_ms >= 0) {
      e2e.push_back(r.finished_ms - r.arrival_ms);
      last = std::max(last, r.finished_ms);
    }
    first = std::min(first, r.arrival_ms);
    ++per_worker[r.worker_id];
  }
  std::sort(ttft.begin(), ttft.end());
  std::sort(e2e.begin(), e2e.end());
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

std::string SummaryJson(const Summary& s) {
  nlohmann::ordered_json j;
  j["mode"] = s.mode;  // the library escapes strings
  j["requests"] = s.requests;
  j["errors"] = s.errors;
  j["retries"] = s.retries;
  j["kv_hit_rate"] = s.kv_hit_rate;
  j["ttft_ms"] = {{"p50", s.ttft_p50}, {"p90", s.ttft_p90}, {"p99", s.ttft_p99}};
  j["e2e_ms"] = {{"p50", s.e2e_p50}, {"p90", s.e2e_p90}, {"p99", s.e2e_p99}};
  j["throughput_rps"] = s.throughput_rps;
  j["worker_requests"] = s.worker_requests;
  if (s.pooled_lru_hit_rate) j["pooled_lru_hit_rate"] = *s.pooled_lru_hit_rate;
  return j.dump();
}

std::string SummaryTable(const std::vector<Summary>& runs) {
  std::string out = fmt::format("{:<22} {:>8} {:>6} {:>8} {:>10} {:>10} {:>10} {:>10} {:>8} {:>10}\n", "mode",
                                "requests", "errors", "kv_hit", "ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99", "req/s",
                                "max/share");
  for (const auto& s : runs) {
    double max_share = 0;
    std::uint64_t total = 0, most = 0;
    for (auto n : s.worker_requests) {
      total += n;
      most = std::max(most, n);
    }
    if (total > 0 && !s.worker_requests.empty()) {
      max_share = static_cast<double>(most) / (static_cast<double>(total) / s.worker_requests.size());
    }
    out += fmt::format("{:<22} {:>8} {:>6} {:>7.1f}% {:>8.0f}ms {:>8.0f}ms {:>8.0f}ms {:>8.0f}ms {:>8.2f} {:>9.2f}x\n", s.mode,
                       s.requests, s.errors, 100 * s.kv_hit_rate, s.ttft_p50, s.ttft_p99, s.e2e_p50, s.e2e_p99,
                       s.throughput_rps, max_share);
  }
  if (!runs.empty() && runs.front().pooled_lru_hit_rate) {
    out += fmt::format("pooled LRU bound (one cache as large as the fleet): {:.1f}%\n",
                       100 * *runs.front().pooled_lru_hit_rate);
  }
  return out;
}

}  // namespace kvrouter::bench
