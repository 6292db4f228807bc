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
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "events/base/clock.h"
#include "events/base/status.h"

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
// The same prompt as text for an engine whose tokenizer makes one token of each byte (kvmocker's
// HTTP face): input_length letters and digits, block i of them hash_ids[i]'s, so requests that
// share ids share a text prefix.
std::string TextFor(const TraceRequest& r);

// Online replays: sleeps until trace[i] is due, the replay having started at `start` with
// trace[0]. (Pacing a load generator on the wall clock is its job, not a wait for a condition.)
void SleepUntilDue(const std::vector<TraceRequest>& trace, std::size_t i, SteadyTime start);

// The synthetic workload shapes (kvbench --workload).
enum class WorkloadShape {
  kChat,           // multi-turn conversations sharing one short system prompt
  kSystemPrompts,  // single questions behind a few long system prompts, popular ones more often
  kAgentic,        // few sessions whose context grows long, turn after turn
  kBursts,         // chat whose requests come in bursts: many at once, then quiet
  kFanout,         // bursts of questions at one instant on a document no worker has yet
};
const char* WorkloadName(WorkloadShape s);
std::optional<WorkloadShape> WorkloadFromName(std::string_view name);

struct SyntheticOptions {
  WorkloadShape shape = WorkloadShape::kChat;
  std::uint32_t sessions = 200;                     // conversations (system prompts: users; bursts: bursts)
  std::uint32_t turns = 6;                          // requests per conversation (bursts: per burst)
  std::uint32_t system_blocks = 2;                  // 512-token blocks every request starts with
  std::uint32_t first_turn_blocks = 0;              // new blocks of a session's first turn (0: blocks_per_turn)
  std::uint32_t blocks_per_turn = 3;                // new blocks each later turn adds to its conversation
  std::uint32_t system_prompts = 1;                 // distinct system prompts (documents, for bursts)
  std::uint32_t min_output = 64, max_output = 512;  // output tokens, uniform
  std::uint32_t burst_size = 0;                     // bursts: requests per burst (0 = Poisson arrivals)
  double requests_per_second = 10;                  // mean arrival rate
  std::uint64_t seed = 1;
};
// The defaults of each shape (kvbench's flags override sessions, turns, rate and seed):
//   chat            200 sessions x 6 turns, system 2 blocks, 3 new blocks a turn, 10 req/s
//   system-prompts  400 x 3 single questions (1 block) behind 16 system prompts of 8 blocks,
//                   prompt k chosen with weight 1/k, 20 req/s
//   agentic         24 sessions x 30 turns: 2 + 8 blocks, then 4 more a turn (66k tokens at
//                   the end), 100-300 output tokens, 2 req/s
//   bursts          chat's conversations, arriving 40 requests within 250 ms, then quiet (10 req/s
//                   on average)
//   fanout          40 bursts x 32 requests: a fresh 16-block document + a 1-block question,
//                   all at one instant, bursts spaced so that the mean rate is 8 req/s
SyntheticOptions WorkloadDefaults(WorkloadShape shape);
// Conversations: turn t of a session repeats the session so far and adds new blocks; sessions
// interleave in time (Poisson arrivals). Also system-prompts and bursts (see WorkloadShape).
std::vector<TraceRequest> SyntheticConversations(const SyntheticOptions& o);

}  // namespace kvrouter::bench
