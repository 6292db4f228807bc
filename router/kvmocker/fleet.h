// MockWorkerFleet: kvmocker's simulated vLLM-like workers in one process, on NATS: registration
// heartbeats (docs/protocol.md section 4), KV events in the Dynamo (2) or vLLM (3) format, the
// recovery (6) and generate (7) endpoints; one MockEngine and one KvEventPublisher per rank.
// Threads: see the class. Start and Stop are called from one controlling thread; the fleet
// borrows the NatsClient, which must outlive it.
//
//   MockWorkerFleet fleet(config, **nc);  if (Status s = fleet.Start(); !s.ok()) ...;  fleet.Stop();
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "events/base/clock.h"
#include "events/base/status.h"
#include "events/message_codec.h"
#include "events/worker_codec.h"
#include "events/worker_publisher.h"
#include "router/kvmocker/config.h"
#include "router/engine/mock_engine.h"
#include "events/base/log.h"
#include "transport/nats_client.h"
#include "events/base/thread_annotations.h"

namespace kvrouter {

// num_workers workers of dp_size ranks each. NATS delivery threads (one per subscription) only
// decode generate requests and push them into a bounded inbox. One engine thread owns the
// engines: it sleeps until the earliest step end, a heartbeat or a new request, steps every
// engine whose previous step has ended on real time (virtual ms = steady-clock ms since Start;
// engine durations are already divided by the speedup ratio), and publishes events (as they
// happen), responses (at the step's end) and heartbeats. A recovery request reads its rank's
// publisher under engine_mu_ from its delivery thread.
class MockWorkerFleet {
 public:
  // Counters since construction (a snapshot).
  struct Counters {
    std::uint64_t requests = 0;          // generate requests accepted into the inbox
    std::uint64_t bad_requests = 0;      // undecodable / out-of-range requests and queries
    std::uint64_t inbox_full = 0;        // requests refused because the inbox was full
    std::uint64_t events = 0;            // KV event messages published
    std::uint64_t publish_failures = 0;  // any publish that failed
  };
  // Generate requests not yet finished (inbox, engine queues, running) before refusing more.
  static constexpr std::size_t kMaxOutstanding = 65536;
  std::atomic<std::size_t> outstanding_{0};

  MockWorkerFleet(MockerConfig config, NatsClient& nats);
  ~MockWorkerFleet();  // Stop()
  MockWorkerFleet(const MockWorkerFleet&) = delete;
  MockWorkerFleet& operator=(const MockWorkerFleet&) = delete;

  // Subscribes the generate and recovery endpoints, publishes the first registration of every
  // worker and starts the engine thread.
  Status Start();
  // Publishes status "leaving" for every worker, unsubscribes, stops the engine thread, answers
  // every unfinished request with finish_reason "error" and flushes. Idempotent.
  void Stop();

  const std::vector<std::uint64_t>& worker_ids() const { return worker_ids_; }
  Counters counters() const;
  // /metrics: the counters above and every rank's engine (kvmocker_*), as Prometheus text.
  std::string MetricsText();

 private:
  struct Rank {
    std::size_t worker_index = 0;
    std::uint32_t dp_rank = 0;
    std::unique_ptr<KvEventPublisher> publisher;  // numbers the engine's events, serves recovery
    std::unique_ptr<MockEngine> engine;
    bool stepping = false;  // a step is in progress until step_end_ms
    double step_end_ms = 0;
    std::vector<EngineOutput> outputs;  // of the step in progress, delivered at step_end_ms
    std::uint64_t vllm_seq = 0;         // next Kv-Seq (vLLM format)
  };
  struct GenerateJob {
    std::size_t rank_index = 0;
    GenerateRequest request;
    std::string reply;
    double arrival_ms = 0;
  };
  struct InFlight {
    std::string request_id;  // the client's
    std::string reply;
    double arrival_ms = 0;
    double first_token_ms = 0;
    std::uint32_t max_tokens = 1;
  };

  double NowMs() const;
  void EngineLoop();
  // Adds the jobs to their engines and runs every engine whose step has ended; returns the
  // earliest end of a step in progress (infinity when all are idle). Under engine_mu_.
  double AdvanceEngines(std::vector<GenerateJob>& jobs, double now_ms) KV_REQUIRES(engine_mu_);
  void DeliverOutputs(Rank& rank) KV_REQUIRES(engine_mu_);
  // From the engine sink, which runs inside AdvanceEngines.
  void PublishEvent(Rank& rank, KvEventBatch&& batch) KV_REQUIRES(engine_mu_);
  void PublishRegistrations(WorkerStatus status);
  void OnGenerate(std::size_t worker_index, const IncomingMessage& m);
  void OnRecovery(std::size_t rank_index, const IncomingMessage& m);
  void Respond(std::string_view reply, const GenerateResponse& response);
  void RespondError(std::string_view reply, std::string request_id, std::string message);
  void CountPublish(const Status& s, std::string_view what);

  const MockerConfig config_;
  NatsClient& nats_;
  const std::string prefix_;  // "namespace.{ns}.component.{comp}."
  std::vector<std::uint64_t> worker_ids_;
  const SteadyTime start_;
  RateLimitedLog log_;

  // Engine state: written by the engine thread; OnRecovery reads a publisher. Ranks are created by
  // the constructor and never move (the engine sinks point at them).
  KvMutex engine_mu_;
  // Worker i's rank r at i * dp_size + r.
  std::vector<std::unique_ptr<Rank>> ranks_ KV_GUARDED_BY(engine_mu_);
  std::vector<std::uint64_t> envelope_seq_ KV_GUARDED_BY(engine_mu_);              // per worker
  std::unordered_map<std::string, InFlight> in_flight_ KV_GUARDED_BY(engine_mu_);  // engine id ->
  std::uint64_t next_engine_request_ KV_GUARDED_BY(engine_mu_) = 0;

  KvMutex inbox_mu_;
  std::condition_variable_any inbox_cv_;
  std::vector<GenerateJob> inbox_ KV_GUARDED_BY(inbox_mu_);
  bool stopping_ KV_GUARDED_BY(inbox_mu_) = false;

  // Owned by the controlling thread (Start / Stop).
  std::vector<std::unique_ptr<Subscription>> subscriptions_;
  std::thread engine_thread_;
  bool started_ = false;
  bool stopped_ = false;

  std::atomic<std::uint64_t> requests_{0}, bad_requests_{0}, inbox_full_{0}, events_{0}, publish_failures_{0};
};

}  // namespace kvrouter
