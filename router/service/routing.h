// Routing: the decision half of the router (docs/design.md "Selection", "Queue", "Approximate
// mode"), one routing mutex over pieces with one job each: the Scheduler (candidates, selection,
// booking, predictions), the AdmissionQueue (requests held back while their ranks are full),
// SessionAffinity (the rank each session last went to), ReplicaSync (bookings shared with other
// replicas) and RouteCounters. Routing takes the
// ranks from the worker registry, reads the event index before its mutex, and wires the pieces:
// a decision books, syncs, counts and answers; a drop in load drains the queue.
//
// Thread contract: any thread may call any method. The routing mutex is held only for the
// decision itself: prompt hashing and event-index lookups happen before it is taken. Under it
// the registry's reader lock is taken (never the other way round). Ingestion never takes it.
// Nothing is published under it: every reply, error, forward, gauge and sync message goes into
// the caller's Outbox, which the caller sends after the call returns.
// Ownership: borrows the registry and the index, which must outlive it.
//
//   Routing routing(config, registry, index, clock, router_id, seed, log);
//   Outbox out;  routing.Route(std::move(req), RouteKind::kRoute, reply_subject, out);
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "events/replica_sync_codec.h"
#include "events/router_endpoints_codec.h"
#include "router/index/sharded_index.h"
#include "router/scheduling/admission_queue.h"
#include "router/scheduling/replica_sync.h"
#include "router/scheduling/scheduler.h"
#include "router/scheduling/session_affinity.h"
#include "router/service/config.h"
#include "router/service/outbox.h"
#include "router/service/route_counters.h"
#include "router/service/worker_registry.h"
#include "events/base/log.h"
#include "events/base/thread_annotations.h"

namespace kvrouter {

class Routing {
 public:
  using Clock = std::function<SteadyTime()>;
  using Kind = RouteKind;
  static std::string_view KindName(Kind k) { return RouteKindName(k); }
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
  // that is still queued cancels it (its caller gets `timeout`). A free with the engine's timing
  // teaches its rank's learned rates first.
  bool MarkPrefill(const std::string& request_id, Outbox& out);
  // A disaggregated request's prefill leg ended (section 13 prefill_done): its prefill rank's
  // part is released.
  bool PrefillDone(const std::string& request_id, Outbox& out);
  bool Free(const std::string& request_id, Outbox& out, const std::optional<ResponseTiming>& timing = std::nullopt);

  // The registry has forgotten these workers (ascending ids): release their bookings and
  // predictions; queued requests pinned to them get `not_found`; the rest may now fit.
  void ForgetWorkers(std::span<const std::uint64_t> worker_ids, Outbox& out);
  // Forgets what was learned of the worker's speed (it is other hardware now); its bookings stay.
  void ForgetRates(std::uint64_t worker_id);
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
  // Also forgets an awaited resume marker (AwaitResume): the next reconnect sends its own.
  void PauseReplicas();
  // Releases every booking synced by a peer (frees sent meanwhile were lost), moves this router
  // to its next epoch (its own frees sent around the outage may be lost as well) and sends its
  // live bookings again at that epoch; un-pauses the peers.
  void ResumeReplicas(Outbox& out);
  // The same, deferred until resume marker `n` (> 0) comes back (ResumeOnMarker) or `deadline`
  // passes (ResumeIfOverdue). Each resumes at most once per marker, and not at all once a pause
  // came after the AwaitResume: a marker check and the resume are one step under the mutex.
  void AwaitResume(std::uint64_t n, SteadyTime deadline);
  bool ResumeOnMarker(std::uint64_t n, Outbox& out);  // false: not the awaited marker
  bool ResumeIfOverdue(Outbox& out);                  // false: nothing awaited, or not yet due
  // The connection that publishes this router's sync messages came back: some sent around the
  // outage may be lost. Moves to the next epoch and sends the live bookings again.
  void NextEpoch(Outbox& out);
  // This router's epoch (RouterHeartbeat::epoch, see ReplicaSync::epoch).
  std::uint32_t epoch() const;

  // Fills, for the ranks already in reply.workers, their load, routed count and (approximate
  // mode) predicted blocks; and the routing counters and breakdowns.
  void FillStats(StatsReply& reply) const;
  // Requests routed to the worker (any rank) since it became known.
  std::uint64_t RoutedToWorker(std::uint64_t worker_id) const;
  // The prompt's overlap per rank (overlap_scores), whatever the router mode: from the event
  // index, or approximate mode's predictions (nothing without either). Returns the prompt's
  // blocks; InvalidArgument for a prompt a route would refuse.
  Result<std::uint32_t> Overlaps(const RouteRequest& prompt, OverlapScores& out) const;

 private:
  // The ranks `req` may go to as candidates (overlaps reordered); `no_workers` when none.
  Result<std::vector<Candidate>> CandidatesLocked(const RouteRequest& req, std::span<const SequenceHash> seq,
                                                  OverlapScores& overlaps) const KV_REQUIRES(mu_);
  // What a request may be decided among now: the open candidates (for best_worker, all of
  // them), or the one PickFromFleet chose when the request needs no full scan (no filter, no
  // session binding; then DecideLocked draws nothing more); `best_overlap` of every candidate,
  // for a request that waits in the queue.
  struct Eligible {
    std::vector<Candidate> open;
    std::uint64_t best_overlap = 0;
  };
  // `matches`: the index's runs (IndexRuns), read for a request ServedByFleetPick decides; else null
  // and `overlaps` read.
  Result<Eligible> EligibleLocked(Kind kind, const RouteRequest& req, const PreparedRequest& p,
                                  const IndexMatches* matches, OverlapScores& overlaps) KV_REQUIRES(mu_);
  // Whether the request is decided among every registered rank (Scheduler::PickFromFleet): no
  // filter, no session to follow, mode kv at temperature 0. Reads no state: callable unlocked.
  bool ServedByFleetPick(const RouteRequest& req, const PreparedRequest& p) const;
  // Select among `cands` (the session's bound rank when it is one of them and not full), book,
  // bind the session, sync, count, observe.
  Result<RouteReply> DecideLocked(Kind kind, const RouteRequest& req, const PreparedRequest& p,
                                  std::span<const Candidate> cands, double queued_ms) KV_REQUIRES(mu_);
  // A request whose candidates have a prefill and a decode pool (section 13): decided (both
  // ranks, or one as a whole when the policy or the fallback says so), nullopt when it must
  // wait for room (its decode ranks are full, or its prefill ranks and there is no fallback), or
  // an error. `best_overlap`, when given, gets the longest overlap of any candidate.
  Result<std::optional<RouteReply>> DisaggLocked(Kind kind, const RouteRequest& req, const PreparedRequest& p,
                                                 const RankPools& pools, OverlapScores& overlaps, double queued_ms,
                                                 std::uint64_t* best_overlap) KV_REQUIRES(mu_);
  // The pools of a request when it is disaggregated-eligible; nullopt when it is not (no prefill
  // worker registered, or none among its candidates).
  Result<std::optional<RankPools>> EligiblePoolsLocked(const RouteRequest& req) const KV_REQUIRES(mu_);
  // A decision made (a Decide or DecideDisagg): binds the session, syncs, counts and observes,
  // and answers. `prefill` is the prefill rank of a disaggregated one.
  RouteReply AnswerLocked(Kind kind, const RouteRequest& req, const PreparedRequest& p, const Decision& d,
                          const Decision* prefill, double queued_ms) KV_REQUIRES(mu_);
  // A decided request: its reply, or for router.generate its forward.
  static void Deliver(RouteRequest req, const RouteReply& routed, std::string reply, Kind kind, Outbox& out);
  // Admits, in policy order, the queued requests that fit now.
  void DrainLocked(Outbox& out) KV_REQUIRES(mu_);
  bool LifecycleLocked(const std::string& request_id, ActiveSequenceEvent::Kind change, Outbox& out) KV_REQUIRES(mu_);
  // A heartbeat or sync message says `router_id` is at `epoch`: see ReplicaHeartbeat.
  void PeerEpochLocked(std::uint64_t router_id, std::uint32_t epoch, Outbox& out) KV_REQUIRES(mu_);
  // Why a peer's `add` is refused here (its counter key), or nullptr; `detail` says more.
  const char* RefusalLocked(const ActiveSequenceEvent& e, std::string& detail) const KV_REQUIRES(mu_);
  // Moves the gauges and sync messages gathered under mu_ into `out`.
  void TakeDeferredLocked(Outbox& out) KV_REQUIRES(mu_);

  const RouterConfig& config_;
  const SchedulerOptions options_;  // read without the mutex (PrepareRequest, IndexOverlaps)
  const WorkerRegistry& registry_;
  const ShardedIndex& index_;
  const Clock clock_;
  const std::uint64_t router_id_;
  RateLimitedLog& log_;
  DecisionObserver observer_;  // set before the first request, then only read

  mutable KvMutex mu_;
  Scheduler scheduler_ KV_GUARDED_BY(mu_);
  AdmissionQueue queue_ KV_GUARDED_BY(mu_);
  ReplicaSync sync_ KV_GUARDED_BY(mu_);
  SessionAffinity affinity_ KV_GUARDED_BY(mu_);
  const bool sessions_on_;  // affinity_.on(), for ServedByFleetPick without the mutex
  // How many of the next picks among every rank read scores before the mutex, rather than runs
  // they would translate under it: the full scan needs scores (for at least the next pick, which
  // looks again), and runs refused (Scheduler::FleetChoice::runs_refused) are tried again after
  // kScoresAfterRefusal picks. A stale count costs time (a translation under the mutex, or ranks
  // visited one by one where crowds would have been counted), never a choice.
  static constexpr std::uint32_t kScoresAfterRefusal = 64;
  std::atomic<std::uint32_t> score_picks_left_{0};
  RouteCounters counters_ KV_GUARDED_BY(mu_);
  std::uint64_t session_hits_ KV_GUARDED_BY(mu_) = 0;        // decisions that followed a session's binding
  // route decisions of eligible requests: "disaggregated", "local", "fallback" (section 13)
  std::map<std::string, std::uint64_t> disagg_decisions_ KV_GUARDED_BY(mu_);
  std::mt19937_64 rooms_ KV_GUARDED_BY(mu_);  // SGLang bootstrap rooms
  std::uint64_t generated_ids_ KV_GUARDED_BY(mu_) = 0;       // request ids made up for generate
  std::vector<WorkerKey> metrics_dirty_ KV_GUARDED_BY(mu_);  // loads to publish
  std::uint64_t resume_marker_ KV_GUARDED_BY(mu_) = 0;       // awaited (AwaitResume); 0: none
  SteadyTime resume_deadline_ KV_GUARDED_BY(mu_){};
  void ResumeReplicasLocked(Outbox& out) KV_REQUIRES(mu_);
};

}  // namespace kvrouter
