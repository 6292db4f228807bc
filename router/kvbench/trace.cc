#include "router/kvbench/trace.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <fstream>
#include <random>

#include "router/flat_table.h"

namespace kvrouter::bench {
namespace {

// A tiny reader for the trace's flat objects: string keys, numbers, and arrays of numbers.
class JsonLine {
 public:
  explicit JsonLine(std::string_view s) : s_(s) {}

  Status Parse(TraceRequest& out) {
    Skip();
    if (!Eat('{')) return Bad("expected '{'");
    bool first = true;
    while (true) {
      Skip();
      if (Eat('}')) break;
      if (!first && !Eat(',')) return Bad("expected ',' or '}'");
      Skip();
      std::string_view key;
      if (!String(key)) return Bad("expected a key");
      Skip();
      if (!Eat(':')) return Bad("expected ':'");
      Skip();
      first = false;
      if (key == "hash_ids") {
        if (!Eat('[')) return Bad("hash_ids must be an array");
        out.hash_ids.clear();
        Skip();
        if (!Eat(']')) {
          while (true) {
            double v;
            Skip();
            if (!Number(v) || v < 0) return Bad("hash_ids must hold non-negative integers");
            out.hash_ids.push_back(static_cast<std::uint64_t>(v));
            Skip();
            if (Eat(']')) break;
            if (!Eat(',')) return Bad("expected ',' or ']' in hash_ids");
          }
        }
      } else if (key == "timestamp" || key == "input_length" || key == "output_length") {
        double v;
        if (!Number(v) || v < 0) return Bad(fmt::format("{} must be a non-negative number", key));
        if (key == "timestamp") out.timestamp_ms = v;
        else if (key == "input_length") out.input_length = static_cast<std::uint32_t>(v);
        else out.output_length = static_cast<std::uint32_t>(v);
      } else if (!SkipValue()) {
        return Bad(fmt::format("cannot read the value of '{}'", key));
      }
    }
    return Status::Ok();
  }

 private:
  Status Bad(std::string what) const { return InvalidArgument(fmt::format("{} at column {}", what, pos_ + 1)); }
  void Skip() {
    while (pos_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[pos_]))) ++pos_;
  }
  bool Eat(char c) {
    if (pos_ < s_.size() && s_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  bool String(std::string_view& out) {
    if (!Eat('"')) return false;
    const std::size_t start = pos_;
    while (pos_ < s_.size() && s_[pos_] != '"') pos_ += s_[pos_] == '\\' ? 2 : 1;
    if (pos_ >= s_.size()) return false;
    out = s_.substr(start, pos_ - start);
    ++pos_;
    return true;
  }
  bool Number(double& v) {
    const char* b = s_.data() + pos_;
    auto [p, ec] = std::from_chars(b, s_.data() + s_.size(), v);
    if (ec != std::errc()) return false;
    pos_ += static_cast<std::size_t>(p - b);
    return true;
  }
  bool SkipValue() {  // strings, numbers, literals, flat arrays
    std::string_view sv;
    double d;
    if (s_.substr(pos_, 1) == "\"") return String(sv);
    if (Eat('[')) {
      int depth = 1;
      while (pos_ < s_.size() && depth > 0) {
        if (s_[pos_] == '[') ++depth;
        if (s_[pos_] == ']') --depth;
        ++pos_;
      }
      return depth == 0;
    }
    for (std::string_view lit : {"true", "false", "null"}) {
      if (s_.substr(pos_, lit.size()) == lit) {
        pos_ += lit.size();
        return true;
      }
    }
    return Number(d);
  }

  std::string_view s_;
  std::size_t pos_ = 0;
};

}  // namespace

Result<TraceRequest> ParseMooncakeLine(std::string_view line) {
  TraceRequest r;
  JsonLine parser(line);
  if (Status s = parser.Parse(r); !s.ok()) return s;
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
