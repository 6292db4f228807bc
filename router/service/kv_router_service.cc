#include "router/service/kv_router_service.h"

#include <fmt/format.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <limits>

#include "events/event_codec.h"
#include "events/msgpack_reader.h"
#include "events/overlap_scores_codec.h"
#include "events/vllm_codec.h"

namespace kvrouter {
namespace {

// 64 bits of this process's chance, mixed with the seed (random_device gives 32).
std::uint64_t RandomId(std::uint64_t seed) { return std::random_device{}() * 0x9E3779B97F4A7C15ULL ^ seed; }

// Parses "{worker_id}.{dp_rank}" at the end of a vLLM event subject.
bool ParseWorkerRank(std::string_view tail, std::uint64_t& worker, std::uint32_t& rank) {
  const auto dot = tail.find('.');
  if (dot == std::string_view::npos) return false;
  auto parse = [](std::string_view s, auto& out) {
    auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
    return ec == std::errc() && p == s.data() + s.size() && !s.empty();
  };
  return parse(tail.substr(0, dot), worker) && parse(tail.substr(dot + 1), rank);
}

}  // namespace

KvRouterService::KvRouterService(RouterConfig config, MessageBus& bus, Clock clock, std::uint64_t seed,
                                 MessageBus* event_bus)
    : config_(std::move(config)),
      bus_(bus),
      event_bus_(event_bus ? *event_bus : bus),
      clock_(clock ? std::move(clock) : Clock([] { return std::chrono::steady_clock::now(); })),
      subjects_(config_.ns, config_.component),
      router_id_(config_.router_id ? config_.router_id : RandomId(seed)),
      index_({.num_shards = config_.index_shards,
              .on_recovery =
                  config_.recovery && config_.use_kv_events
                      ? RecoveryNeeded([this](WorkerKey w, SequenceKind k, std::optional<std::uint64_t> start,
                                              std::uint64_t generation) { recovery_->Need(w, k, start, generation); })
                      : nullptr,
              .default_capacity = config_.max_worker_blocks,
              .apply_on_submit = ShardedIndex::ApplyOnSubmitPays(config_.index_shards)}),
      dumps_(index_, event_bus_, router_id_, log_, [this](const BusMessage& m, const Status& s) { ReplyError(m, s); }),
      registry_({.block_size = config_.block_size,
                 .max_dp_size = config_.max_dp_size,
                 .max_worker_ranks = config_.max_worker_ranks,
                 .max_workers = config_.max_workers}),
      routing_(config_, registry_, index_, clock_, router_id_, seed, log_),
      relay_(bus_, routing_, GenerateReplyPrefix(router_id_), clock_, log_),
      resume_prefix_(fmt::format("kvrouter-resume-{:016x}-", RandomId(seed))) {
  routing_.SetDecisionObserver([this](Routing::Kind, const RouteReply& r) { metrics_.ObserveDecision(r); });
  if (config_.recovery && config_.use_kv_events) {
    recovery_ = std::make_unique<RecoveryClient>(
        RecoveryClient::Options{
            .ns = config_.ns, .component = config_.component, .reply_prefix = RecoveryReplyPrefix(router_id_)},
        event_bus_, index_, clock_, log_);
  }
  if (recovery_ && config_.replica_sync) {
    recovery_->Pause();  // until the peer's dump has said which ranks it covers
    warm_ = false;
    warmup_ = std::make_unique<PeerWarmup>(
        PeerWarmup::Options{
            .dump_subject = subjects_.dump, .router_id = router_id_, .reply_prefix = WarmupReplyPrefix(router_id_)},
        event_bus_, index_, clock_, [this](WorkerKey k) { return AdmitEvent(k.worker_id, k.dp_rank); },
        [this] { FinishWarmup(); }, log_);
  }
}

KvRouterService::~KvRouterService() { Stop(); }

std::vector<KvRouterService::Sub> KvRouterService::EventSubscriptions() {
  std::vector<Sub> subs;
  if (config_.use_kv_events) {
    subs.push_back({subjects_.kv_events, "", [this](const BusMessage& m) { HandleKvEvent(m); }});
    subs.push_back({subjects_.vllm_events_prefix + "*.*", "", [this](const BusMessage& m) { HandleVllmEvent(m); }});
  }
  subs.push_back({subjects_.instances, "", [this](const BusMessage& m) { HandleInstances(m); }});
  if (recovery_) {  // replies to the recovery queries, which may be large: the event connection
    subs.push_back({recovery_->subject_pattern(), "", [this](const BusMessage& m) { recovery_->OnReply(m); }});
  }
  // A replica warming up serves router.dump only once it is warm (FinishWarmup): until then it is
  // no peer, and nobody else serving it answers a lone replica's ask with "no responders" at once.
  if (config_.use_kv_events && !warmup_) {
    for (Sub& d : DumpSubscriptions()) subs.push_back(std::move(d));
  }
  if (warmup_) subs.push_back({warmup_->subject_pattern(), "", [this](const BusMessage& m) { warmup_->OnReply(m); }});
  if (config_.replica_sync) {
    subs.push_back({subjects_.active_sequences, "", [this](const BusMessage& m) { HandleReplicaSync(m); }});
    subs.push_back({subjects_.router_heartbeats, "", [this](const BusMessage& m) { HandleReplicaHeartbeat(m); }});
  }
  return subs;
}

std::vector<KvRouterService::Sub> KvRouterService::DumpSubscriptions() {
  // Every replica hears router.dump (a page may be large: the event connection).
  auto serve = [this](const BusMessage& m) { dumps_.Serve(m, warm_.load() ? Warmth::kWarm : Warmth::kWarming); };
  return {{subjects_.dump, "", serve}, {ReplicaEndpointSubject(subjects_.dump, router_id_), "", serve}};
}

std::vector<KvRouterService::Sub> KvRouterService::RequestSubscriptions() {
  std::vector<Sub> subs;
  for (const RouteEndpoint& e : kRouteEndpoints) {
    subs.push_back({RouterEndpointSubject(config_.ns, e.name), "kvrouter",
                    [this, kind = e.kind](const BusMessage& m) { HandleRoute(m, kind); }});
  }
  subs.push_back({relay_.subject_pattern(), "", [this](const BusMessage& m) {
                    Outbox out;
                    relay_.OnResponse(m, out);
                    Send(out);
                  }});
  // Lifecycle messages go to every replica: each one's bookings must be released.
  subs.push_back(
      {subjects_.mark_prefill, "", [this](const BusMessage& m) { HandleLifecycle(m, Lifecycle::kMarkPrefill); }});
  subs.push_back(
      {subjects_.prefill_done, "", [this](const BusMessage& m) { HandleLifecycle(m, Lifecycle::kPrefillDone); }});
  subs.push_back({subjects_.free, "", [this](const BusMessage& m) { HandleLifecycle(m, Lifecycle::kFree); }});
  subs.push_back({subjects_.stats, "kvrouter", [this](const BusMessage& m) { HandleStats(m); }});
  subs.push_back({subjects_.overlap_scores, "kvrouter", [this](const BusMessage& m) { HandleOverlapScores(m); }});
  // This replica's own stats, whichever the queue group would pick.
  subs.push_back(
      {ReplicaEndpointSubject(subjects_.stats, router_id_), "", [this](const BusMessage& m) { HandleStats(m); }});
  return subs;
}

Status KvRouterService::Subscribe(MessageBus& bus, std::vector<Sub> subs, bool all_or_nothing) {
  for (auto& s : subs) {
    // Nothing may escape a handler: count it, log it, answer `internal` when a reply is expected.
    MessageBus::Handler guarded = [this, h = std::move(s.handler)](const BusMessage& m) {
      try {
        h(m);
      } catch (const std::exception& e) {
        drops_.Add("handler_exception");
        log_.Log(LogLevel::kError, "handler exception", "handler for {} failed: {}", m.subject, e.what());
        if (!m.reply.empty()) (void)bus_.Publish(m.reply, AsBytes(EncodeErrorReply(Internal(e.what()))));
      }
    };
    auto r = bus.Subscribe(s.subject, s.group, std::move(guarded));
    if (!r.ok()) {
      std::vector<std::unique_ptr<BusSubscription>> gone;
      if (all_or_nothing) {
        std::lock_guard g(subs_mu_);
        gone.swap(subs_);
      }
      return Status(r.status().code(), fmt::format("subscribe {}: {}", s.subject, r.status().message()));
    }
    std::lock_guard g(subs_mu_);
    if (stopped_) return Status(StatusCode::kInternal, "the service stopped");  // dropped unlocked by r's owner
    subs_.push_back(std::move(r).value());
  }
  return Status::Ok();
}

Status KvRouterService::Start() {
  // Event subscriptions first, and flushed, so that once the request path answers (stats is
  // how tests and operators see the router is up) no registration or event can be missed.
  if (Status s = Subscribe(event_bus_, EventSubscriptions()); !s.ok()) return s;
  if (Status f = event_bus_.Flush(std::chrono::seconds(5)); !f.ok()) {
    log_.Log(LogLevel::kWarning, "subscribe", "event subscriptions not confirmed by the server: {}", f.message());
  }
  startup_deadline_ = clock_() + std::chrono::milliseconds(config_.recovery_wait_ms);  // before any route
  Status s = Subscribe(bus_, RequestSubscriptions());
  started_ = s.ok();
  if (s.ok() && warmup_) warmup_->Start();
  return s;
}

void KvRouterService::FinishWarmup() {
  // Every part handed over is applied first, so that each ask a part answered is known (the
  // parts came from this thread, unless a timeout ended the warm-up long after the last one).
  index_.AwaitOwnSubmissions();
  const auto superseded = index_.TakeSuperseded();
  recovery_->Cancel(superseded);
  recovery_->Resume();
  startup_deadline_ = clock_() + std::chrono::milliseconds(config_.recovery_wait_ms);
  {
    std::lock_guard g(warm_mu_);
    warm_ = true;  // before the subscription: an ask that comes at once is answered
  }
  warm_cv_.notify_all();
  if (Status s = Subscribe(event_bus_, DumpSubscriptions(), /*all_or_nothing=*/false); !s.ok()) {
    log_.Log(LogLevel::kWarning, "subscribe", "this replica will not serve router.dump: {}", s.message());
  }
  const PeerWarmupCounters c = warmup_->counters();
  log_.Log(LogLevel::kInfo, "peer dump", "warm-up {}: {} ranks, {} blocks from replica {} in {:.0f} ms ({} pages)",
           c.complete ? "done" : "ended early", c.ranks, c.blocks, c.peer, c.ms, c.pages);
}

void KvRouterService::Stop() {
  started_ = false;
  std::vector<std::unique_ptr<BusSubscription>> gone;  // destroyed unlocked: a handler may be subscribing
  {
    std::lock_guard g(subs_mu_);
    stopped_ = true;
    gone.swap(subs_);
  }
}

void KvRouterService::DropUndecodable(std::string_view reason, const BusMessage& m, const Status& why) {
  drops_.Add(reason);
  log_.Log(LogLevel::kWarning, reason, "dropped an undecodable message on {}: {}", m.subject, why.message());
}

bool KvRouterService::AdmitEvent(std::uint64_t worker_id, std::uint32_t dp_rank) {
  const char* refused = registry_.AdmitEvent(worker_id, dp_rank, clock_);
  if (refused == nullptr) return true;
  drops_.Add(refused);
  log_.Log(LogLevel::kWarning, "event refused", "dropped an event of worker {} rank {}: {}", worker_id, dp_rank,
           refused);
  return false;
}

void KvRouterService::HandOver(std::optional<KvEventBatch> batch, bool more_pending, std::vector<KvEventBatch>& bulk) {
  constexpr std::size_t kMaxBulk = 256;
  auto refused = [&](std::uint64_t worker) {
    log_.Log(LogLevel::kWarning, "index queue full", "index queue full: dropped an event of worker {}", worker);
  };
  if (!more_pending && bulk.empty()) {  // nothing gathered (always so on the in-memory bus)
    if (!batch) return;
    const std::uint64_t worker = batch->worker_id;
    if (!index_.Submit(std::move(*batch))) refused(worker);
    return;
  }
  if (batch) bulk.push_back(std::move(*batch));
  if (more_pending && bulk.size() < kMaxBulk) return;
  thread_local std::vector<std::uint64_t> refused_workers;
  index_.SubmitAll(bulk, refused_workers);
  bulk.clear();
  for (std::uint64_t w : refused_workers) refused(w);
  refused_workers.clear();
}

void KvRouterService::HandleKvEvent(const BusMessage& m) {
  MarkEventThread("kv-events");
  HandOver(AdmittedKvEvent(m), m.more_pending, kv_bulk_);
}

void KvRouterService::HandleVllmEvent(const BusMessage& m) {
  MarkEventThread("vllm-events");
  HandOver(AdmittedVllmEvent(m), m.more_pending, vllm_bulk_);
}

void KvRouterService::MarkEventThread(const char* name) {
  // Once per thread: NATS delivers each subscription on a thread of its own, so this is the
  // event thread (on the in-memory bus, whichever thread published).
  thread_local const bool marked = [name] {
    // Never the main thread (the in-memory bus publishes from any): its name is the process's,
    // which ps and pgrep show.
    if (gettid() != getpid()) pthread_setname_np(pthread_self(), name);
    return ShardedIndex::MarkIngestThread();
  }();
  (void)marked;
}

std::optional<KvEventBatch> KvRouterService::AdmittedKvEvent(const BusMessage& m) {
  KvEventBatch batch = index_.Spare();  // its memory reused: no malloc per event
  if (Status s = DecodeDynamoEventInto(m.data, batch); !s.ok()) {
    DropUndecodable("decode_error", m, s);
    return std::nullopt;
  }
  if (!AdmitEvent(batch.worker_id, batch.dp_rank)) return std::nullopt;
  return batch;
}

std::optional<KvEventBatch> KvRouterService::AdmittedVllmEvent(const BusMessage& m) {
  VllmBatchContext ctx;
  ctx.block_size = config_.block_size;
  if (!m.subject.starts_with(subjects_.vllm_events_prefix) ||
      !ParseWorkerRank(m.subject.substr(subjects_.vllm_events_prefix.size()), ctx.worker_id, ctx.dp_rank)) {
    DropUndecodable("decode_error", m, InvalidArgument("malformed subject"));
    return std::nullopt;
  }
  if (auto seq = m.Header("Kv-Seq")) ctx.kv_seq = ParseKvSeqHeader(*seq);
  auto decoded = DecodeVllmBatch(m.data, ctx);
  if (!decoded.ok()) {
    DropUndecodable("decode_error", m, decoded.status());
    return std::nullopt;
  }
  if (decoded->block_size_mismatches > 0) {
    drops_.Add("block_size_mismatch", decoded->block_size_mismatches);
    log_.Log(LogLevel::kWarning, "vllm block size", "worker {}: stored blocks cut short (block size is {})",
             ctx.worker_id, config_.block_size);
  }
  if (!AdmitEvent(ctx.worker_id, ctx.dp_rank)) return std::nullopt;
  return std::move(decoded->batch);
}

void KvRouterService::HandleInstances(const BusMessage& m) {
  auto reg = DecodeWorkerRegistration(m.data);
  if (!reg.ok()) {
    registry_.CountInvalid();
    log_.Log(LogLevel::kWarning, "registration refused", "refused a registration (invalid): {}",
             reg.status().message());
    return;
  }
  Outbox out;
  const auto r = registry_.Register(*reg, clock_());
  switch (r.outcome) {
    case WorkerRegistry::Outcome::kRefused:
      log_.Log(LogLevel::kWarning, "registration refused", "refused a registration ({}): {}", r.reason, r.detail);
      return;
    case WorkerRegistry::Outcome::kLeaving: {
      log_.Log(LogLevel::kInfo, "worker left", "worker {} left (leaving): forgotten", reg->worker_id);
      const std::uint64_t gone[] = {reg->worker_id};
      Forget(gone, out);  // its queued pins get not_found now
      break;
    }
    case WorkerRegistry::Outcome::kUpdated:
      index_.SetCapacity(reg->worker_id, CapacityOf(*reg));
      if (r.device_changed) {  // other hardware behind the same id: what was learned is of the old
        log_.Log(LogLevel::kInfo, "worker device", "worker {} is now device '{}': its learned rates are forgotten",
                 reg->worker_id, reg->device.substr(0, 64));
        routing_.ForgetRates(reg->worker_id);
      }
      return;
    case WorkerRegistry::Outcome::kNew:
      log_.Log(LogLevel::kInfo, "worker registered",
               "worker {} registered: dp ranks [{}, {}), {} KV blocks, lease {} ms", reg->worker_id, reg->dp_start,
               std::uint64_t{reg->dp_start} + reg->dp_size, reg->total_kv_blocks, reg->lease_ms);
      index_.SetCapacity(reg->worker_id, CapacityOf(*reg));
      // First sight of a worker: what does it hold already (the router may have restarted)?
      if (recovery_) {
        for (std::uint64_t rank = reg->dp_start; rank < std::uint64_t{reg->dp_start} + reg->dp_size; ++rank) {
          index_.RequestDump({reg->worker_id, static_cast<std::uint32_t>(rank)}, SequenceKind::kEventId,
                             /*first_sight=*/true);
        }
      }
      routing_.Drain(out);  // new capacity
      break;
    case WorkerRegistry::Outcome::kRenewed: return;
  }
  Send(out);
}

std::uint64_t KvRouterService::CapacityOf(const WorkerRegistration& reg) const {
  // Twice what the worker says it can cache (an engine's index lags its cache a little), at most
  // the flag's bound, which is also the bound when it says nothing.
  // A worker cannot raise its own bound past the flag (nor wrap it around with 2 * 2^63).
  if (reg.total_kv_blocks == 0 || reg.total_kv_blocks > config_.max_worker_blocks / 2) return config_.max_worker_blocks;
  return 2 * reg.total_kv_blocks;
}

void KvRouterService::Forget(std::span<const std::uint64_t> worker_ids, Outbox& out) {
  for (std::uint64_t id : worker_ids) index_.RemoveWorker(id);
  routing_.ForgetWorkers(worker_ids, out);
}

void KvRouterService::Tick() {
  Outbox out;
  if (warmup_) warmup_->Tick();
  if (recovery_) recovery_->Tick();
  for (WorkerKey w : index_.TakeStaleWorkers()) {  // events dropped (queue full): ask for a dump
    if (recovery_ && registry_.HasRank(w)) index_.RequestDump(w);
  }
  const std::vector<std::uint64_t> expired = registry_.ExpireLeases(clock_());
  for (std::uint64_t id : expired) log_.Log(LogLevel::kInfo, "lease", "worker {} lease expired: forgotten", id);
  Forget(expired, out);
  relay_.Expire(out);
  routing_.Tick(out);
  Send(out);
  if (Outbox late; routing_.ResumeIfOverdue(late)) {
    log_.Log(LogLevel::kWarning, "resume marker", "the resume marker did not come back within {} s: resumed",
             kResumeMarkerWait.count());
    FinishResume(late);
  }
  if (config_.replica_sync && clock_() >= next_heartbeat_) {
    next_heartbeat_ = clock_() + ReplicaPeers::kInterval;
    SendHeartbeat();
  }
  // Only while events are read and heard: an outage silences every worker at once.
  if (config_.use_kv_events && events_up_ && clock_() >= next_silence_check_) {
    next_silence_check_ = clock_() + std::chrono::seconds(1);
    // Blind means routed to: an idle worker has no events to send.
    std::vector<std::uint64_t> silent = registry_.Unheard(clock_(), kSilentAfter);
    std::erase_if(silent, [&](std::uint64_t id) { return routing_.RoutedToWorker(id) == 0; });
    for (std::uint64_t id : registry_.SetSilent(silent)) {
      log_.Log(LogLevel::kWarning, "silent worker",
               "worker {} registered {} s ago and was routed requests, but has sent no KV event: it is routed blind. Likely: a Dynamo "
               "worker publishing its events on ZMQ (set DYN_EVENT_PLANE=nats), a vLLM engine without kvrelay, or "
               "another namespace or component (docs/operations.md \"Silent workers\")",
               id, kSilentAfter.count());
    }
  }
}

void KvRouterService::SendHeartbeat() {
  const RouterHeartbeat h{.router_id = router_id_,
                          .interval_ms = static_cast<std::uint32_t>(ReplicaPeers::kInterval.count()),
                          .epoch = routing_.epoch()};
  (void)bus_.Publish(subjects_.router_heartbeats, AsBytes(EncodeRouterHeartbeat(h)));
}

void KvRouterService::OnEventsDisconnected() {
  events_up_ = false;
  registry_.PauseLeases();
  routing_.PauseReplicas();
  log_.Log(LogLevel::kWarning, "leases paused", "lost the event connection: leases paused until it is back");
}

void KvRouterService::OnEventsReconnected() {
  events_up_ = true;
  registry_.ResumeLeases(clock_());
  log_.Log(LogLevel::kInfo, "leases resumed", "event connection back: every worker has one full lease to be heard");
  DumpEveryWorker();  // events sent during the outage are lost
  Outbox out;
  if (!config_.replica_sync) {
    routing_.ResumeReplicas(out);
    return FinishResume(out);
  }
  // The sync subscription may still hold messages received before the outage: the marker,
  // published on the same connection after it subscribed again, comes back behind them.
  const std::uint64_t n = ++resume_markers_sent_;
  routing_.AwaitResume(n, clock_() + kResumeMarkerWait);
  const ActiveSequenceEvent marker{.router_id = router_id_,
                                   .request_id = fmt::format("{}{}", resume_prefix_, n),
                                   .kind = ActiveSequenceEvent::Kind::kFree,
                                   .epoch = routing_.epoch()};
  if (Status s = event_bus_.Publish(subjects_.active_sequences, AsBytes(EncodeActiveSequenceEvent(marker))); !s.ok()) {
    log_.Log(LogLevel::kWarning, "resume marker", "could not send the resume marker ({}): resuming now", s.message());
    if (routing_.ResumeOnMarker(n, out)) FinishResume(out);
  }
}

void KvRouterService::FinishResume(Outbox& out) {
  if (config_.replica_sync) SendHeartbeat();  // the new epoch, before our bookings come again
  Send(out);
}

void KvRouterService::OnRequestsReconnected() {
  if (!config_.replica_sync) return;
  Outbox out;
  routing_.NextEpoch(out);
  SendHeartbeat();  // the new epoch, before our bookings come again
  Send(out);
}

void KvRouterService::OnEventsDropped() {
  drops_.Add("slow_consumer");
  DumpEveryWorker();  // which workers' events were dropped is unknown
}

void KvRouterService::DumpEveryWorker() {
  if (!recovery_) return;
  std::uint64_t total = 0;
  for (std::uint64_t offset = 0;; offset += StatsRequest::kMaxLimit) {
    const std::vector<RankEntry> page = registry_.Page(offset, StatsRequest::kMaxLimit, &total);
    for (const RankEntry& e : page) index_.RequestDump(e.worker);
    if (page.size() < StatsRequest::kMaxLimit) break;
  }
}

void KvRouterService::HandleRoute(const BusMessage& m, Routing::Kind kind) {
  // Real time, whatever clock_ is; observed however the request ends.
  struct Timed {
    RouterMetrics& metrics;
    Routing::Kind kind;
    SteadyTime arrived = std::chrono::steady_clock::now();
    ~Timed() {
      metrics.ObserveRoute(Routing::KindName(kind),
                           std::chrono::duration<double>(std::chrono::steady_clock::now() - arrived).count());
    }
  } timed{metrics_, kind};
  // Just after start, a route waits (a little) for the workers' dumps: a restarted router should
  // not route blind. best_worker answers as things stand.
  if (recovery_ && kind != Routing::Kind::kBestWorker) {
    if (!warm_.load()) {  // a replica warming from a peer: its index is not the fleet's yet
      const SteadyTime now = clock_();
      const SteadyTime deadline = startup_deadline_.load();
      std::unique_lock g(warm_mu_);
      if (now < deadline) {
        warm_cv_.wait_for(g, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now),
                          [&] { return warm_.load(); });
      }
    }
    const SteadyTime now = clock_();
    if (const SteadyTime deadline = startup_deadline_.load(); now < deadline) {
      (void)recovery_->AwaitIdle(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now));
    }
  }
  auto req = DecodeRouteRequest(m.data);
  if (!req.ok()) {
    routing_.CountError(kind, req.status().code());
    ReplyError(m, req.status());
    return;
  }
  Outbox out;
  routing_.Route(std::move(req).value(), kind, std::string(m.reply), out);
  Send(out);
}

void KvRouterService::HandleLifecycle(const BusMessage& m, Lifecycle change) {
  auto id = DecodeLifecycleRequest(m.data);
  if (!id.ok()) {
    ReplyError(m, id.status());
    return;
  }
  std::optional<ResponseTiming> timing;
  if (change == Lifecycle::kFree) timing = DecodeResponseTiming(m.data);
  if (timing) ++timing_reports_;
  Outbox out;
  switch (change) {
    case Lifecycle::kMarkPrefill: (void)routing_.MarkPrefill(*id, out); break;
    case Lifecycle::kPrefillDone: (void)routing_.PrefillDone(*id, out); break;
    case Lifecycle::kFree: (void)routing_.Free(*id, out, timing); break;
  }
  Reply(m, EncodeOkReply());
  Send(out);
}

void KvRouterService::HandleOverlapScores(const BusMessage& m) {
  auto req = DecodeOverlapScoresRequest(m.data);
  if (!req.ok()) {
    ReplyError(m, req.status());
    return;
  }
  OverlapScores overlaps;
  auto blocks = routing_.Overlaps(req->prompt, overlaps);
  if (!blocks.ok()) {
    ReplyError(m, blocks.status());
    return;
  }
  RankOverlaps by_rank(overlaps);
  OverlapScoresReply r;
  r.offset = req->offset;
  for (const RankEntry& e : registry_.Page(req->offset, req->limit, &r.workers_total)) {
    const TieredOverlap t = by_rank.At(e.worker);
    const std::uint32_t most = *blocks;
    r.scores.push_back({.worker_id = e.worker.worker_id,
                        .dp_rank = e.worker.dp_rank,
                        .overlap_blocks = std::min(t.device, most),
                        .overlap_by_tier = {.device = std::min(t.device, most),
                                            .host_pinned = std::min(t.host, most),
                                            .any_tier = std::min(t.any, most)}});
  }
  auto body = EncodeOverlapScoresReply(r, bus_.MaxPayload());
  if (!body.ok()) {
    ReplyError(m, body.status());
    return;
  }
  Reply(m, *body);
}

void KvRouterService::HandleStats(const BusMessage& m) {
  auto page = DecodeStatsRequest(m.data);
  if (!page.ok()) {
    ReplyError(m, page.status());
    return;
  }
  StatsReply r = Stats(*page);
  auto body = EncodeStatsReply(r, bus_.MaxPayload());
  if (!body.ok()) {
    ReplyError(m, body.status());
    return;
  }
  Reply(m, *body);
}

StatsReply KvRouterService::Stats(const StatsRequest& page) const {
  StatsReply r = BuildStats(page, registry_, routing_, index_, drops_);
  r.counters["router_id"] = router_id_;
  r.counters["timing_reports"] = timing_reports_.load();
  if (recovery_) {
    const RecoveryCounters c = recovery_->counters();
    r.counters["recoveries_started"] = c.started;
    r.counters["recoveries_succeeded"] = c.succeeded;
    r.counters["recoveries_restarted"] = c.restarted;
    r.counters["recoveries_failed"] = c.failed;
    r.counters["recovery_dumps"] = c.dumps;
    r.counters["recovery_parts"] = c.parts;
    r.counters["recoveries_in_flight"] = c.in_flight;
    r.counters["recoveries_waiting"] = c.waiting;
    r.counters["recoveries_backed_off"] = c.backed_off;
    r.counters["recovery_ms_total"] = static_cast<std::uint64_t>(c.total_ms);
    r.counters["recovery_ms_max"] = static_cast<std::uint64_t>(c.max_ms);
    r.counters["recoveries_cancelled"] = c.cancelled;
  }
  r.counters["dump_pages_served"] = dumps_.pages_served();
  if (warmup_) {
    const PeerWarmupCounters w = warmup_->counters();
    r.counters["warmup_done"] = w.done;
    r.counters["warmup_complete"] = w.complete;
    r.counters["warmup_peer"] = w.peer;
    r.counters["warmup_pages"] = w.pages;
    r.counters["warmup_ranks"] = w.ranks;
    r.counters["warmup_blocks"] = w.blocks;
    r.counters["warmup_bytes"] = w.bytes;
    r.counters["warmup_ms"] = static_cast<std::uint64_t>(w.ms);
  }
  return r;
}

std::string KvRouterService::MetricsText() const {
  // One page: the first kMaxRankSeries ranks (the counters cover every rank).
  static_assert(RouterMetrics::kMaxRankSeries <= StatsRequest::kMaxLimit);
  StatsReply all = Stats({.offset = 0, .limit = RouterMetrics::kMaxRankSeries});
  const bool approximate = !config_.use_kv_events && !config_.load_aware;
  return metrics_.Render(all, {.mode = std::string(RouterModeName(config_.mode)),
                               .kv_events = config_.use_kv_events,
                               .approximate = approximate,
                               .recovery = recovery_ != nullptr,
                               .replica_sync = config_.replica_sync});
}

bool KvRouterService::Ready() const {
  if (!started_.load() || !events_up_.load() || !warm_.load()) return false;
  return !recovery_ || clock_() >= startup_deadline_.load() || recovery_->AwaitIdle(std::chrono::milliseconds(0));
}

void KvRouterService::HandleReplicaSync(const BusMessage& m) {
  auto e = DecodeActiveSequenceEvent(m.data);
  if (!e.ok()) return DropUndecodable("replica_sync_decode_error", m, e.status());
  if (e->router_id == router_id_) {  // our own, already applied; or the marker after a reconnect
    std::uint64_t n = 0;
    const std::string_view id = e->request_id;
    Outbox out;
    if (e->kind == ActiveSequenceEvent::Kind::kFree && id.starts_with(resume_prefix_) &&
        std::from_chars(id.data() + resume_prefix_.size(), id.data() + id.size(), n).ec == std::errc() &&
        routing_.ResumeOnMarker(n, out)) {
      FinishResume(out);
    }
    return;
  }
  Outbox out;
  routing_.ApplyReplica(*e, out);
  Send(out);
}

void KvRouterService::HandleReplicaHeartbeat(const BusMessage& m) {
  auto h = DecodeRouterHeartbeat(m.data);
  if (!h.ok()) return DropUndecodable("replica_heartbeat_decode_error", m, h.status());
  if (h->router_id == router_id_) return;
  Outbox out;
  routing_.ReplicaHeartbeat(h->router_id, h->epoch, out);
  Send(out);
}

void KvRouterService::Send(Outbox& out) {
  // Forwarding can fail and release a booking, which may admit queued requests: loop until
  // nothing new is left to send.
  for (int round = 0; round < 1000; ++round) {
    Outbox more;
    for (auto& b : out.syncs) (void)bus_.Publish(subjects_.active_sequences, AsBytes(b));
    for (auto& f : out.forwards) {
      const std::string subject = WorkerGenerateSubject(subjects_.worker_generate_prefix, f.routed.worker_id);
      relay_.Forward(std::move(f), subject, more);
    }
    for (auto& [reply, body] : out.replies) {
      if (!reply.empty()) (void)bus_.Publish(reply, AsBytes(body));
    }
    for (auto& [reply, status] : out.errors) {
      if (!reply.empty()) (void)bus_.Publish(reply, AsBytes(EncodeErrorReply(status)));
    }
    for (auto& [worker, load] : out.metrics) PublishMetrics(worker, load);
    if (more.syncs.empty() && more.forwards.empty() && more.replies.empty() && more.errors.empty() &&
        more.metrics.empty()) {
      return;
    }
    out = std::move(more);
  }
}

void KvRouterService::Reply(const BusMessage& m, const msgpack::sbuffer& body) {
  if (m.reply.empty()) return;
  if (body.size() > bus_.MaxPayload()) {
    ReplyError(m, Internal(fmt::format("the reply needs {} bytes; the server's max payload is {}", body.size(),
                                       bus_.MaxPayload())));
    return;
  }
  if (Status s = bus_.Publish(m.reply, AsBytes(body)); !s.ok()) {
    log_.Log(LogLevel::kWarning, "reply", "reply to {} failed: {}", m.subject, s.message());
  }
}

void KvRouterService::ReplyError(const BusMessage& m, const Status& s) {
  log_.Log(LogLevel::kWarning, "error reply", "{} -> {}", m.subject, s.ToString());
  Reply(m, EncodeErrorReply(s));
}

void KvRouterService::PublishMetrics(WorkerKey worker, const WorkerLoad& load) {
  const KvMetrics m{.worker_id = worker.worker_id,
                    .dp_rank = worker.dp_rank,
                    .active_decode_blocks = load.active_blocks,
                    .active_prefill_tokens = load.active_prefill_tokens};
  (void)bus_.Publish(subjects_.kv_metrics, AsBytes(EncodeKvMetrics(m)));
}

}  // namespace kvrouter
