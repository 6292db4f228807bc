// FakeVllmEngine: a vLLM engine's KV event sockets exactly as docs/protocol.md section 9 describes
// them, for kvrelay's tests: a ZMQ PUB on 127.0.0.1 sending [topic, seq (8 bytes BE), payload]
// and, optionally, a ROUTER replay socket answering ["", start_seq] with every buffered batch
// from start_seq on, ["", seq, payload] each, then ["", -1, ""] (the end).
//
// Thread contract: Publish, Restart, Forget and MuteReplays from the test thread, replay_requests
// from any; the replay socket is served by the engine's own thread; a mutex guards the buffer.
//
//   FakeVllmEngine engine(/*with_replay=*/true);  engine.Publish({stored}, /*deliver=*/false);
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "events/vllm_codec.h"

namespace kvrouter::testing {

class FakeVllmEngine {
 public:
  explicit FakeVllmEngine(bool with_replay);
  ~FakeVllmEngine();

  std::string endpoint() const { return "tcp://127.0.0.1:" + std::to_string(pub_port_); }
  std::string replay_endpoint() const { return "tcp://127.0.0.1:" + std::to_string(replay_port_); }

  // The next batch (seq 0, 1, ...), kept for replays; sent on the PUB socket unless `deliver`
  // is false (a batch the subscriber never gets). Returns its seq.
  std::int64_t Publish(const std::vector<VllmEvent>& events, bool deliver = true);
  // The engine restarts: seq from 0 again, nothing buffered.
  void Restart();
  // Batches up to `seq` leave the buffer (replays no longer have them).
  void Forget(std::int64_t seq);
  // From now on replay requests are read (and counted) but never answered: an engine that hangs.
  void MuteReplays() { replays_muted_ = true; }
  // Replay requests received so far.
  int replay_requests() const { return replay_requests_.load(); }

 private:
  struct Sockets;
  void ServeReplays();

  std::unique_ptr<Sockets> s_;
  int pub_port_ = 0;
  int replay_port_ = 0;
  std::mutex mu_;
  std::map<std::int64_t, std::string> buffer_;  // seq -> payload
  std::int64_t next_seq_ = 0;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> replays_muted_{false};
  std::atomic<int> replay_requests_{0};
  std::thread replay_thread_;
};

}  // namespace kvrouter::testing
