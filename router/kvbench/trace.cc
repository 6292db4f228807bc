#include "router/kvbench/trace.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include <thread>

#include <algorithm>
#include <fstream>
#include <limits>
#include <random>

#include "router/index/flat_table.h"

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

namespace {

// Calls emit(mixed) for each of r's input_length prompt positions: block i of the prompt is
// hash_ids[i]'s content, a position's value a hash of its block's id and its place in it.
template <typename Emit>
void ForEachPromptPosition(const TraceRequest& r, Emit&& emit) {
  std::uint32_t n = 0;
  for (std::size_t i = 0; n < r.input_length; ++i) {
    // Past the listed ids the prompt continues with content unique to this request.
    const std::uint64_t id = i < r.hash_ids.size()
                                 ? r.hash_ids[i]
                                 : Mix64(static_cast<std::uint64_t>(r.timestamp_ms * 1000) ^ i) | (1ull << 63);
    for (std::uint32_t k = 0; k < kTraceBlockTokens && n < r.input_length; ++k, ++n) {
      emit(Mix64(id * 0x9E3779B97F4A7C15ULL + k));
    }
  }
}

}  // namespace

std::vector<std::uint32_t> TokensFor(const TraceRequest& r) {
  std::vector<std::uint32_t> tokens;
  tokens.reserve(r.input_length);
  ForEachPromptPosition(r, [&](std::uint64_t v) { tokens.push_back(static_cast<std::uint32_t>(v % 100000)); });
  return tokens;
}

std::string TextFor(const TraceRequest& r) {
  static constexpr std::string_view kAlphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  std::string text;
  text.reserve(r.input_length);
  ForEachPromptPosition(r, [&](std::uint64_t v) { text.push_back(kAlphabet[v % kAlphabet.size()]); });
  return text;
}

void SleepUntilDue(const std::vector<TraceRequest>& trace, std::size_t i, SteadyTime start) {
  const double ms = trace[i].timestamp_ms - trace.front().timestamp_ms;
  std::this_thread::sleep_until(start + std::chrono::microseconds(static_cast<std::int64_t>(ms * 1000)));
}

const char* WorkloadName(WorkloadShape s) {
  switch (s) {
    case WorkloadShape::kChat: return "chat";
    case WorkloadShape::kSystemPrompts: return "system-prompts";
    case WorkloadShape::kAgentic: return "agentic";
    case WorkloadShape::kBursts: return "bursts";
    case WorkloadShape::kFanout: return "fanout";
  }
  return "chat";
}

std::optional<WorkloadShape> WorkloadFromName(std::string_view name) {
  for (WorkloadShape s : {WorkloadShape::kChat, WorkloadShape::kSystemPrompts, WorkloadShape::kAgentic,
                          WorkloadShape::kBursts, WorkloadShape::kFanout}) {
    if (name == WorkloadName(s)) return s;
  }
  return std::nullopt;
}

SyntheticOptions WorkloadDefaults(WorkloadShape shape) {
  switch (shape) {
    case WorkloadShape::kChat: return {};
    case WorkloadShape::kSystemPrompts:
      return {.shape = shape,
              .sessions = 400,
              .turns = 3,
              .system_blocks = 8,
              .first_turn_blocks = 1,
              .blocks_per_turn = 1,
              .system_prompts = 16,
              .requests_per_second = 20};
    case WorkloadShape::kAgentic:
      return {.shape = shape,
              .sessions = 24,
              .turns = 30,
              .system_blocks = 2,
              .first_turn_blocks = 8,
              .blocks_per_turn = 4,
              .min_output = 100,
              .max_output = 300,
              .requests_per_second = 2};
    case WorkloadShape::kBursts: return {.shape = shape, .burst_size = 40};
    case WorkloadShape::kFanout:
      return {.shape = shape,
              .sessions = 40,
              .turns = 32,
              .system_blocks = 16,
              .first_turn_blocks = 1,
              .blocks_per_turn = 1,
              .requests_per_second = 8};
  }
  return {};
}

namespace {

// Ids of synthetic blocks: system prompts and documents from 1, everything else unique.
constexpr std::uint64_t kUniqueIds = 1'000'000;

TraceRequest Request(double t, const std::vector<std::uint64_t>& ids, std::mt19937_64& rng, const SyntheticOptions& o) {
  std::uniform_int_distribution<std::uint32_t> tail(0, kTraceBlockTokens - 1);
  std::uniform_int_distribution<std::uint32_t> out_len(o.min_output, std::max(o.min_output, o.max_output));
  TraceRequest r;
  r.timestamp_ms = t;
  r.hash_ids = ids;
  r.input_length = static_cast<std::uint32_t>(ids.size()) * kTraceBlockTokens - tail(rng);
  r.output_length = out_len(rng);
  return r;
}

// Fanout: `sessions` bursts of `turns` requests at one instant, each burst's requests sharing a
// document of system_blocks blocks that no earlier burst used, plus their own question.
std::vector<TraceRequest> Fanout(const SyntheticOptions& o, std::mt19937_64& rng) {
  std::vector<TraceRequest> out;
  std::uint64_t next_id = kUniqueIds;
  const double gap_ms = 1000.0 * o.turns / o.requests_per_second;
  for (std::uint32_t b = 0; b < o.sessions; ++b) {
    std::vector<std::uint64_t> doc;
    for (std::uint32_t k = 0; k < o.system_blocks; ++k) doc.push_back(next_id++);
    for (std::uint32_t q = 0; q < o.turns; ++q) {
      std::vector<std::uint64_t> ids = doc;
      for (std::uint32_t k = 0; k < o.blocks_per_turn; ++k) ids.push_back(next_id++);
      out.push_back(Request(b * gap_ms, ids, rng, o));
    }
  }
  return out;
}

// Single questions behind one of system_prompts prompts, prompt k (from 1) with weight 1/k.
std::vector<TraceRequest> SystemPrompts(const SyntheticOptions& o, std::mt19937_64& rng) {
  std::exponential_distribution<double> gap(o.requests_per_second / 1000.0);
  std::vector<double> weights;
  for (std::uint32_t k = 1; k <= std::max(1u, o.system_prompts); ++k) weights.push_back(1.0 / k);
  std::discrete_distribution<std::uint32_t> pick(weights.begin(), weights.end());
  std::vector<TraceRequest> out;
  std::uint64_t next_id = kUniqueIds;
  double t = 0;
  for (std::uint64_t n = 0; n < std::uint64_t{o.sessions} * o.turns; ++n) {
    t += gap(rng);
    const std::uint32_t prompt = pick(rng);
    std::vector<std::uint64_t> ids;
    for (std::uint32_t k = 0; k < o.system_blocks; ++k) ids.push_back(1 + prompt * o.system_blocks + k);
    for (std::uint32_t k = 0; k < o.blocks_per_turn; ++k) ids.push_back(next_id++);
    out.push_back(Request(t, ids, rng, o));
  }
  return out;
}

}  // namespace

std::vector<TraceRequest> SyntheticConversations(const SyntheticOptions& o) {
  std::mt19937_64 rng(o.seed);
  if (o.shape == WorkloadShape::kFanout) return Fanout(o, rng);
  if (o.shape == WorkloadShape::kSystemPrompts) return SystemPrompts(o, rng);
  std::exponential_distribution<double> gap(o.requests_per_second / 1000.0);
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
  std::uint64_t next_id = kUniqueIds;
  std::vector<std::vector<std::uint64_t>> history(o.sessions);
  // Bursts: request n arrives in burst n / burst_size, at a uniform moment of its first 250 ms.
  std::uniform_real_distribution<double> in_burst(0, 250);
  const double burst_gap_ms = 1000.0 * o.burst_size / o.requests_per_second;
  std::vector<double> burst_times;
  for (std::size_t n = 0; n < order.size(); ++n) {
    if (o.burst_size == 0) break;
    burst_times.push_back(static_cast<double>(n / o.burst_size) * burst_gap_ms + in_burst(rng));
  }
  for (std::size_t b = 0; b < burst_times.size(); b += o.burst_size) {
    std::sort(burst_times.begin() + b, burst_times.begin() + std::min(burst_times.size(), b + o.burst_size));
  }
  std::size_t n = 0;
  for (std::uint32_t s : order) {
    t = o.burst_size == 0 ? t + gap(rng) : burst_times[n++];
    auto& h = history[s];
    std::uint32_t added = o.blocks_per_turn;
    if (next_turn[s]++ == 0) {
      for (std::uint32_t b = 0; b < o.system_blocks; ++b) h.push_back(b);  // shared by everyone
      if (o.first_turn_blocks > 0) added = o.first_turn_blocks;
    }
    for (std::uint32_t b = 0; b < added; ++b) h.push_back(next_id++);
    out.push_back(Request(t, h, rng, o));
  }
  return out;
}

}  // namespace kvrouter::bench
