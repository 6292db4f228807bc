// KvRelay: one live vLLM engine rank on kvrouter (the vLLM bridge). It reads the engine's ZMQ
// KV event stream (docs/protocol.md section 9), turns each KVEventBatch into Dynamo RouterEvents
// (section 2: token hashes from token_ids per section 1, the engine's block hashes kept as
// block_hash, its own increasing event ids from a KvEventPublisher) on ...kv-events, serves the
// recovery endpoint (section 6) from that publisher, and registers the worker with heartbeats
// (section 4), saying `leaving` on Stop.
//
// Sequence rules (section 9): seq at or below the last one -> the engine restarted: `cleared`,
// counting starts again. A seq past last + 1 (or past 0 at first sight) -> replay the missing
// batches from the engine's replay socket. Without one, or when the engine no longer has them,
// the relay cannot know what it missed: it publishes `cleared` (the router forgets a cache it
// can no longer trust; new events rebuild it), counts it and warns.
// Bad input (an undecodable batch, a block size other than --block-size) is counted and logged
// at a limited rate, never fatal.
//
// The engine's liveness (RegisterWhen::kEngineUp, kvrelay --engine-url): the worker registers
// only between EngineUp and EngineDown, as the engine's health checks say (EngineWatch). On
// EngineDown the relay publishes `cleared` (a dead engine's cache is gone; the router and this
// relay's own section 6 index start again from nothing), then `leaving`, stops heartbeating,
// forgets the last seq and drops the engine's batches until EngineUp registers it again; the first
// batch after that is judged as at first sight (replayed from seq 0 when it is not seq 0).
//
// Thread contract: Start, then OnBatch, Tick, EngineUp and EngineDown on one thread (the ZMQ
// loop); Stop from any thread, also while that thread is inside OnBatch (waiting for a replay):
// `leaving` goes out at once and nothing is published for the worker after it. counters(),
// registered() and last_seq() from any thread. The recovery endpoint runs on the bus's delivery
// thread. mu_ guards the publisher and the counters, reg_mu_ the registration state (held while a
// registration is published, so the wire sees them in the order of the state changes).
// Ownership: borrows the bus and the log.
//
//   KvRelay relay(options, bus, [&](std::int64_t s) { return stream.Replay(s, 2s, stop); }, log);
//   relay.Start();  while (...) { if (batch) relay.OnBatch(*batch); relay.Tick(now); }  relay.Stop();
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "events/base/clock.h"
#include "events/base/status.h"
#include "events/registration_codec.h"
#include "events/worker_publisher.h"
#include "events/base/log.h"
#include "transport/message_bus.h"
#include "events/base/thread_annotations.h"
#include "transport/zmq_stream.h"

namespace kvrouter {

// When the worker is registered.
enum class RegisterWhen {
  kAtStart,   // from Start to Stop
  kEngineUp,  // from EngineUp to EngineDown (and again), the engine's health being watched
};

struct RelayOptions {
  std::string ns = "dynamo";
  std::string component = "backend";
  std::uint64_t worker_id = 0;
  std::uint32_t dp_rank = 0;
  std::uint32_t block_size = 64;      // the engine's, and the router's
  std::uint64_t total_kv_blocks = 0;  // announced (0 = unknown)
  std::uint32_t max_num_seqs = 256;
  std::uint32_t max_num_batched_tokens = 8192;
  std::string device = "gpu";
  std::uint32_t heartbeat_ms = 1000;
  std::uint32_t lease_ms = 3000;
  std::string http_url;             // the engine's OpenAI base URL (section 11; "" = not announced)
  std::vector<std::string> models;  // the model names it serves
  // Section 13: its part in a disaggregated fleet (--role, --kv-connector, --bootstrap-port).
  WorkerRole role = WorkerRole::kBoth;
  KvConnector kv_connector = KvConnector::kNixl;
  std::uint32_t bootstrap_port = kDefaultBootstrapPort;
  RegisterWhen register_when = RegisterWhen::kAtStart;
};

class KvRelay {
 public:
  // The batches the engine still has from a seq on (null: the engine has no replay socket).
  using Replay = std::function<Result<std::vector<ZmqBatch>>(std::int64_t start_seq)>;
  struct Counters {
    std::uint64_t batches = 0;                // applied
    std::uint64_t events = 0;                 // RouterEvents published
    std::uint64_t replayed = 0;               // batches applied from replays
    std::uint64_t gaps = 0;                   // seq jumps seen
    std::uint64_t gaps_unrepaired = 0;        // ... that ended in `cleared`
    std::uint64_t restarts = 0;               // seq went back: engine restarted
    std::uint64_t bad_batches = 0;            // undecodable
    std::uint64_t block_size_mismatches = 0;  // stored events cut short
    std::uint64_t publish_failures = 0;
    std::uint64_t batches_engine_down = 0;  // dropped: the engine was not up (kEngineUp)
  };

  KvRelay(RelayOptions options, MessageBus& bus, Replay replay, RateLimitedLog& log);
  ~KvRelay();

  // Subscribes the recovery endpoint and publishes the first registration (kAtStart).
  Status Start();
  // One batch from the engine's stream.
  void OnBatch(const ZmqBatch& batch);
  // Heartbeats when due.
  void Tick(SteadyTime now);
  // The engine answers its health checks (again): registers `up` and heartbeats from `now` on.
  // False when it already was registered, or after Stop.
  bool EngineUp(SteadyTime now);
  // The engine stopped answering (`why`, for the log): `cleared`, `leaving`, no heartbeats, its
  // batches dropped until EngineUp. False when it was not registered.
  bool EngineDown(std::string_view why);
  // Publishes `leaving` (at once, whatever the ZMQ loop is doing), then unsubscribes; heartbeats,
  // events and replays in progress publish nothing for the worker after it. Idempotent.
  void Stop();

  Counters counters() const;
  // Registered `up` now (any thread).
  bool registered() const { return state_.load() == State::kUp; }
  // The last seq applied (any thread; -1: none yet).
  std::int64_t last_seq() const { return last_seen_.load(); }

 private:
  void Apply(const ZmqBatch& batch);
  // Fills [from, upto) from the engine's replay; `cleared` when it cannot.
  void Repair(std::int64_t from, std::int64_t upto);
  void PublishCleared(std::string_view why);
  void Publish(KvEventData data, StorageTier tier);
  void Register(WorkerStatus status) KV_REQUIRES(reg_mu_);
  bool stopped() const { return state_.load() == State::kStopped; }

  // kUp: registered, heartbeating; kEngineDown: not registered (the engine is not up yet, or no
  // longer); kStopped: `leaving` said (Stop).
  enum class State { kUp, kEngineDown, kStopped };

  const RelayOptions options_;
  MessageBus& bus_;
  const Replay replay_;
  RateLimitedLog& log_;
  const std::string events_subject_, instances_subject_;
  mutable KvMutex mu_;
  KvEventPublisher publisher_ KV_GUARDED_BY(mu_);
  std::unique_ptr<BusSubscription> recovery_sub_;
  std::optional<std::int64_t> last_;         // the ZMQ loop's thread only
  std::atomic<std::int64_t> last_seen_{-1};  // last_ for other threads (metrics)
  KvMutex reg_mu_;
  // Written only under reg_mu_ (read without it: an atomic, so the ZMQ loop can tell cheaply).
  std::atomic<State> state_;
  SteadyTime next_heartbeat_ KV_GUARDED_BY(reg_mu_){};
  Counters counters_ KV_GUARDED_BY(mu_);
};

}  // namespace kvrouter
