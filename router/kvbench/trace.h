// Workloads for kvbench: Mooncake-format traces and a synthetic conversation workload.
//
// Mooncake trace: JSON lines {"timestamp": ms, "input_length": n, "output_length": m,
// "hash_ids": [ids...]}; each hash id stands for a 512-token block and equal ids mean equal
// content. Prompt tokens are derived from the ids deterministically (TokensFor), so shared
// prefixes stay shared at any router block size. Pure functions and values; thread-compatible.
//
//   auto t = ReadMooncakeTrace("conversation_trace.jsonl");  auto tokens = TokensFor(t->at(0));
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "events/status.h"

namespace kvrouter::bench {

inline constexpr std::uint32_t kTraceBlockTokens = 512;

struct TraceRequest {
  double timestamp_ms = 0;
  std::uint32_t input_length = 0;
  std::uint32_t output_length = 0;
  std::vector<std::uint64_t> hash_ids;
};

// Reads a JSONL trace; a malformed line is an InvalidArgument naming its line number.
Result<std::vector<TraceRequest>> ReadMooncakeTrace(const std::string& path);
// Parses one JSON line of the trace.
Result<TraceRequest> ParseMooncakeLine(std::string_view line);

// input_length prompt tokens: block i of the prompt is the 512 tokens of hash_ids[i].
std::vector<std::uint32_t> TokensFor(const TraceRequest& r);

struct SyntheticOptions {
  std::uint32_t sessions = 200;          // conversations
  std::uint32_t turns = 6;               // requests per conversation
  std::uint32_t system_blocks = 2;       // 512-token blocks every request starts with
  std::uint32_t blocks_per_turn = 3;     // new blocks each turn adds to its conversation
  double requests_per_second = 10;       // Poisson arrivals
  std::uint64_t seed = 1;
};
// Multi-turn conversations sharing a system prompt: turn t of a session repeats the whole
// conversation so far and adds new blocks; sessions interleave in time.
std::vector<TraceRequest> SyntheticConversations(const SyntheticOptions& o);

}  // namespace kvrouter::bench
