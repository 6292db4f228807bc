// NatsLoops: one NATS connection per event loop of an HttpIo, each served by its loop's thread
// (NatsOptions::event_loop), so that what a request served on a loop sends and gets over NATS is
// sent and handled on that thread, with no hand-off to nats.c's threads and back.
// Thread contract: Connect and destruction from the controlling thread, while the loops run
// (or before they start) and before the HttpIo goes; at() and Current() from any thread.
// Ownership: owns the connections; borrows the HttpIo, which must outlive it.
//
//   auto loops = NatsLoops::Connect(io, {.url = url});
//   if (auto i = (*loops)->Current()) (*loops)->at(*i).Publish(subject, data);
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <vector>

#include "events/base/status.h"
#include "transport/http_io.h"
#include "transport/nats_client.h"

namespace kvrouter {

class NatsLoops {
 public:
  // `options.event_loop` is set for each loop; `options.name` gets the loop's number.
  static Result<std::unique_ptr<NatsLoops>> Connect(HttpIo& io, NatsOptions options);

  std::size_t size() const { return clients_.size(); }
  NatsClient& at(std::size_t loop) { return *clients_.at(loop); }
  // The loop the calling thread runs, or nullopt off the loops.
  std::optional<std::size_t> Current() const;
  // What the handlers queued on the loops before this call publish is written and has reached
  // the server (each loop runs what was queued on it, then a round trip on its connection), or
  // `timeout` passed. From a thread off the loops, while they run (at shutdown, before they stop).
  void Flush(std::chrono::milliseconds timeout);
  // Closes every connection (each closes after a flush its loop answers: call it while the loops
  // run). Publishing on them fails from then on; the clients stay, for whoever holds them.
  void Close();

 private:
  explicit NatsLoops(HttpIo& io) : io_(io) {}
  HttpIo& io_;
  std::vector<std::unique_ptr<NatsClient>> clients_;
};

}  // namespace kvrouter
