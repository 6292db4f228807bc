// KvRouterService: the kvrouter service of docs/protocol.md on a MessageBus: KV events (sections 2,
// 3), registrations (4), the router endpoints (5), recovery asks to workers (6), generate forwarded
// to workers (7), replica sync, heartbeats and kv_metrics (8), the metrics it observes (10), the
// gateway's keys (11), and tiers, overlap_scores and peer dumps (12). Subjects: events/subjects.h.
// It decodes what arrives and wires the parts that act on it:
//   KV events (both formats) -> WorkerRegistry admission -> ShardedIndex (shard threads apply);
//   registrations            -> WorkerRegistry (leases, bounds) -> Routing (forget, drain);
//   route / best_worker / generate -> Routing (candidates, selection, booking, queue)
//                                  -> reply, or GenerateRelay (forward, relay, lifecycle);
//   mark_prefill / free / replica sync -> Routing;  stats -> BuildStats;
//   overlap_scores -> the index;  dump -> DumpServer;  warm-up -> PeerWarmup.
// Thread contract: bus handlers run on the bus's delivery threads (one per subscription on
// NATS), concurrently. The event path takes no routing lock (only the registry's reader lock
// for a known worker rank, and the drop counters' own lock when it drops). Replies are
// published after every lock is released. Tick() runs on main's 50 ms timer thread, or a test's.
// With --router-replica-sync the resume after an outage runs where its marker is met: the sync
// subscription's thread, Tick's (after kResumeMarkerWait) or the reconnect callback's (the marker
// not sent); Routing makes the marker's check and the resume one step.
// Ownership: borrows the bus, which must outlive the service; owns everything else.
//
//   KvRouterService svc(config, bus);  if (auto s = svc.Start(); !s.ok()) ...;  svc.Tick();
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "events/registration_codec.h"
#include "events/router_endpoints_codec.h"
#include "events/subjects.h"
#include "router/service/config.h"
#include "router/service/dump_server.h"
#include "router/service/generate_relay.h"
#include "router/service/outbox.h"
#include "router/service/peer_warmup.h"
#include "router/service/recovery_client.h"
#include "router/service/router_stats.h"
#include "router/common/metrics.h"
#include "router/service/routing.h"
#include "router/index/sharded_index.h"
#include "router/service/worker_registry.h"
#include "events/base/log.h"
#include "transport/message_bus.h"

namespace kvrouter {

class KvRouterService {
 public:
  using Clock = Routing::Clock;

  // `bus` carries the request path (route, best_worker, generate and its relay, lifecycle,
  // stats) and every reply; `event_bus` (the same bus when null) carries KV events,
  // registrations and replica sync, so that no event flood sits in front of a request.
  KvRouterService(RouterConfig config, MessageBus& bus, Clock clock = nullptr,
                  std::uint64_t seed = std::random_device{}(), MessageBus* event_bus = nullptr);
  ~KvRouterService();
  KvRouterService(const KvRouterService&) = delete;
  KvRouterService& operator=(const KvRouterService&) = delete;

  // Subscribes to every subject. Fails (and subscribes to nothing) when the bus refuses a
  // subscription.
  Status Start();
  // Unsubscribes; no handler runs after it returns.
  void Stop();
  // Lease expiry, generate timeouts, the booking sweep and queue timeouts, at the clock's now.
  void Tick();
  // The event connection went down / came back (main's NATS callbacks): leases pause while
  // the router cannot hear its workers, and each gets one full lease after.
  void OnEventsDisconnected();
  // With --router-replica-sync the peers' bookings are released (and the next epoch announced)
  // only after every sync message received before the outage is applied: an `add` still queued
  // then could outlive its `free`, lost in the outage. The replica publishes a marker to itself
  // on the sync subject (docs/protocol.md section 8) and resumes when it comes back, or after
  // kResumeMarkerWait.
  void OnEventsReconnected();
  static constexpr std::chrono::seconds kResumeMarkerWait{5};
  // A registered worker routed requests but with no KV event this long after its registration,
  // while the router reads events, is silent: routed blind (logged once, counted, in stats).
  static constexpr std::chrono::seconds kSilentAfter{30};
  // The event connection dropped messages (slow consumer): recover every worker.
  void OnEventsDropped();

  // /metrics (docs/protocol.md section 10): the observed histograms and every counter and rank.
  std::string MetricsText() const;
  // /ready: started, the event connection up, the warm-up from a peer over (--router-replica-sync),
  // and the start-up dumps done (or given up on).
  bool Ready() const;
  // main's NATS callbacks: a connection ("requests", "events") came back.
  void CountReconnect(std::string_view connection) { metrics_.CountReconnect(connection); }
  // The request connection (which publishes replica sync) came back: with --router-replica-sync,
  // the next epoch and this router's live bookings again (sync messages sent around the outage
  // may be lost).
  void OnRequestsReconnected();

  const Subjects& subjects() const { return subjects_; }
  ShardedIndex& index() { return index_; }

 private:
  struct Sub {
    std::string subject;
    std::string group;  // empty: every replica gets every message
    MessageBus::Handler handler;
  };
  std::vector<Sub> EventSubscriptions();    // on the event bus
  std::vector<Sub> RequestSubscriptions();  // on the request bus
  std::vector<Sub> DumpSubscriptions();     // router.dump, on the event bus (late when warming)
  // Subscribes each (its handler guarded: nothing escapes); on a failure none stays subscribed
  // (all_or_nothing), or those made before stay.
  Status Subscribe(MessageBus& bus, std::vector<Sub> subs, bool all_or_nothing = true);
  void HandleKvEvent(const BusMessage& m);
  void HandleVllmEvent(const BusMessage& m);
  // The thread delivering events runs as ingestion (ShardedIndex::MarkIngestThread) and is
  // named for `top -H` and `perf` (at most 15 characters).
  static void MarkEventThread(const char* name);
  // The message's batch when it decodes and the registry admits it (else counted and logged).
  std::optional<KvEventBatch> AdmittedKvEvent(const BusMessage& m);
  std::optional<KvEventBatch> AdmittedVllmEvent(const BusMessage& m);
  // Hands an admitted batch to the index. While the transport says more messages of the same
  // subscription are queued, batches gather in `bulk` (touched only by that subscription's
  // delivery thread) and go on together: one queue hand-off and at most one shard wake-up per
  // bulk instead of per message. The last queued message flushes it.
  void HandOver(std::optional<KvEventBatch> batch, bool more_pending, std::vector<KvEventBatch>& bulk);
  void HandleInstances(const BusMessage& m);
  void HandleRoute(const BusMessage& m, Routing::Kind kind);
  enum class Lifecycle { kMarkPrefill, kPrefillDone, kFree };
  void HandleLifecycle(const BusMessage& m, Lifecycle change);
  void HandleStats(const BusMessage& m);
  void HandleOverlapScores(const BusMessage& m);
  // The warm-up from a peer ended: the asks its dump answered are dropped, the rest are made.
  void FinishWarmup();
  // One page of the stats reply, with the recovery counters.
  StatsReply Stats(const StatsRequest& page) const;
  void HandleReplicaSync(const BusMessage& m);
  // After Routing resumed the replicas (OnEventsReconnected's second half): the new epoch's
  // heartbeat, then what the resume sends.
  void FinishResume(Outbox& out);
  void HandleReplicaHeartbeat(const BusMessage& m);
  // Admission of an event by the registry; a refused one is counted and logged (false).
  bool AdmitEvent(std::uint64_t worker_id, std::uint32_t dp_rank);
  void DropUndecodable(std::string_view reason, const BusMessage& m, const Status& why);
  // The most blocks one rank of this worker may have indexed.
  std::uint64_t CapacityOf(const WorkerRegistration& reg) const;
  // Asks for a tree dump of every rank the registry knows (reconnect, dropped events).
  void DumpEveryWorker();
  // The registry forgot these workers (ascending): drop them from the index and the routing.
  void Forget(std::span<const std::uint64_t> worker_ids, Outbox& out);
  // Publishes everything in `out` (and what forwarding it leads to).
  void Send(Outbox& out);
  // Replies `body`, or an `internal` error when it exceeds the bus's max payload.
  void Reply(const BusMessage& m, const msgpack::sbuffer& body);
  void ReplyError(const BusMessage& m, const Status& s);
  void PublishMetrics(WorkerKey worker, const WorkerLoad& load);
  // This replica's heartbeat, at its current epoch (Tick, and at once after a reconnect).
  void SendHeartbeat();

  const RouterConfig config_;
  MessageBus& bus_;
  MessageBus& event_bus_;
  const Clock clock_;
  const Subjects subjects_;
  const std::uint64_t router_id_;  // tells this replica's sync messages from the others'
  // `free`s that carried a gateway's timing of the engine (docs/protocol.md section 11).
  std::atomic<std::uint64_t> timing_reports_{0};
  RateLimitedLog log_;
  // Declared before the index: shard threads call it until the index is destroyed. Null when
  // recovery is off or there are no KV events.
  std::unique_ptr<RecoveryClient> recovery_;
  ShardedIndex index_;
  // With --router-replica-sync (and recovery): fills the index from a peer first. Null otherwise.
  std::unique_ptr<PeerWarmup> warmup_;
  std::atomic<bool> warm_{true};  // the warm-up is over (or there is none)
  std::mutex warm_mu_;            // routes wait on warm_cv_ for warm_ (bounded by startup_deadline_)
  std::condition_variable warm_cv_;
  DumpServer dumps_;  // router.dump, served while warm_
  // HandOver's bulks, one per event subscription (each only on its delivery thread).
  std::vector<KvEventBatch> kv_bulk_;
  std::vector<KvEventBatch> vllm_bulk_;
  WorkerRegistry registry_;
  DropCounters drops_;
  Routing routing_;
  GenerateRelay relay_;
  std::mutex subs_mu_;                                  // FinishWarmup subscribes on a delivery thread, Stop on another
  std::vector<std::unique_ptr<BusSubscription>> subs_;  // guarded by subs_mu_
  bool stopped_ = false;                                // guarded by subs_mu_
  RouterMetrics metrics_;
  std::atomic<bool> started_{false};
  std::atomic<bool> events_up_{true};
  SteadyTime next_heartbeat_{};  // Tick's thread only: when this replica next says it is alive
  SteadyTime next_silence_check_{};  // Tick's thread only
  // Resume markers sent after reconnects (OnEventsReconnected; Routing holds the awaited one):
  // the reconnect callback's thread only.
  std::uint64_t resume_markers_sent_ = 0;
  // "kvrouter-resume-<random>-": the markers' request ids, which no client's id is by chance.
  const std::string resume_prefix_;
  // Routes before it wait for in-flight start-up dumps (set again when a warm-up ends).
  std::atomic<SteadyTime> startup_deadline_{};
};

}  // namespace kvrouter
