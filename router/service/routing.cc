#include "router/service/routing.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

namespace kvrouter {

Routing::Routing(const RouterConfig& config, const WorkerRegistry& registry, const ShardedIndex& index, Clock clock,
                 std::uint64_t router_id, std::uint64_t seed, RateLimitedLog& log)
    : config_(config),
      options_(SchedulerOptionsOf(config)),
      registry_(registry),
      index_(index),
      clock_(clock),
      router_id_(router_id),
      log_(log),
      scheduler_(options_, index, std::move(clock), seed),
      queue_(config.queue_policy, config.queue_max, config.max_active_blocks, config.block_size),
      sync_(config.replica_sync ? ReplicaSync::Mode::kOn : ReplicaSync::Mode::kOff, router_id),
      affinity_(std::chrono::milliseconds(static_cast<std::int64_t>(config.session_affinity_ttl_secs * 1000)),
                config.max_sessions),
      sessions_on_(affinity_.on()),
      rooms_(seed ^ 0x5b0075'7a9e11ULL) {}

Result<std::vector<Candidate>> Routing::CandidatesLocked(const RouteRequest& req, std::span<const SequenceHash> seq,
                                                         OverlapScores& overlaps) const {
  if (!req.worker_id && !req.dp_rank && !req.allowed_worker_ids && !req.excluded_worker_ids) {
    const auto all = registry_.AllRanks();  // shared, not copied
    if (all->empty()) return Status(StatusCode::kNoWorkers, "no registered worker can take this request");
    return scheduler_.Candidates(*all, seq, overlaps);
  }
  auto ranks = registry_.Ranks(req.worker_id, req.dp_rank, req.allowed_worker_ids, req.excluded_worker_ids);
  if (!ranks.ok()) return ranks.status();
  if (ranks->empty()) return Status(StatusCode::kNoWorkers, "no registered worker can take this request");
  return scheduler_.Candidates(*ranks, seq, overlaps);
}

bool Routing::ServedByFleetPick(const RouteRequest& req, const PreparedRequest& p) const {
  return !req.worker_id && !req.dp_rank && !req.allowed_worker_ids && !req.excluded_worker_ids &&
         !(sessions_on_ && !req.session_id.empty()) && registry_.prefill_workers() == 0 &&
         FleetPickServes(options_, p);
}

Result<Routing::Eligible> Routing::EligibleLocked(Kind kind, const RouteRequest& req, const PreparedRequest& p,
                                                  const IndexMatches* matches, OverlapScores& overlaps) {
  // best_worker answers as things stand; route and generate wait when every eligible rank is full.
  const auto full = kind == Kind::kBestWorker ? Scheduler::FullRanks::kIncluded : Scheduler::FullRanks::kExcluded;
  Eligible out;
  if (ServedByFleetPick(req, p)) {
    const auto all = registry_.AllRanks();  // shared, not copied
    if (all->empty()) return Status(StatusCode::kNoWorkers, "no registered worker can take this request");
    auto choice = matches ? scheduler_.PickFromFleet(all, p, *matches, overlaps, full)
                          : scheduler_.PickFromFleet(all, p, overlaps, full);
    const std::uint32_t scores = score_picks_left_.load(std::memory_order_relaxed);
    const std::uint32_t after = scores - std::min<std::uint32_t>(scores, 1);
    score_picks_left_.store(choice.full_scan      ? std::max<std::uint32_t>(1, after)
                            : choice.runs_refused ? kScoresAfterRefusal
                            : matches             ? 0
                                                  : after,
                            std::memory_order_relaxed);
    out.best_overlap = choice.best_overlap;
    if (choice.chosen) out.open.push_back(*choice.chosen);
    return out;
  }
  if (matches) {  // unreachable: Route read runs only where ServedByFleetPick holds, which it still does
    overlaps.clear();
    if (!index_.TranslateMatches(*matches, overlaps)) IndexOverlaps(options_, index_, p, overlaps);
  }
  auto cands = CandidatesLocked(req, p.seq, overlaps);
  if (!cands.ok()) return cands.status();
  for (const Candidate& c : *cands) out.best_overlap = std::max<std::uint64_t>(out.best_overlap, c.overlap_blocks);
  out.open = full == Scheduler::FullRanks::kExcluded ? scheduler_.OpenRanks(std::move(cands).value())
                                                     : std::move(cands).value();
  return out;
}

Result<RouteReply> Routing::DecideLocked(Kind kind, const RouteRequest& req, const PreparedRequest& p,
                                         std::span<const Candidate> cands, double queued_ms) {
  std::span<const Candidate> pick = cands;
  const bool session = affinity_.on() && !req.session_id.empty();
  if (session) {
    if (auto bound = affinity_.Find(req.session_id, clock_())) {
      auto it = std::find_if(cands.begin(), cands.end(), [&](const Candidate& c) { return c.worker == *bound; });
      // A binding yields when its rank is past the queue threshold (or no longer a candidate).
      if (it != cands.end() && !scheduler_.Full(*it)) {
        pick = {&*it, 1};
        ++session_hits_;
      }
    }
  }
  auto decided = scheduler_.Decide(req, p, pick);
  if (!decided.ok()) return decided.status();
  return AnswerLocked(kind, req, p, *decided, nullptr, queued_ms);
}

namespace {

// The host of an http(s) URL ("http://10.0.0.5:8000/v1" -> "10.0.0.5", "http://[::1]:80" -> "::1").
std::string_view HostOfUrl(std::string_view url) {
  if (const auto scheme = url.find("://"); scheme != std::string_view::npos) url.remove_prefix(scheme + 3);
  url = url.substr(0, url.find_first_of("/?#"));
  if (const auto at = url.rfind('@'); at != std::string_view::npos) url.remove_prefix(at + 1);
  if (url.starts_with('[')) return url.substr(1, url.find(']') - 1);
  return url.substr(0, url.find(':'));
}

std::uint32_t TokensOf(std::uint32_t blocks, std::uint32_t block_size) {
  return static_cast<std::uint32_t>(
      std::min<std::uint64_t>(std::uint64_t{blocks} * block_size, std::numeric_limits<std::uint32_t>::max()));
}

}  // namespace

RouteReply Routing::AnswerLocked(Kind kind, const RouteRequest& req, const PreparedRequest& p, const Decision& d,
                                 const Decision* prefill, double queued_ms) {
  const bool session = affinity_.on() && !req.session_id.empty();
  // best_worker reads a binding but never makes one.
  if (session && req.update_states) affinity_.Bind(req.session_id, d.worker, clock_());
  if (d.booked) {
    sync_.peers().Released(req.request_id);  // ours now: no dead replica's release may touch it
    // Queued under mu_ so replicas see bookings in this replica's order: the request's rank
    // first, then its prefill rank (section 8: an add naming another rank of a booked request
    // is its prefill part).
    sync_.Send(ActiveSequenceEvent::Kind::kAdd, req.request_id, d.worker, p.seq, p.sel.isl, d.overlap_blocks,
               session ? std::string_view(req.session_id) : std::string_view());
    metrics_dirty_.push_back(d.worker);
    if (prefill) {
      sync_.Send(ActiveSequenceEvent::Kind::kAdd, req.request_id, prefill->worker, {}, p.sel.isl,
                 prefill->overlap_blocks);
      metrics_dirty_.push_back(prefill->worker);
    }
  }
  counters_.Routed(config_.mode, req.update_states ? std::optional<WorkerKey>(d.worker) : std::nullopt,
                   p.sel.request_blocks, prefill ? prefill->overlap_blocks : d.overlap_blocks);
  counters_.Answered(kind, "ok");
  const std::uint32_t bs = config_.block_size;
  RouteReply reply{.worker_id = d.worker.worker_id,
                   .dp_rank = d.worker.dp_rank,
                   .overlap_blocks = d.overlap_blocks,
                   .overlap_by_tier = {.device = d.overlap_by_tier.device,
                                       .host_pinned = d.overlap_by_tier.host,
                                       .any_tier = d.overlap_by_tier.any},
                   .request_blocks = p.sel.request_blocks,
                   .cached_tokens = TokensOf(d.overlap_blocks, bs),
                   .queued_ms = queued_ms,
                   .http_url = registry_.HttpUrl(d.worker.worker_id)};
  if (prefill) {
    const WorkerFace face = registry_.FaceOf(prefill->worker.worker_id);
    reply.disaggregated = true;
    reply.prefill_worker_id = prefill->worker.worker_id;
    reply.prefill_dp_rank = prefill->worker.dp_rank;
    reply.prefill_http_url = face.http_url;
    reply.prefill_cached_tokens = TokensOf(prefill->overlap_blocks, bs);
    reply.cached_tokens = reply.prefill_cached_tokens;
    reply.kv_connector = std::string(KvConnectorName(face.kv_connector));
    if (face.kv_connector == KvConnector::kSglang) {
      reply.bootstrap_host = std::string(HostOfUrl(face.http_url));
      reply.bootstrap_port = face.bootstrap_port;
      // SGLang's data-parallel controller sends room r to rank r % dp_size: the chosen one.
      const std::uint64_t size = std::max<std::uint32_t>(face.dp_size, 1);
      const std::uint64_t offset = (prefill->worker.dp_rank - face.dp_start) % size;
      reply.bootstrap_room = (rooms_() >> 1) / size * size + offset;
    }
  }
  if (observer_) observer_(kind, reply);
  return reply;
}

Result<std::optional<RankPools>> Routing::EligiblePoolsLocked(const RouteRequest& req) const {
  if (registry_.prefill_workers() == 0) return std::optional<RankPools>();
  auto pools = registry_.Pools(req.worker_id, req.dp_rank, req.allowed_worker_ids, req.excluded_worker_ids);
  if (!pools.ok()) return pools.status();
  if (!pools->eligible()) return std::optional<RankPools>();
  return std::optional<RankPools>(std::move(pools).value());
}

Result<std::optional<RouteReply>> Routing::DisaggLocked(Kind kind, const RouteRequest& req, const PreparedRequest& p,
                                                        const RankPools& pools, OverlapScores& overlaps,
                                                        double queued_ms, std::uint64_t* best_overlap) {
  std::vector<Candidate> decode = scheduler_.Candidates(pools.decode, p.seq, overlaps);
  std::vector<Candidate> prefill = scheduler_.Candidates(pools.prefill, p.seq, overlaps);
  if (best_overlap) {
    for (const auto* cands : {&decode, &prefill}) {
      for (const Candidate& c : *cands) *best_overlap = std::max<std::uint64_t>(*best_overlap, c.overlap_blocks);
    }
  }
  // best_worker answers as things stand; route and generate wait for room.
  if (kind != Kind::kBestWorker) {
    decode = scheduler_.OpenRanks(std::move(decode));
    prefill = scheduler_.OpenRanks(std::move(prefill));
  }
  if (decode.empty()) return std::optional<RouteReply>();
  const bool counted = kind != Kind::kBestWorker;
  if (prefill.empty()) {  // every prefill worker is excluded, or full
    if (!options_.disagg.decode_fallback) {
      if (!pools.prefill.empty()) return std::optional<RouteReply>();  // wait for a prefill rank's room
      return Status(StatusCode::kNoWorkers,
                    "every prefill worker is excluded and --router-decode-fallback is false");
    }
    auto whole = DecideLocked(kind, req, p, decode, queued_ms);
    if (!whole.ok()) return whole.status();
    if (counted) ++disagg_decisions_["fallback"];
    return std::optional<RouteReply>(std::move(whole).value());
  }
  // router.generate forwards one leg: its requests prefill on their decode rank.
  auto decided = scheduler_.DecideDisagg(req, p, decode, prefill, kind == Kind::kGenerate);
  if (!decided.ok()) return decided.status();
  if (counted) ++disagg_decisions_[decided->prefill ? "disaggregated" : "local"];
  return std::optional<RouteReply>(
      AnswerLocked(kind, req, p, decided->decode, decided->prefill ? &*decided->prefill : nullptr, queued_ms));
}

void Routing::Deliver(RouteRequest req, const RouteReply& routed, std::string reply, Kind kind, Outbox& out) {
  if (kind == Kind::kGenerate) {
    out.forwards.push_back({std::move(req), routed, std::move(reply)});
  } else {
    out.replies.emplace_back(std::move(reply), EncodeRouteReply(routed));
  }
}

void Routing::Route(RouteRequest req, Kind kind, std::string reply, Outbox& out) {
  auto prepared = PrepareRequest(options_, req);
  if (prepared.ok() && kind == Kind::kGenerate && !req.has_token_ids) {
    prepared = InvalidArgument("router.generate needs token_ids (the worker must see the prompt)");
  }
  Status error = prepared.status();
  if (error.ok()) {
    if (kind == Kind::kBestWorker) req.update_states = false;
    if (kind == Kind::kGenerate) req.update_states = true;  // the router frees it itself
    // The event index has its own locks: read it before mu_ (as runs for a pick among every
    // rank, which counts crowds from translations it keeps; as scores where the full scan or a
    // filter will need one per rank). Predictions are under mu_.
    thread_local OverlapScores overlaps;  // kept: thousands of scores per route in a large fleet
    thread_local IndexMatches runs;
    // The crowds the scheduler kept at this thread's last decision: their runs come elided. (Any
    // router's in the process: stamps are unique in it, so another's elide nothing here.)
    thread_local std::vector<std::uint64_t> known_crowds;
    const bool by_runs = ServedByFleetPick(req, *prepared) && score_picks_left_.load(std::memory_order_relaxed) == 0 &&
                         IndexRuns(options_, index_, *prepared, runs, known_crowds);
    if (!by_runs) IndexOverlaps(options_, index_, *prepared, overlaps);
    KvMutexLock g(mu_);
    scheduler_.PriceSpread(*prepared);
    if (scheduler_.predictions()) scheduler_.PredictedOverlaps(*prepared, overlaps);
    if (kind == Kind::kGenerate && req.request_id.empty()) {
      req.request_id = fmt::format("gen-{:x}-{}", router_id_, ++generated_ids_);
    }
    auto pools = EligiblePoolsLocked(req);
    if (!pools.ok()) {
      error = pools.status();
    } else if (*pools) {
      if (by_runs) {  // a prefill worker registered since the read: the runs as overlaps
        overlaps.clear();
        if (!index_.TranslateMatches(runs, overlaps)) IndexOverlaps(options_, index_, *prepared, overlaps);
      }
      std::uint64_t best_overlap = 0;
      auto decided = DisaggLocked(kind, req, *prepared, **pools, overlaps, 0, &best_overlap);
      if (!decided.ok()) {
        error = decided.status();
      } else if (!*decided) {
        error = queue_.Push(std::move(req), std::move(prepared).value(), best_overlap, reply, kind, clock_());
      } else {
        Deliver(std::move(req), **decided, std::move(reply), kind, out);
      }
    } else if (auto eligible = EligibleLocked(kind, req, *prepared, by_runs ? &runs : nullptr, overlaps);
               !eligible.ok()) {
      error = eligible.status();
    } else {
      if (eligible->open.empty()) {
        error = queue_.Push(std::move(req), std::move(prepared).value(), eligible->best_overlap, reply, kind, clock_());
      } else if (auto decided = DecideLocked(kind, req, *prepared, eligible->open, 0); decided.ok()) {
        Deliver(std::move(req), *decided, std::move(reply), kind, out);
      } else {
        error = decided.status();
      }
    }
    counters_.Received(kind);
    TakeDeferredLocked(out);
    if (by_runs) scheduler_.CrowdStamps(known_crowds);
    if (!error.ok()) counters_.Failed(kind, error.code());
  } else {
    CountError(kind, error.code());
  }
  if (!error.ok()) out.errors.emplace_back(std::move(reply), error);
}

void Routing::CountError(Kind kind, StatusCode code) {
  KvMutexLock g(mu_);
  counters_.Received(kind);
  counters_.Failed(kind, code);
}

void Routing::Drain(Outbox& out) {
  KvMutexLock g(mu_);
  DrainLocked(out);
}

void Routing::DrainLocked(Outbox& out) {
  if (queue_.empty()) return;
  const SteadyTime now = clock_();
  std::optional<RouteReply> admitted;
  Status failed;
  queue_.Drain(
      [&](QueuedRoute& q, SteadyTime enqueued) {
        mu_.AssertHeld();  // called right here, under mu_
        const double queued_ms = std::chrono::duration<double, std::milli>(now - enqueued).count();
        auto pools = EligiblePoolsLocked(q.req);
        if (!pools.ok()) {
          failed = pools.status();
          return AdmissionQueue::Admission::kFailed;
        }
        if (*pools) {
          thread_local OverlapScores fresh;
          scheduler_.FreshOverlaps(q.prepared, fresh);
          auto decided = DisaggLocked(q.kind, q.req, q.prepared, **pools, fresh, queued_ms, nullptr);
          if (!decided.ok()) {
            failed = decided.status();
            return AdmissionQueue::Admission::kFailed;
          }
          if (!*decided) return AdmissionQueue::Admission::kNoRoom;
          admitted = **decided;
          return AdmissionQueue::Admission::kAdmitted;
        }
        OverlapScores none;
        auto cands = CandidatesLocked(q.req, q.prepared.seq, none);
        if (!cands.ok()) {  // its worker went away while it waited
          failed = cands.status();
          return AdmissionQueue::Admission::kFailed;
        }
        if (scheduler_.OpenRanks(*cands).empty()) return AdmissionQueue::Admission::kNoRoom;
        // Fresh overlaps for the ranks it may go to. The registry has its own lock: a worker may
        // have left since the first look, so the candidates are checked again.
        thread_local OverlapScores overlaps;
        scheduler_.FreshOverlaps(q.prepared, overlaps);
        auto with_overlaps = CandidatesLocked(q.req, q.prepared.seq, overlaps);
        if (!with_overlaps.ok()) {
          failed = with_overlaps.status();
          return AdmissionQueue::Admission::kFailed;
        }
        std::vector<Candidate> ready = scheduler_.OpenRanks(std::move(with_overlaps).value());
        if (ready.empty()) return AdmissionQueue::Admission::kNoRoom;
        auto reply = DecideLocked(q.kind, q.req, q.prepared, ready, queued_ms);
        if (!reply.ok()) {
          failed = reply.status();
          return AdmissionQueue::Admission::kFailed;
        }
        admitted = *reply;
        return AdmissionQueue::Admission::kAdmitted;
      },
      [&](QueuedRoute&& q) {
        mu_.AssertHeld();
        if (admitted) {
          Deliver(std::move(q.req), *admitted, std::move(q.reply), q.kind, out);
          admitted.reset();
        } else {
          counters_.Answered(q.kind, StatusCodeName(failed.code()));
          out.errors.emplace_back(std::move(q.reply), failed);
        }
      });
  TakeDeferredLocked(out);  // admissions changed loads
}

void Routing::TakeDeferredLocked(Outbox& out) {
  for (WorkerKey w : metrics_dirty_) out.metrics.emplace_back(w, scheduler_.load().Load(w));
  metrics_dirty_.clear();
  for (auto& b : sync_.TakeMessages()) out.syncs.push_back(std::move(b));
}

bool Routing::LifecycleLocked(const std::string& request_id, ActiveSequenceEvent::Kind change, Outbox& out) {
  ActiveLoad& load = scheduler_.load();
  const WorkerKey* w = load.WorkerOf(request_id);
  const WorkerKey worker = w ? *w : WorkerKey{};
  const WorkerKey* pw = load.PrefillWorkerOf(request_id);
  const std::optional<WorkerKey> prefill_worker = pw ? std::optional<WorkerKey>(*pw) : std::nullopt;
  const bool free = change == ActiveSequenceEvent::Kind::kFree;
  const bool did = free ? load.Free(request_id) : scheduler_.MarkPrefill(request_id);
  if (free) sync_.peers().Released(request_id);
  if (free && !did) {  // freed before it left the queue
    queue_.Cancel(request_id, [&](QueuedRoute&& q) {
      mu_.AssertHeld();
      counters_.Answered(q.kind, StatusCodeName(StatusCode::kTimeout));
      out.errors.emplace_back(std::move(q.reply), Status(StatusCode::kTimeout, "freed while queued"));
    });
  }
  if (did) {
    metrics_dirty_.push_back(worker);
    if (prefill_worker) metrics_dirty_.push_back(*prefill_worker);
    sync_.Send(change, request_id, worker);
    DrainLocked(out);  // load dropped: queued requests may fit now
  }
  TakeDeferredLocked(out);
  return did;
}

bool Routing::MarkPrefill(const std::string& request_id, Outbox& out) {
  KvMutexLock g(mu_);
  return LifecycleLocked(request_id, ActiveSequenceEvent::Kind::kPrefillDone, out);
}

bool Routing::PrefillDone(const std::string& request_id, Outbox& out) {
  KvMutexLock g(mu_);
  const WorkerKey* pw = scheduler_.load().PrefillWorkerOf(request_id);
  if (!pw) return false;
  const WorkerKey prefill_worker = *pw;
  (void)scheduler_.PrefillDone(request_id);
  metrics_dirty_.push_back(prefill_worker);
  // Section 8: a prefill_done naming the prefill rank releases only the prefill part.
  sync_.Send(ActiveSequenceEvent::Kind::kPrefillDone, request_id, prefill_worker);
  DrainLocked(out);
  TakeDeferredLocked(out);
  return true;
}

bool Routing::Free(const std::string& request_id, Outbox& out, const std::optional<ResponseTiming>& timing) {
  KvMutexLock g(mu_);
  if (timing) (void)scheduler_.Learn(request_id, *timing);
  return LifecycleLocked(request_id, ActiveSequenceEvent::Kind::kFree, out);
}

void Routing::ForgetRates(std::uint64_t worker_id) {
  KvMutexLock g(mu_);
  scheduler_.ForgetRates(worker_id);
}

void Routing::ForgetWorkers(std::span<const std::uint64_t> worker_ids, Outbox& out) {
  if (worker_ids.empty()) return;
  KvMutexLock g(mu_);
  for (std::uint64_t id : worker_ids) {
    scheduler_.ForgetWorker(id);
    counters_.ForgetWorker(id);
  }
  // Their bookings are gone: so are the entries naming the replicas that made them.
  const ActiveLoad& load = scheduler_.load();
  sync_.peers().Prune([&](const std::string& request) { return load.WorkerOf(request) == nullptr; });
  queue_.FailPinned(worker_ids, [&](QueuedRoute&& q) {
    mu_.AssertHeld();
    counters_.Answered(q.kind, StatusCodeName(StatusCode::kNotFound));
    out.errors.emplace_back(std::move(q.reply), NotFound(fmt::format("worker {} is gone", *q.req.worker_id)));
  });
  DrainLocked(out);
}

void Routing::Tick(Outbox& out) {
  const SteadyTime now = clock_();
  KvMutexLock g(mu_);
  ActiveLoad& load = scheduler_.load();
  sync_.Release(sync_.peers().TakeSilent(now), load, metrics_dirty_);
  if (load.Sweep(now) > 0) {
    sync_.peers().Prune([&](const std::string& id) { return load.WorkerOf(id) == nullptr; });
  }
  scheduler_.ExpirePredictions(now);
  scheduler_.DriftRates(now);
  affinity_.Expire(now);
  // The clock again: `now` was read before the mutex, and a deadline passed while waiting for
  // it must count.
  queue_.Expire(clock_(), [&](QueuedRoute&& q) {
    mu_.AssertHeld();
    counters_.Answered(q.kind, StatusCodeName(StatusCode::kTimeout));
    out.errors.emplace_back(std::move(q.reply), Status(StatusCode::kTimeout, "no worker had room before timeout_ms"));
  });
  DrainLocked(out);
}

Result<std::uint32_t> Routing::Overlaps(const RouteRequest& prompt, OverlapScores& out) const {
  SchedulerOptions kv = options_;
  kv.mode = RouterMode::kKv;  // the overlaps are asked for, whichever mode routes
  auto p = PrepareRequest(kv, prompt);
  if (!p.ok()) return p.status();
  {
    KvMutexLock g(mu_);
    if (const ApproxIndex* approx = scheduler_.predictions()) {
      out.clear();
      approx->FindMatches(p->seq, out);
      return p->sel.request_blocks;
    }
  }
  IndexOverlaps(kv, index_, *p, out);  // lock-free
  return p->sel.request_blocks;
}

std::uint64_t Routing::RoutedToWorker(std::uint64_t worker_id) const {
  KvMutexLock g(mu_);
  return counters_.RoutedToWorker(worker_id);
}

void Routing::FillStats(StatsReply& r) const {
  KvMutexLock g(mu_);
  const ActiveLoad& load = scheduler_.load();
  const ApproxIndex* approx = scheduler_.predictions();
  for (WorkerStats& w : r.workers) {
    const WorkerKey k{w.worker_id, w.dp_rank};
    const WorkerLoad l = load.Load(k);
    w.active_blocks = l.active_blocks;
    w.active_prefill_tokens = l.active_prefill_tokens;
    w.active_requests = l.active_requests;
    if (approx) w.blocks = approx->TreeSize(k);
    w.routed_requests = counters_.RoutedTo(k);
    const WorkerRates::Rates rate = scheduler_.rates().Of(k);
    w.prefill_tokens_per_second = PrefillTokensPerSecond(rate.prefill);
    w.decode_step_seconds = DecodeStepSeconds(rate.decode);
    w.rate_observations = rate.observations;
  }
  r.counters["rate_observations"] = scheduler_.rates().observations();
  r.counters["crowds_translated"] = scheduler_.crowds_translated();
  r.counters["crowds_reused"] = scheduler_.crowds_reused();
  r.counters["crowds_elided"] = scheduler_.crowds_elided();
  counters_.Fill(r);
  r.breakdowns["replica_sync_refused"] = sync_.refused();
  r.counters["replica_peers"] = sync_.peers().peers();
  r.counters["replica_peers_dead"] = sync_.peers().dead();
  r.counters["replica_bookings_released"] = sync_.released();
  r.counters["queue_length"] = queue_.size();
  r.counters["queue_blocks"] = queue_.blocks();
  r.counters["queue_admitted"] = queue_.admitted();
  r.counters["queue_timed_out"] = queue_.timed_out();
  r.counters["queue_refused"] = queue_.refused();
  r.counters["active_requests"] = load.requests();
  r.counters["active_booked_blocks"] = load.booked_blocks();
  r.counters["predicted_blocks"] = approx ? approx->size() : 0;
  r.counters["predictions_expired"] = approx ? approx->expired() : 0;
  r.counters["predictions_pruned"] = approx ? approx->pruned() : 0;
  r.counters["session_bindings"] = affinity_.size();
  r.counters["session_hits"] = session_hits_;
  r.counters["session_bindings_evicted"] = affinity_.evicted();
  if (!disagg_decisions_.empty()) r.breakdowns["disagg_decisions"] = disagg_decisions_;
  r.counters["active_prefill_legs"] = load.prefill_parts();
  r.counters["kv_transfers_observed"] = scheduler_.transfer().observations();
}

}  // namespace kvrouter
