// kvbench's HTTP mode (--gateway): replays a trace as a user's clients would, through kvgateway's
// OpenAI API (streamed /v1/completions), on real time. TTFT, ITL and TPOT are the client's own:
// each token's server-sent event timed at the socket read that brought it (events of one read
// share its time). The prompt is TextFor's (one token per byte, as
// kvmocker's HTTP face tokenizes), so a trace's shared prefixes stay shared. Per-rank spread,
// P/D decisions and the bookings left come from the router's stats over NATS (fleet_stats.h).
// With --abort-fraction F, a seeded F of the requests are planned to be abandoned by their client
// at a random point (a random time within their first second, or after a random number of
// tokens); those whose abort comes before their end are counted as aborted, apart from errors
// (an answer that had already failed stays an error).
//
//   auto s = RunThroughGateway(trace, {.gateway_url = "http://127.0.0.1:8000", ...});
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "router/kvbench/online.h"

namespace kvrouter::bench {

// Splits a server-sent event stream, fed in arbitrary pieces, into the payloads of its `data:`
// lines (one leading space dropped). Events end at a blank line ("\n\n" or "\r\n\r\n").
class SseDataReader {
 public:
  // Calls on_data for each data line of every event completed by `bytes`, in order.
  void Feed(std::string_view bytes, const std::function<void(std::string_view data)>& on_data);
  // Bytes of an event not yet ended.
  std::size_t pending() const { return buffer_.size(); }

 private:
  std::string buffer_;
};

// Needs options.gateway_url (and the router's NATS for its stats; options.model names the
// model asked for).
Result<Summary> RunThroughGateway(const std::vector<TraceRequest>& trace, const OnlineOptions& options);

}  // namespace kvrouter::bench
