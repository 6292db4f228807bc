// KvRouterService: the kvrouter service of PROTOCOL.md sections 2-5 on a MessageBus.
// It subscribes to KV events (Dynamo and vLLM formats) and worker registrations, keeps the
// worker registry with leases, and answers route, best_worker, mark_prefill, free and stats.
// With --router-queue-threshold a route whose every eligible rank is full waits in a bounded
// priority queue (DESIGN.md "Queue") and is answered when load drops (mark_prefill, free,
// lease expiry, registration, the periodic Tick). With --no-router-kv-events it subscribes to
// no events and predicts caches from its own booked decisions (ApproxIndex).
//
// Threads: bus handlers run on the bus's delivery threads (one per subscription on NATS).
// Event handlers only decode and Submit to the ShardedIndex (whose shard threads apply them),
// so a route never waits behind ingestion. The registry, the active-load tracker and the
// selector are guarded by one mutex (mu_), held only for the short booking step. Tick() runs
// lease expiry and the 300 s booking sweep; main() calls it every 50 ms from a timer thread,
// tests call it with a fake clock.
// Ownership: borrows the bus, which must outlive the service; owns everything else.
//
//   KvRouterService svc(config, bus);  if (auto s = svc.Start(); !s.ok()) ...;  svc.Tick();
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "events/message_codec.h"
#include "router/active_load.h"
#include "router/approx_index.h"
#include "router/config.h"
#include "router/request_queue.h"
#include "router/selector.h"
#include "router/sharded_index.h"
#include "transport/log.h"
#include "transport/message_bus.h"

namespace kvrouter {

// Subject names for one namespace / component (PROTOCOL.md).
struct Subjects {
  Subjects(const std::string& ns, const std::string& component);
  std::string kv_events, vllm_events_prefix, instances;
  std::string active_sequences;
  std::string route, best_worker, mark_prefill, free, stats, kv_metrics, generate;
  std::string worker_generate_prefix;  // + worker_id
};

class KvRouterService {
 public:
  using Clock = std::function<SteadyTime()>;

  KvRouterService(RouterConfig config, MessageBus& bus, Clock clock = nullptr,
                  std::uint64_t seed = std::random_device{}());
  ~KvRouterService();
  KvRouterService(const KvRouterService&) = delete;
  KvRouterService& operator=(const KvRouterService&) = delete;

  // Subscribes to every subject. Fails (and subscribes to nothing) when a flag asks for a
  // feature this build does not have, or when the bus refuses a subscription.
  Status Start();
  // Unsubscribes; no handler runs after it returns.
  void Stop();
  // Lease expiry and the booking sweep, at the clock's now.
  void Tick();

  const Subjects& subjects() const { return subjects_; }
  ShardedIndex& index() { return index_; }

 private:
  struct WorkerInfo {
    WorkerRegistration reg;
    bool has_lease = false;  // false until the first heartbeat (event-only workers)
    SteadyTime lease_deadline{};
  };

  void HandleKvEvent(const BusMessage& m);
  void HandleVllmEvent(const BusMessage& m);
  void HandleInstances(const BusMessage& m);
  enum class RouteKind { kRoute, kBestWorker, kGenerate };
  void HandleRoute(const BusMessage& m, RouteKind kind);
  // A worker's response to a forwarded generate request, on this router's relay subject.
  void HandleRelay(const BusMessage& m);
  void HandleLifecycle(const BusMessage& m, bool free);
  void HandleStats(const BusMessage& m);
  void HandleReplicaSync(const BusMessage& m);
  // Queues a message telling the other replicas about a booking change (--router-replica-sync);
  // mu_ held. It is published by Send, after mu_ is released: a bus may deliver synchronously
  // to another replica whose handlers publish back to us.
  void PublishSync(ActiveSequenceEvent::Kind kind, const std::string& request_id, WorkerKey worker,
                   std::span<const SequenceHash> seq = {}, std::uint32_t isl = 0, std::uint32_t overlap = 0);

  // Registers a worker seen only through its events (no lease until it heartbeats), or grows
  // such a worker's ranks to cover dp_rank. Returns the drop reason when the event must not be
  // indexed: a rank outside the worker's registered range or beyond --router-max-dp-size, or a
  // new worker beyond --router-max-worker-ranks; nullptr when it may be.
  const char* AdmitEventWorker(std::uint64_t worker_id, std::uint32_t dp_rank);
  // mu_ held: counts and logs a refused registration (never obeyed, not even in part).
  void RefuseRegistrationLocked(std::string_view reason, const std::string& detail);
  // mu_ held: the reason a registration must be refused, or nullptr.
  const char* RegistrationRefusalLocked(const WorkerRegistration& reg, std::string& detail) const;
  void ForgetLocked(std::uint64_t worker_id);  // mu_ held
  // A decoded request made ready for selection: hashed once, its cost parameters resolved.
  struct Prepared {
    std::vector<LocalHash> local;
    std::vector<SequenceHash> seq;
    SelectionRequest sel;
    CostParams params;
  };
  struct PendingRoute {
    RouteRequest req;
    Prepared prepared;
    std::string reply;      // where the answer goes once admitted
    bool generate = false;  // router.generate: forward to the worker instead of replying
  };
  // A generate request forwarded to a worker, until its final response.
  struct InFlight {
    std::string request_id;
    std::string caller_reply;
    SteadyTime deadline;
    bool first_seen = false;
  };
  using RouteQueue = RequestQueue<PendingRoute>;
  // Replies and gauges gathered under mu_ and published after it is released.
  struct Outbox {
    struct Forward {
      std::string subject, reply;
      msgpack::sbuffer body;
      std::uint64_t relay = 0;  // its inflight_ entry
    };
    std::vector<msgpack::sbuffer> syncs;  // replica sync messages, published first
    std::vector<Forward> forwards;        // generate requests to workers
    std::vector<std::pair<std::string, msgpack::sbuffer>> replies;
    std::vector<std::pair<std::string, Status>> errors;
    std::vector<std::pair<WorkerKey, WorkerLoad>> metrics;
  };
  // A queued request with no timeout_ms waits at most this long (then `timeout`), so a client
  // that went away is never booked on a worker long after.
  static constexpr std::chrono::seconds kDefaultQueueWait{60};
  // A generate request without timeout_ms is abandoned (freed, `timeout`) after this long.
  static constexpr std::chrono::seconds kDefaultGenerateTimeout{300};

  Result<Prepared> Prepare(const RouteRequest& req) const;
  // Overlap per rank: from the event index (any thread), or in approximate mode from the
  // predictions (mu_ held).
  OverlapScores Overlaps(const Prepared& p) const;
  // mu_ held: the ranks the request may go to, with their load (and overlap when given).
  Result<std::vector<Candidate>> CandidatesLocked(const RouteRequest& req, std::span<const SequenceHash> seq,
                                                  const OverlapScores& overlaps) const;
  // The candidates that are not full (all of them when the queue is off).
  std::vector<Candidate> OpenRanks(std::vector<Candidate> cands) const;
  // mu_ held: OK when one more booking of `blocks` blocks fits the booking bounds, else
  // `overloaded`.
  Status BookingRoomLocked(std::size_t blocks) const;
  // mu_ held: select among `cands`, book, count.
  Result<RouteReply> DecideLocked(const RouteRequest& req, const Prepared& p, std::span<const Candidate> cands,
                                  double queued_ms);
  Status EnqueueLocked(RouteRequest req, Prepared prepared, std::span<const Candidate> all, std::string_view reply,
                       bool generate);
  // mu_ held: a routed generate request goes to its worker; responses come back on the relay.
  void ForwardLocked(const RouteRequest& req, const RouteReply& routed, std::string caller_reply, Outbox& out);
  void ExpireInFlightLocked(Outbox& out);
  // mu_ held: admits, in policy order, the queued requests that fit now.
  void DrainLocked(Outbox& out);
  // mu_ held: answers `timeout` to queued requests past their deadline (Tick, every 50 ms).
  void ExpireQueuedLocked(Outbox& out);
  // mu_ held: moves the gauges and sync messages gathered under mu_ into `out`.
  void TakeDeferredLocked(Outbox& out);
  // mu_ held: answers `not_found` to queued requests pinned to workers that are gone (sorted).
  void FailPinnedLocked(std::span<const std::uint64_t> worker_ids, Outbox& out);
  // mu_ held: removes a still-queued request (its client freed it); true if there was one.
  bool CancelQueuedLocked(const std::string& request_id, Outbox& out);
  // A forward that could not be published: release it and tell the caller.
  void AbandonForward(const Outbox::Forward& f, const Status& why);
  void Send(Outbox& out);
  // Replies `body`, or an `internal` error when it exceeds the bus's max payload.
  void Reply(const BusMessage& m, const msgpack::sbuffer& body);
  void ReplyError(const BusMessage& m, const Status& s);
  void PublishMetrics(WorkerKey worker, const WorkerLoad& load);
  void CountDrop(const std::string& reason);

  const RouterConfig config_;
  MessageBus& bus_;
  const Clock clock_;
  const Subjects subjects_;
  const std::uint64_t router_id_;  // tells this replica's sync messages from the others'
  ShardedIndex index_;
  RateLimitedLog log_;

  std::mutex mu_;
  std::map<std::uint64_t, WorkerInfo> workers_;    // GUARDED_BY(mu_), ordered: stable candidates
  std::uint64_t ranks_total_ = 0;                  // GUARDED_BY(mu_) sum of workers_' dp_size
  ActiveLoad load_;                                // GUARDED_BY(mu_)
  Selector selector_;                              // GUARDED_BY(mu_)
  std::mt19937_64 rng_;                            // GUARDED_BY(mu_)
  std::map<std::string, std::uint64_t> routed_;    // GUARDED_BY(mu_) mode -> count
  std::map<WorkerKey, std::uint64_t> routed_to_;   // GUARDED_BY(mu_) ordered: a worker's ranks are a range
  std::map<std::string, std::uint64_t> route_errors_;  // GUARDED_BY(mu_) code -> count
  std::map<std::string, std::uint64_t> drops_;     // GUARDED_BY(mu_) service-side drop reasons
  std::uint64_t workers_refused_ = 0;              // GUARDED_BY(mu_) registrations refused, all reasons
  std::map<std::string, std::uint64_t> registrations_refused_;  // GUARDED_BY(mu_) reason -> count
  std::map<std::string, std::uint64_t> replica_sync_refused_;   // GUARDED_BY(mu_) reason -> count
  std::uint64_t leases_expired_ = 0;               // GUARDED_BY(mu_)
  RouteQueue queue_;                               // GUARDED_BY(mu_)
  std::uint64_t queue_admitted_ = 0;               // GUARDED_BY(mu_)
  std::uint64_t queue_timed_out_ = 0;              // GUARDED_BY(mu_)
  std::uint64_t queue_refused_ = 0;                // GUARDED_BY(mu_)
  std::vector<WorkerKey> metrics_dirty_;           // GUARDED_BY(mu_) loads to publish
  std::vector<msgpack::sbuffer> pending_syncs_;    // GUARDED_BY(mu_) replica sync to publish
  std::unordered_map<std::string, std::uint32_t> queued_ids_;  // GUARDED_BY(mu_) request_id -> count
  // Approximate mode (--no-router-kv-events without --load-aware); null otherwise.
  const std::unique_ptr<ApproxIndex> approx_;      // contents GUARDED_BY(mu_)
  const std::string relay_prefix_;                 // "_KVR.<router_id>."
  std::unordered_map<std::uint64_t, InFlight> inflight_;  // GUARDED_BY(mu_) relay number -> request
  std::uint64_t next_relay_ = 0;                   // GUARDED_BY(mu_)
  std::uint64_t generated_ids_ = 0;                // GUARDED_BY(mu_)

  std::vector<std::unique_ptr<BusSubscription>> subs_;
};

}  // namespace kvrouter
