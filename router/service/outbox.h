// Outbox: the messages a routing step decides to send, gathered while the routing mutex is
// held and published by the service after it is released (a bus may deliver synchronously, and
// a handler that publishes back into us must never find the mutex taken). Plain value, one per
// handler call; not shared between threads.
//
//   Outbox out;  routing.Route(req, kind, reply, out);  service.Send(out);
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <msgpack.hpp>

#include "events/router_endpoints_codec.h"
#include "events/base/status.h"
#include "router/scheduling/active_load.h"
#include "router/index/worker_key.h"

namespace kvrouter {

struct Outbox {
  // A routed router.generate request, to hand to the generate relay.
  struct Forward {
    RouteRequest request;  // with its request_id (made up when the caller gave none)
    RouteReply routed;
    std::string caller_reply;
  };
  std::vector<msgpack::sbuffer> syncs;  // replica sync messages, published first
  std::vector<Forward> forwards;
  std::vector<std::pair<std::string, msgpack::sbuffer>> replies;  // reply subject, body
  std::vector<std::pair<std::string, Status>> errors;             // reply subject, error
  std::vector<std::pair<WorkerKey, WorkerLoad>> metrics;          // load gauges to publish
};

}  // namespace kvrouter
