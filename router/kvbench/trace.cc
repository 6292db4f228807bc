#include "router/kvbench/trace.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <limits>
#include <random>

#include "router/flat_table.h"

namespace kvrouter::bench {
namespace {

// A non-negative integer field (u64 exactly, never through double); absent keeps `out`.
Status ReadCount(const nlohmann::json& obj, const char* key, std::uint64_t max, std::uint64_t& out) {
  auto it = obj.find(key);
  if (it == obj.end()) return Status::Ok();
  if (!it->is_number_unsigned()) {  // JSON's non-negative integers; negatives and floats are not
    return InvalidArgument(fmt::format("{} must be a non-negative integer", key));
  }
  const std::uint64_t v = it->get<std::uint64_t>();
  if (v > max) return InvalidArgument(fmt::format("{} is larger than {}", key, max));
  out = v;
  return Status::Ok();
}

}  // namespace

Result<TraceRequest> ParseMooncakeLine(std::string_view line) {
  // The trace's objects are flat, but any JSON is accepted around the keys read.
  const nlohmann::json obj = nlohmann::json::parse(line, /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (obj.is_discarded()) return InvalidArgument("not valid JSON");
  if (!obj.is_object()) return InvalidArgument("a trace line must be a JSON object");
  TraceRequest r;
  if (auto ts = obj.find("timestamp"); ts != obj.end()) {
    if (!ts->is_number() || ts->get<double>() < 0) return InvalidArgument("timestamp must be a non-negative number");
    r.timestamp_ms = ts->get<double>();
  }
  std::uint64_t input = 0, output = 0;
  constexpr std::uint64_t kU32 = std::numeric_limits<std::uint32_t>::max();
  if (Status s = ReadCount(obj, "input_length", kU32, input); !s.ok()) return s;
  if (Status s = ReadCount(obj, "output_length", kU32, output); !s.ok()) return s;
  r.input_length = static_cast<std::uint32_t>(input);
  r.output_length = static_cast<std::uint32_t>(output);
  if (auto ids = obj.find("hash_ids"); ids != obj.end()) {
    if (!ids->is_array()) return InvalidArgument("hash_ids must be an array");
    r.hash_ids.reserve(ids->size());
    for (const auto& id : *ids) {
      if (!id.is_number_unsigned()) return InvalidArgument("hash_ids must hold non-negative integers");
      r.hash_ids.push_back(id.get<std::uint64_t>());
    }
  }
  return r;
}

Result<std::vector<TraceRequest>> ReadMooncakeTrace(const std::string& path) {
  std::ifstream in(path);
  if (!in) return NotFound(fmt::format("cannot open trace {}", path));
  std::vector<TraceRequest> out;
  std::string line;
  for (std::size_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    auto r = ParseMooncakeLine(line);
    if (!r.ok()) return InvalidArgument(fmt::format("{} line {}: {}", path, n, r.status().message()));
    out.push_back(std::move(r).value());
  }
  return out;
}

std::vector<std::uint32_t> TokensFor(const TraceRequest& r) {
  std::vector<std::uint32_t> tokens;
  tokens.reserve(r.input_length);
  for (std::size_t i = 0; tokens.size() < r.input_length; ++i) {
    // Past the listed ids the prompt continues with content unique to this request.
    const std::uint64_t id = i < r.hash_ids.size() ? r.hash_ids[i]
                                                   : Mix64(static_cast<std::uint64_t>(r.timestamp_ms * 1000) ^ i) | (1ull << 63);
    for (std::uint32_t k = 0; k < kTraceBlockTokens && tokens.size() < r.input_length; ++k) {
      tokens.push_back(static_cast<std::uint32_t>(Mix64(id * 0x9E3779B97F4A7C15ULL + k) % 100000));
    }
  }
  return tokens;
}

std::vector<TraceRequest> SyntheticConversations(const SyntheticOptions& o) {
  std::mt19937_64 rng(o.seed);
  std::exponential_distribution<double> gap(o.requests_per_second / 1000.0);
  std::uniform_int_distribution<std::uint32_t> out_len(64, 512);
  std::uniform_int_distribution<std::uint32_t> tail(0, kTraceBlockTokens - 1);
  // Each session's turns arrive in order; sessions interleave: build (session, turn) slots and
  // hand out Poisson arrival times to a shuffled order that keeps each session's turn order.
  std::vector<std::uint32_t> order;
  for (std::uint32_t s = 0; s < o.sessions; ++s) {
    for (std::uint32_t t = 0; t < o.turns; ++t) order.push_back(s);
  }
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<std::uint32_t> next_turn(o.sessions, 0);
  std::vector<TraceRequest> out;
  double t = 0;
  std::uint64_t next_id = 1'000'000;
  std::vector<std::vector<std::uint64_t>> history(o.sessions);
  for (std::uint32_t s : order) {
    t += gap(rng);
    auto& h = history[s];
    if (next_turn[s]++ == 0) {
      for (std::uint32_t b = 0; b < o.system_blocks; ++b) h.push_back(b);  // shared by everyone
    }
    for (std::uint32_t b = 0; b < o.blocks_per_turn; ++b) h.push_back(next_id++);
    TraceRequest r;
    r.timestamp_ms = t;
    r.hash_ids = h;
    r.input_length = static_cast<std::uint32_t>(h.size()) * kTraceBlockTokens - tail(rng);
    r.output_length = out_len(rng);
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace kvrouter::bench
