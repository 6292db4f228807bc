// Routing: the decision half of the router (docs/design.md "Selection", "Queue", "Approximate
// mode"): candidates from the worker registry, overlap from the index (or, in approximate mode,
// from predictions), load from its own bookings, the selector, booking, the bounded queue of
// held-back requests, replica sync of bookings and the per-rank routing counters.
//
// Thread contract: any thread may call any method. One mutex (the routing mutex) guards the
// bookings, the selector, the queue and the predictions; it is held only for the decision
// itself: prompt hashing and event-index lookups happen before it is taken. Under it the
// registry's reader lock is taken (never the other way round). Ingestion never takes it.
// Nothing is published under it: every reply, error, forward, gauge and sync message goes into
// the caller's Outbox, which the caller sends after the call returns.
// Ownership: borrows the registry and the index, which must outlive it.
//
//   Routing routing(config, registry, index, clock, router_id, seed);
//   Outbox out;  routing.Route(std::move(req), Routing::Kind::kRoute, reply_subject, out);
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "events/message_codec.h"
#include "router/scheduling/active_load.h"
#include "router/index/approx_index.h"
#include "router/service/config.h"
#include "router/service/outbox.h"
#include "router/scheduling/replica_peers.h"
#include "router/scheduling/request_queue.h"
#include "router/scheduling/selector.h"
#include "router/index/sharded_index.h"
#include "router/service/worker_registry.h"
#include "events/base/log.h"
#include "events/base/thread_annotations.h"

namespace kvrouter {

class Routing {
 public:
  using Clock = std::function<SteadyTime()>;
  enum class Kind { kRoute, kBestWorker, kGenerate };
  static std::string_view KindName(Kind k);  // "route", "best_worker", "generate"
  // Told of every decision (under the routing mutex: keep it short), e.g. for histograms.
  using DecisionObserver = std::function<void(Kind, const RouteReply&)>;

  Routing(const RouterConfig& config, const WorkerRegistry& registry, const ShardedIndex& index, Clock clock,
          std::uint64_t router_id, std::uint64_t seed, RateLimitedLog& log);

  // Decides a decoded request addressed to `reply`: a route reply (route, best_worker), a
  // forward (generate), a place in the queue (answered when admitted), or an error.
  void Route(RouteRequest req, Kind kind, std::string reply, Outbox& out);
  // Counts a route request that failed before it could be decided (it did not decode).
  void CountError(Kind kind, StatusCode code);
  // Set before the first request.
  void SetDecisionObserver(DecisionObserver observer) { observer_ = std::move(observer); }

  // Lifecycle of a booked request (idempotent); true when something changed. Freeing a request
  // that is still queued cancels it (its caller gets `timeout`).
  bool MarkPrefill(const std::string& request_id, Outbox& out);
  bool Free(const std::string& request_id, Outbox& out);

  // The registry has forgotten these workers (ascending ids): release their bookings and
  // predictions; queued requests pinned to them get `not_found`; the rest may now fit.
  void ForgetWorkers(std::span<const std::uint64_t> worker_ids, Outbox& out);
  // New capacity: admit the queued requests that fit now.
  void Drain(Outbox& out);
  // The 300 s booking sweep, prediction expiry, queue timeouts, then a drain.
  void Tick(Outbox& out);
  // A booking change of another replica (--router-replica-sync). An `add` must name a rank the
  // registry knows and obey the prompt and booking bounds, else it is refused and counted.
  void ApplyReplica(const ActiveSequenceEvent& e, Outbox& out);
  // A heartbeat of another replica; the bookings of a replica that falls silent are released
  // on Tick (ReplicaPeers). Paused while this router's event connection is down. A later epoch
  // of the peer releases its bookings of earlier epochs and sends this router's own again.
  void ReplicaHeartbeat(std::uint64_t router_id, std::uint32_t epoch, Outbox& out);
  void PauseReplicas();
  // Also releases every booking synced by a peer (frees sent meanwhile were lost), moves this
  // router to its next epoch (its own frees sent around the outage may be lost as well) and
  // sends its live bookings again at that epoch.
  void ResumeReplicas(Outbox& out);
  // The connection that publishes this router's sync messages came back: some sent around the
  // outage may be lost. Moves to the next epoch and sends the live bookings again.
  void NextEpoch(Outbox& out);
  // This router's epoch (RouterHeartbeat::epoch). It starts from the wall clock's seconds, so a
  // restarted replica that keeps its --router-id is at a later epoch than before.
  std::uint32_t epoch() const;

  // Fills, for the ranks already in reply.workers, their load, routed count and (approximate
  // mode) predicted blocks; and the routing counters and breakdowns.
  void FillStats(StatsReply& reply) const;

 private:
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
  using RouteQueue = RequestQueue<PendingRoute>;
  // A queued request with no timeout_ms waits at most this long (then `timeout`), so a client
  // that went away is never booked on a worker long after.
  static constexpr std::chrono::seconds kDefaultQueueWait{60};

  Result<Prepared> Prepare(const RouteRequest& req) const;
  // Overlap per rank from the event index into `out` (no lock needed; empty outside mode kv).
  // Callers pass a buffer they keep: at thousands of matching workers a fresh result would be
  // allocated and freed per route.
  void IndexOverlaps(const Prepared& p, OverlapScores& out) const;
  // Overlap per rank from the predictions (approximate mode), into `out`.
  void PredictedOverlaps(const Prepared& p, OverlapScores& out) const KV_REQUIRES(mu_);
  // The ranks the request may go to, with their load (and overlap when given; `overlaps` is
  // sorted in place).
  Result<std::vector<Candidate>> CandidatesLocked(const RouteRequest& req, std::span<const SequenceHash> seq,
                                                  OverlapScores& overlaps) const KV_REQUIRES(mu_);
  // The candidates that are not full (all of them when the queue is off).
  std::vector<Candidate> OpenRanks(std::vector<Candidate> cands) const;
  // OK when one more booking of `blocks` blocks fits the booking bounds, else `overloaded`.
  Status BookingRoomLocked(std::size_t blocks) const KV_REQUIRES(mu_);
  // Select among `cands`, book, count.
  Result<RouteReply> DecideLocked(Kind kind, const RouteRequest& req, const Prepared& p, std::span<const Candidate> cands,
                                  double queued_ms) KV_REQUIRES(mu_);
  Status EnqueueLocked(RouteRequest req, Prepared prepared, std::span<const Candidate> all, std::string_view reply,
                       bool generate) KV_REQUIRES(mu_);
  // Admits, in policy order, the queued requests that fit now.
  void DrainLocked(Outbox& out) KV_REQUIRES(mu_);
  // A decided request: its reply, or for router.generate its forward.
  void DeliverLocked(RouteRequest req, const RouteReply& routed, std::string reply, bool generate, Outbox& out)
      KV_REQUIRES(mu_);
  void ExpireQueuedLocked(Outbox& out) KV_REQUIRES(mu_);
  void FailPinnedLocked(std::span<const std::uint64_t> worker_ids, Outbox& out) KV_REQUIRES(mu_);
  bool CancelQueuedLocked(const std::string& request_id, Outbox& out) KV_REQUIRES(mu_);
  void UnqueueIdLocked(const std::string& request_id) KV_REQUIRES(mu_);
  // Moves the gauges and sync messages gathered under mu_ into `out`.
  void TakeDeferredLocked(Outbox& out) KV_REQUIRES(mu_);
  // Queues a message telling the other replicas about a booking change (--router-replica-sync).
  void SyncLocked(ActiveSequenceEvent::Kind kind, const std::string& request_id, WorkerKey worker,
                  std::span<const SequenceHash> seq = {}, std::uint32_t isl = 0, std::uint32_t overlap = 0)
      KV_REQUIRES(mu_);
  bool LifecycleLocked(const std::string& request_id, bool free, Outbox& out) KV_REQUIRES(mu_);
  // Frees these bookings of other replicas (dead, or not to be trusted after an outage).
  void ReleasePeerBookingsLocked(const std::vector<std::string>& request_ids) KV_REQUIRES(mu_);
  // A heartbeat or sync message says `router_id` is at `epoch`: see ReplicaHeartbeat.
  void PeerEpochLocked(std::uint64_t router_id, std::uint32_t epoch, Outbox& out) KV_REQUIRES(mu_);
  // Queues an `add` for each of this router's own bookings (at its current prefill).
  void SyncOwnBookingsLocked() KV_REQUIRES(mu_);
  void NextEpochLocked() KV_REQUIRES(mu_);

  const RouterConfig& config_;
  const WorkerRegistry& registry_;
  const ShardedIndex& index_;
  const Clock clock_;
  const std::uint64_t router_id_;
  RateLimitedLog& log_;

  mutable KvMutex mu_;
  ActiveLoad load_ KV_GUARDED_BY(mu_);
  Selector selector_ KV_GUARDED_BY(mu_);
  std::mt19937_64 rng_ KV_GUARDED_BY(mu_);
  RouteQueue queue_ KV_GUARDED_BY(mu_);
  std::unordered_map<std::string, std::uint32_t> queued_ids_ KV_GUARDED_BY(mu_);  // request_id -> count
  // Approximate mode (--no-router-kv-events without --load-aware); null otherwise.
  const std::unique_ptr<ApproxIndex> approx_ KV_PT_GUARDED_BY(mu_);
  std::map<std::string, std::uint64_t> routed_ KV_GUARDED_BY(mu_);        // mode -> count
  std::map<WorkerKey, std::uint64_t> routed_to_ KV_GUARDED_BY(mu_);       // ordered: a worker's ranks are a range
  std::map<std::string, std::uint64_t> route_errors_ KV_GUARDED_BY(mu_);  // code -> count
  // Requests by endpoint: "<endpoint>" -> received, "<endpoint>.<result>" -> answered so
  // (result "ok" or an error code); a queued request is counted when it leaves the queue.
  std::map<std::string, std::uint64_t, std::less<>> requests_ KV_GUARDED_BY(mu_);
  void CountLocked(Kind kind, std::string_view result) KV_REQUIRES(mu_);
  void BumpLocked(std::string_view key) KV_REQUIRES(mu_);  // ++requests_[key], no allocation once seen
  DecisionObserver observer_;  // set before the first request, then only read
  std::map<std::string, std::uint64_t> replica_refused_ KV_GUARDED_BY(mu_);  // reason -> count
  ReplicaPeers peers_ KV_GUARDED_BY(mu_);
  std::uint64_t replica_released_ KV_GUARDED_BY(mu_) = 0;  // bookings of dead replicas released
  static std::uint32_t StartEpoch();                       // the wall clock's seconds
  std::uint32_t epoch_ KV_GUARDED_BY(mu_) = StartEpoch();  // up by one per reconnect
  std::uint64_t queue_admitted_ KV_GUARDED_BY(mu_) = 0;
  std::uint64_t queue_timed_out_ KV_GUARDED_BY(mu_) = 0;
  std::uint64_t queue_refused_ KV_GUARDED_BY(mu_) = 0;
  std::uint64_t generated_ids_ KV_GUARDED_BY(mu_) = 0;
  std::vector<WorkerKey> metrics_dirty_ KV_GUARDED_BY(mu_);        // loads to publish
  std::vector<msgpack::sbuffer> pending_syncs_ KV_GUARDED_BY(mu_);  // replica sync to publish
};

}  // namespace kvrouter
