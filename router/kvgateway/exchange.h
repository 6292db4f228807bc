// Gateway::Exchange, one client request in flight, and what the parts of the gateway's request
// path share (gateway.cc: the request path and the pass-through; gateway_disagg.cc: the legs of
// a disaggregated request; gateway_admin.cc: metrics and the admin endpoints). Internal to
// router/kvgateway/.
// Thread contract: an exchange is touched on its client connection's thread only (that
// connection's HttpIo loop), so nothing in it is locked: Handle runs there, the render and engine
// calls it starts run there (HttpClient runs a call on the loop it is started on), the router's
// answer is continued there (HttpReply::Defer), and so are the reply's callbacks. Debug builds
// check it (AssertOnItsThread).
#pragma once

#include <fmt/format.h>

#include <cassert>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "router/kvgateway/gateway.h"

namespace kvrouter {

inline double Seconds(SteadyTime::duration d) { return std::chrono::duration<double>(d).count(); }

// 504's message: the engine has the request (`s` is HttpClient's kTimeout) and is not answering;
// another engine is not asked, which would run it a second time.
inline std::string EngineTimeoutMessage(std::uint64_t worker, std::uint32_t timeout_ms, const Status& s) {
  return fmt::format("worker {} took the request and did not answer within {} ms (--engine-timeout-ms); it is not "
                     "sent to another engine, which would run it again: {}",
                     worker, timeout_ms, s.message());
}

struct Gateway::Exchange {
  // How far the exchange got. It moves forward, but for a retry (back to kRouting, never once
  // kResponding), and it ends (done) in any stage.
  enum class Stage {
    kRendering,   // the render (or /tokenize) call runs
    kRouting,     // the router is asked, or the fallback picks the engine
    kCalling,     // the engine call (a disaggregated attempt's legs) runs; nothing went to the client
    kResponding,  // the response head went to the client: no other engine may answer it now
  };
  void Enter(Stage next) {
    AssertOnItsThread();
    assert(stage != Stage::kResponding || next == Stage::kResponding);
    stage = next;
  }
  bool began() const { return stage == Stage::kResponding; }

  void AssertOnItsThread() const { assert(std::this_thread::get_id() == thread); }
  const std::thread::id thread = std::this_thread::get_id();  // made by Handle, on its connection's thread
  std::shared_ptr<HttpReply> reply;
  HttpRequest http;
  OpenAiRequest request;
  std::string endpoint;      // "chat" or "completions", for the counters
  std::string request_id;    // the client's x-request-id, or ours (echoed, sent to the engine)
  std::string booking_base;  // ours, unique per exchange: the router's request id
  std::string session_id;
  std::vector<std::uint32_t> token_ids;
  std::vector<MmItem> mm_items;         // the render answer's features, and the cache_salt
  std::vector<std::uint64_t> allowed;   // workers serving the model
  std::vector<std::uint64_t> excluded;  // workers that failed this request
  std::vector<HttpEndpoint> render_at;
  SteadyTime arrival;
  Stage stage = Stage::kRendering;
  bool fallback = false;  // no router answered: the gateway picks the engines (Fallback), nothing is booked
  // The current attempt.
  std::uint32_t attempt = 0;
  std::string booking;  // request id of the attempt's booking: booking_base, "#n" on a retry
  bool booked = false;  // a route reply booked `booking` and it is not freed yet
  RouteReply routed;
  std::shared_ptr<HttpCall> call;  // the engine call running now (render or completion)
  std::uint64_t call_seq = 0;      // of the latest call started
  int engine_status = 0;
  HttpHeaders engine_headers;
  std::string engine_error;  // the body of a 5xx answer, for the message
  bool first_byte = false;   // the engine's first response byte came (this attempt)
  std::string held;          // a plain response's body so far, sent whole when it ends
  bool done = false;         // answered, failed or gone (in any stage): nothing more is sent
  SteadyTime called;         // the engine call started
  SteadyTime last_chunk;
  ResponseTiming timing;       // of the engine's response so far (ttfb_ms once its first byte came)
  bool ttfb_observed = false;  // in the ttfb histogram (once per request, whatever the retries)
  bool engine_broke = false;   // the engine's response broke off: its timing is not its speed
  bool read_paused = false;    // the engine call is paused until the client drains (back-pressure)
  bool slowed = false;         // it was paused at least once (kvgateway_slow_clients_total)
  // Section 13: the legs of a disaggregated attempt (routed.disaggregated).
  std::string leg_body;                    // the decode leg's body ("": the client's, unchanged)
  std::shared_ptr<HttpCall> prefill_call;  // the prefill leg running now
  std::uint64_t prefill_seq = 0;           // of the latest prefill leg started
  int prefill_status = 0;
  HttpHeaders prefill_headers;  // its answer's headers a client gets, when that answer is the client's
  std::string prefill_body;     // its answer so far, up to kMaxHeldBody
  bool prefill_overflow = false;  // its answer went past kMaxHeldBody
  bool prefill_answered = false;  // its answer came whole (prefill_done sent)
  std::optional<std::uint32_t> prefill_cached;  // the prefill engine's usage cached_tokens
  SteadyTime prefill_called;
  SteadyTime prefill_end;  // when its answer came
  // Render.
  int render_status = 0;
  std::string render_body;
};

}  // namespace kvrouter
