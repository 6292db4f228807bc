// GenerateRelay: router.generate's second half (docs/protocol.md sections 5 and 7). A routed
// request is forwarded to its worker's generate subject with a reply subject of this router's
// own (`_KVR.<router id>.<n>`); the worker's responses come back there and are relayed unchanged
// to the caller. The first response marks the request's prefill done, the final one (or NATS
// "no responders", or timeout_ms without a response) frees it. A request that ended with its
// final response is freed with its timing as seen here (from the forward to the first response,
// and between responses), which teaches the rank's learned rates.
//
// Thread contract: any thread. One mutex guards the in-flight table and is never held while
// calling Routing or publishing (Routing's mutex is never taken under it).
// Ownership: borrows the bus and the routing, which must outlive it.
//
//   GenerateRelay relay(bus, routing, "_KVR.1f.", clock);  relay.Forward(std::move(f), subject);
//   bus.Subscribe(relay.subject_pattern(), "", [&](auto& m) { relay.OnResponse(m); });
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <unordered_map>

#include "router/service/outbox.h"
#include "router/service/routing.h"
#include "events/base/log.h"
#include "transport/message_bus.h"
#include "events/base/thread_annotations.h"

namespace kvrouter {

class GenerateRelay {
 public:
  // A forwarded request is abandoned (freed, `timeout` to its caller) when its worker sends
  // nothing for timeout_ms (the request's; this long without one).
  static constexpr std::chrono::seconds kDefaultTimeout{300};

  GenerateRelay(MessageBus& bus, Routing& routing, std::string reply_prefix, Routing::Clock clock, RateLimitedLog& log);

  // What the relay subscribes to: reply_prefix + "*".
  std::string subject_pattern() const { return reply_prefix_ + "*"; }

  // Forwards a routed request to `worker_subject` (the worker's generate subject). A forward
  // that cannot be published is released at once and its caller told (`no_workers`); the
  // messages that causes go into `out`.
  void Forward(Outbox::Forward f, const std::string& worker_subject, Outbox& out);
  // A worker's response on one of the relay subjects.
  void OnResponse(const BusMessage& m, Outbox& out);
  // Abandons the requests past their deadline (`timeout` to their callers).
  void Expire(Outbox& out);

  std::size_t in_flight() const;

 private:
  struct InFlight {
    std::string request_id;
    std::string caller_reply;
    SteadyTime deadline;               // no response from the worker by then: abandoned
    std::chrono::milliseconds idle{};  // each response moves the deadline this far
    bool first_seen = false;
    SteadyTime forwarded{};
    SteadyTime first_response{};
    SteadyTime last_response{};
    // Of the responses so far: chunks counts tokens (the first response's as one), the mean is
    // per token after the first response, the max is between responses.
    ResponseTiming timing;
  };

  MessageBus& bus_;
  Routing& routing_;
  const std::string reply_prefix_;
  const Routing::Clock clock_;
  RateLimitedLog& log_;

  mutable KvMutex mu_;
  std::unordered_map<std::uint64_t, InFlight> inflight_ KV_GUARDED_BY(mu_);  // relay number -> request
  std::uint64_t next_ KV_GUARDED_BY(mu_) = 0;
};

}  // namespace kvrouter
