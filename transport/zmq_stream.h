// vLLM's ZMQ KV event stream (docs/protocol.md section 9), the input of kvrelay: a SUB socket on the
// engine's PUB endpoint and a DEALER on its ROUTER replay endpoint. libzmq (cppzmq) stays inside
// this file pair: the rest of the program sees ZmqBatch.
//
// Thread contract: one thread owns a ZmqEngineStream (ZMQ sockets are not thread-safe); another
// thread may end a Replay early through its stop token.
//
//   auto s = ZmqEngineStream::Connect({.endpoint = "tcp://127.0.0.1:5557", .replay_endpoint = "tcp://127.0.0.1:5558"});
//   while (auto b = (*s)->Receive(100ms)) ...;   auto missed = (*s)->Replay(12, 2s, stop.get_token());
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <stop_token>
#include <string>
#include <vector>

#include "events/base/status.h"

namespace kvrouter {

struct ZmqBatch {
  std::string topic;
  std::int64_t seq = 0;            // 8 bytes, big-endian, signed on the wire
  std::vector<std::byte> payload;  // the KVEventBatch (section 3)
};

struct ZmqStreamOptions {
  std::string endpoint;                        // the engine's PUB socket
  std::optional<std::string> replay_endpoint;  // its ROUTER replay socket, if it has one
  std::string topic;                           // subscription prefix ("" = everything)
};

class ZmqEngineStream {
 public:
  static Result<std::unique_ptr<ZmqEngineStream>> Connect(const ZmqStreamOptions& options);
  ~ZmqEngineStream();
  ZmqEngineStream(const ZmqEngineStream&) = delete;
  ZmqEngineStream& operator=(const ZmqEngineStream&) = delete;

  // The next batch, or nullopt after `timeout` without one. A message that is not
  // [topic, seq (8 bytes), payload] is an error (the caller counts it and goes on).
  Result<std::optional<ZmqBatch>> Receive(std::chrono::milliseconds timeout);
  bool has_replay() const;
  // Every batch the engine still has from `start_seq` on, in order (both reply shapes of
  // section 9), up to the end marker. NotFound without a replay endpoint; Timeout when the
  // engine does not finish within `timeout`, or when `stop` is requested meanwhile (seen within
  // kReplayStopCheck; the message says which). After either the socket is recreated.
  Result<std::vector<ZmqBatch>> Replay(std::int64_t start_seq, std::chrono::milliseconds timeout,
                                       std::stop_token stop = {});
  static constexpr std::chrono::milliseconds kReplayStopCheck{50};

 private:
  struct Sockets;
  explicit ZmqEngineStream(std::unique_ptr<Sockets> s);
  std::unique_ptr<Sockets> s_;
};

}  // namespace kvrouter
