#include "router/service/routing.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

namespace kvrouter {

Routing::Routing(const RouterConfig& config, const WorkerRegistry& registry, const ShardedIndex& index, Clock clock,
                 std::uint64_t router_id, std::uint64_t seed, RateLimitedLog& log)
    : config_(config),
      registry_(registry),
      index_(index),
      clock_(std::move(clock)),
      router_id_(router_id),
      log_(log),
      rng_(seed),
      queue_(config.queue_policy, config.queue_max, config.max_active_blocks),
      approx_(!config.use_kv_events && !config.load_aware
                  ? std::make_unique<ApproxIndex>(
                        std::chrono::milliseconds(static_cast<std::int64_t>(config.ttl_secs * 1000)),
                        config.max_tree_size, config.prune_target_ratio)
                  : nullptr) {}

Result<Routing::Prepared> Routing::Prepare(const RouteRequest& req) const {
  const std::uint32_t bs = config_.block_size;
  Prepared p;
  std::vector<LocalHash> local;
  std::uint32_t isl = req.isl;
  const std::uint64_t prompt = req.has_token_ids ? req.token_ids.size() : req.isl;
  if (prompt > config_.max_prompt_tokens) {
    return InvalidArgument(fmt::format("the prompt has {} tokens; the limit is {} (--router-max-prompt-tokens)",
                                       prompt, config_.max_prompt_tokens));
  }
  if (req.has_token_ids) {
    local = ComputeLocalHashes(req.token_ids, bs, req.lora_name);
    isl = static_cast<std::uint32_t>(req.token_ids.size());
  } else {
    if (req.block_hashes.size() > (std::uint64_t{isl} + bs - 1) / bs) {
      return InvalidArgument(fmt::format("{} block_hashes do not fit in isl {} at block size {}",
                                         req.block_hashes.size(), isl, bs));
    }
    local = req.block_hashes;
  }
  if (config_.mode == RouterMode::kDirect && !req.worker_id) {
    return InvalidArgument("router mode 'direct' needs worker_id in the request");
  }
  p.seq = ComputeSequenceHashes(local);
  p.local = std::move(local);
  p.sel = {isl, static_cast<std::uint32_t>((std::uint64_t{isl} + bs - 1) / bs)};
  p.params = {.model = config_.cost_model,
              .block_size = bs,
              .overlap_score_credit = config_.overlap_score_credit,
              .prefill_load_scale = config_.prefill_load_scale,
              .temperature = config_.temperature,
              .track_prefill_tokens = config_.track_prefill_tokens,
              .device_ratio = config_.device_ratio};
  const auto& o = req.config_override;
  // A request that sets Dynamo's weights gets Dynamo's formula with them.
  if (o.overlap_score_credit || o.prefill_load_scale) p.params.model = CostModel::kDynamo;
  if (o.overlap_score_credit) p.params.overlap_score_credit = *o.overlap_score_credit;
  if (o.prefill_load_scale) p.params.prefill_load_scale = *o.prefill_load_scale;
  if (o.router_temperature) p.params.temperature = *o.router_temperature;
  return p;
}

void Routing::IndexOverlaps(const Prepared& p, OverlapScores& out) const {
  out.clear();
  if (config_.mode != RouterMode::kKv || p.seq.empty() || approx_ || !config_.use_kv_events) return;
  index_.FindMatches(p.seq, out);
}

void Routing::PredictedOverlaps(const Prepared& p, OverlapScores& out) const {
  out.clear();
  if (config_.mode == RouterMode::kKv && approx_ && !p.seq.empty()) approx_->FindMatches(p.seq, out);
}

Result<std::vector<Candidate>> Routing::CandidatesLocked(const RouteRequest& req, std::span<const SequenceHash> seq,
                                                         OverlapScores& overlaps) const {
  auto ranks = registry_.Ranks(req.worker_id, req.dp_rank, req.allowed_worker_ids);
  if (!ranks.ok()) return ranks.status();
  if (ranks->empty()) return Status(StatusCode::kNoWorkers, "no registered worker can take this request");
  // Ranks come in ascending (worker_id, dp_rank) order: merge the overlaps in sorted too.
  std::sort(overlaps.begin(), overlaps.end(),
            [](const OverlapScore& a, const OverlapScore& b) { return a.worker < b.worker; });
  auto next = overlaps.begin();
  std::vector<Candidate> cands;
  cands.reserve(ranks->size());
  const double recent_scale = load_.RecentScale(clock_());
  for (const RankInfo& r : *ranks) {
    Candidate c;
    c.worker = r.worker;
    c.is_cpu = r.is_cpu;
    c.capacity = r.max_num_seqs;
    c.max_num_batched_tokens = r.max_num_batched_tokens;
    c.total_kv_blocks = r.total_kv_blocks;
    while (next != overlaps.end() && next->worker < c.worker) ++next;
    if (next != overlaps.end() && next->worker == c.worker) c.overlap_blocks = next->blocks;
    const WorkerLoad l = load_.Load(c.worker);
    c.active_blocks = l.active_blocks;
    c.active_prefill_tokens = l.active_prefill_tokens;
    c.active_prefill_squares = l.active_prefill_squares;
    c.active_requests = l.active_requests;
    c.recent_requests = l.recent_scaled * recent_scale;
    c.active_prefix_blocks = load_.ActivePrefix(c.worker, seq);
    cands.push_back(c);
  }
  return cands;
}

std::vector<Candidate> Routing::OpenRanks(std::vector<Candidate> cands) const {
  if (!config_.queue_threshold) return cands;
  // Full: active prefill tokens above threshold x max_num_batched_tokens (at it is not full).
  std::erase_if(cands, [&](const Candidate& c) {
    return static_cast<double>(c.active_prefill_tokens) > *config_.queue_threshold * c.max_num_batched_tokens;
  });
  return cands;
}

Status Routing::BookingRoomLocked(std::size_t blocks) const {
  if (load_.requests() >= config_.max_active_requests) {
    return Status(StatusCode::kOverloaded, fmt::format("{} requests are booked (--router-max-active-requests); free some",
                                                       load_.requests()));
  }
  if (blocks > config_.max_active_blocks - std::min(config_.max_active_blocks, load_.booked_blocks())) {
    return Status(StatusCode::kOverloaded, fmt::format("{} blocks are booked (--router-max-active-blocks); free some",
                                                       load_.booked_blocks()));
  }
  return Status::Ok();
}

std::string_view Routing::KindName(Kind k) {
  switch (k) {
    case Kind::kRoute: return "route";
    case Kind::kBestWorker: return "best_worker";
    case Kind::kGenerate: return "generate";
  }
  return "route";
}

void Routing::CountLocked(Kind kind, std::string_view result) {
  char key[64];
  const auto end = fmt::format_to_n(key, sizeof(key), "{}.{}", KindName(kind), result).out;
  BumpLocked({key, static_cast<std::size_t>(end - key)});
}

void Routing::BumpLocked(std::string_view key) {
  auto it = requests_.find(key);
  if (it == requests_.end()) it = requests_.emplace(std::string(key), 0).first;
  ++it->second;
}

Result<RouteReply> Routing::DecideLocked(Kind kind, const RouteRequest& req, const Prepared& p,
                                         std::span<const Candidate> cands, double queued_ms) {
  const std::uint32_t bs = config_.block_size;
  if (cands.empty()) return Status(StatusCode::kNoWorkers, "no registered worker can take this request");
  const Candidate& chosen = cands[selector_.Pick(config_.mode, p.sel, cands, p.params, rng_)];
  const std::uint32_t overlap = std::min(chosen.overlap_blocks, p.sel.request_blocks);
  if (req.update_states && !req.request_id.empty()) {
    if (Status full = BookingRoomLocked(p.seq.size()); !full.ok()) return full;
    const std::uint64_t cached = std::uint64_t{overlap} * bs;
    const std::uint64_t prefill = p.sel.isl > cached ? p.sel.isl - cached : 0;
    if (!load_.Book(req.request_id, chosen.worker, p.seq, prefill, clock_())) {
      return InvalidArgument(fmt::format("request_id '{}' is already booked; free it first", req.request_id));
    }
    peers_.Released(req.request_id);  // ours now: no dead replica's release may touch it
    // Queued under mu_ so replicas see bookings in this replica's order.
    if (config_.replica_sync) SyncLocked(ActiveSequenceEvent::Kind::kAdd, req.request_id, chosen.worker, p.seq, p.sel.isl, overlap);
    metrics_dirty_.push_back(chosen.worker);
    // Approximate mode: the chosen rank is about to hold this prompt's blocks.
    if (approx_) approx_->Record(chosen.worker, p.local, p.seq, clock_());
  }
  ++routed_[std::string(RouterModeName(config_.mode))];
  if (req.update_states) ++routed_to_[chosen.worker];
  CountLocked(kind, "ok");
  const RouteReply reply{.worker_id = chosen.worker.worker_id,
                         .dp_rank = chosen.worker.dp_rank,
                         .overlap_blocks = overlap,
                         .request_blocks = p.sel.request_blocks,
                         .cached_tokens = static_cast<std::uint32_t>(std::min<std::uint64_t>(
                             std::uint64_t{overlap} * bs, std::numeric_limits<std::uint32_t>::max())),
                         .queued_ms = queued_ms};
  if (observer_) observer_(kind, reply);
  return reply;
}

void Routing::DeliverLocked(RouteRequest req, const RouteReply& routed, std::string reply, bool generate,
                            Outbox& out) {
  if (generate) {
    out.forwards.push_back({std::move(req), routed, std::move(reply)});
  } else {
    out.replies.emplace_back(std::move(reply), EncodeRouteReply(routed));
  }
}

void Routing::Route(RouteRequest req, Kind kind, std::string reply, Outbox& out) {
  auto prepared = Prepare(req);
  if (prepared.ok() && kind == Kind::kGenerate && !req.has_token_ids) {
    prepared = InvalidArgument("router.generate needs token_ids (the worker must see the prompt)");
  }
  Status error = prepared.status();
  if (error.ok()) {
    if (kind == Kind::kBestWorker) req.update_states = false;
    if (kind == Kind::kGenerate) req.update_states = true;  // the router frees it itself
    // The event index has its own locks: read it before mu_. Predictions are under mu_.
    thread_local OverlapScores overlaps;  // kept: thousands of scores per route in a large fleet
    IndexOverlaps(*prepared, overlaps);
    KvMutexLock g(mu_);
    if (approx_) PredictedOverlaps(*prepared, overlaps);
    if (kind == Kind::kGenerate && req.request_id.empty()) {
      req.request_id = fmt::format("gen-{:x}-{}", router_id_, ++generated_ids_);
    }
    auto cands = CandidatesLocked(req, prepared->seq, overlaps);
    if (!cands.ok()) {
      error = cands.status();
    } else {
      // best_worker answers as things stand; route and generate wait when every eligible rank
      // is full.
      std::vector<Candidate> open = kind == Kind::kBestWorker ? std::move(cands).value() : OpenRanks(*cands);
      if (open.empty()) {
        error = EnqueueLocked(std::move(req), std::move(prepared).value(), *cands, reply, kind == Kind::kGenerate);
      } else if (auto decided = DecideLocked(kind, req, *prepared, open, 0); decided.ok()) {
        DeliverLocked(std::move(req), *decided, std::move(reply), kind == Kind::kGenerate, out);
      } else {
        error = decided.status();
      }
    }
    BumpLocked(KindName(kind));
    TakeDeferredLocked(out);
    if (!error.ok()) {
      ++route_errors_[std::string(StatusCodeName(error.code()))];
      CountLocked(kind, StatusCodeName(error.code()));
    }
  } else {
    CountError(kind, error.code());
  }
  if (!error.ok()) out.errors.emplace_back(std::move(reply), error);
}

void Routing::CountError(Kind kind, StatusCode code) {
  KvMutexLock g(mu_);
  BumpLocked(KindName(kind));
  ++route_errors_[std::string(StatusCodeName(code))];
  CountLocked(kind, StatusCodeName(code));
}

Status Routing::EnqueueLocked(RouteRequest req, Prepared prepared, std::span<const Candidate> all,
                              std::string_view reply, bool generate) {
  std::uint64_t best_overlap = 0;
  for (const Candidate& c : all) best_overlap = std::max<std::uint64_t>(best_overlap, c.overlap_blocks);
  const SteadyTime now = clock_();
  const auto wait = req.timeout_ms ? std::chrono::milliseconds(*req.timeout_ms) : kDefaultQueueWait;
  const QueueKey key{.priority = req.priority,
                     .isl = prepared.sel.isl,
                     .best_overlap_tokens = best_overlap * config_.block_size};
  const std::string id = req.request_id;
  // What a queued request holds grows with its prompt: the queue is bounded in blocks too.
  const std::uint64_t blocks = std::max<std::uint64_t>(1, prepared.sel.request_blocks);
  if (!generate) {
    req.token_ids.clear();  // hashed already; only a forward needs the tokens
    req.token_ids.shrink_to_fit();
  }
  if (!queue_.Push(key, now, now + wait,
                   PendingRoute{std::move(req), std::move(prepared), std::string(reply), generate}, blocks)) {
    ++queue_refused_;
    return Status(StatusCode::kOverloaded,
                  fmt::format("every worker is busy and {} requests ({} blocks) are already queued", queue_.size(),
                              queue_.weight()));
  }
  if (!id.empty()) ++queued_ids_[id];
  return Status::Ok();
}

void Routing::UnqueueIdLocked(const std::string& request_id) {
  if (auto it = queued_ids_.find(request_id); it != queued_ids_.end() && --it->second == 0) queued_ids_.erase(it);
}

void Routing::ExpireQueuedLocked(Outbox& out) {
  queue_.Expire(clock_(), [&](RouteQueue::Entry&& e) {
    mu_.AssertHeld();
    UnqueueIdLocked(e.payload.req.request_id);
    ++queue_timed_out_;
    CountLocked(e.payload.generate ? Kind::kGenerate : Kind::kRoute, StatusCodeName(StatusCode::kTimeout));
    out.errors.emplace_back(std::move(e.payload.reply), Status(StatusCode::kTimeout, "no worker had room before timeout_ms"));
  });
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
  queue_.Scan(
      [&](RouteQueue::Entry& e) {
        mu_.AssertHeld();
        const PendingRoute& p = e.payload;
        OverlapScores none;
        auto cands = CandidatesLocked(p.req, p.prepared.seq, none);
        if (!cands.ok()) {  // its worker went away while it waited
          failed = cands.status();
          return ScanStep::kTake;
        }
        if (OpenRanks(*cands).empty()) {
          // An unfiltered request sees every rank: if it cannot go, nothing else can.
          const bool filtered = p.req.worker_id || p.req.dp_rank || p.req.allowed_worker_ids;
          return filtered ? ScanStep::kKeep : ScanStep::kStop;
        }
        // Fresh overlaps for the ranks it may go to. The registry has its own lock: a worker may
        // have left since the first look, so the candidates are checked again.
        thread_local OverlapScores overlaps;
        if (approx_) {
          PredictedOverlaps(p.prepared, overlaps);
        } else {
          IndexOverlaps(p.prepared, overlaps);
        }
        auto with_overlaps = CandidatesLocked(p.req, p.prepared.seq, overlaps);
        if (!with_overlaps.ok()) {
          failed = with_overlaps.status();
          return ScanStep::kTake;
        }
        std::vector<Candidate> ready = OpenRanks(std::move(with_overlaps).value());
        if (ready.empty()) {
          const bool filtered = p.req.worker_id || p.req.dp_rank || p.req.allowed_worker_ids;
          return filtered ? ScanStep::kKeep : ScanStep::kStop;
        }
        const double queued_ms = std::chrono::duration<double, std::milli>(now - e.enqueued).count();
        auto reply = DecideLocked(p.generate ? Kind::kGenerate : Kind::kRoute, p.req, p.prepared, ready, queued_ms);
        if (reply.ok()) {
          ++queue_admitted_;
          admitted = *reply;
        } else {
          failed = reply.status();
        }
        return ScanStep::kTake;
      },
      [&](RouteQueue::Entry&& e) {
        mu_.AssertHeld();
        UnqueueIdLocked(e.payload.req.request_id);
        if (admitted) {
          DeliverLocked(std::move(e.payload.req), *admitted, std::move(e.payload.reply), e.payload.generate, out);
          admitted.reset();
        } else {
          CountLocked(e.payload.generate ? Kind::kGenerate : Kind::kRoute, StatusCodeName(failed.code()));
          out.errors.emplace_back(std::move(e.payload.reply), failed);
        }
      });
  TakeDeferredLocked(out);  // admissions changed loads
}

void Routing::TakeDeferredLocked(Outbox& out) {
  for (WorkerKey w : metrics_dirty_) out.metrics.emplace_back(w, load_.Load(w));
  metrics_dirty_.clear();
  for (auto& b : pending_syncs_) out.syncs.push_back(std::move(b));
  pending_syncs_.clear();
}

void Routing::FailPinnedLocked(std::span<const std::uint64_t> worker_ids, Outbox& out) {
  if (queue_.empty() || worker_ids.empty()) return;
  auto gone = [&](const RouteQueue::Entry& e) {
    return e.payload.req.worker_id && std::binary_search(worker_ids.begin(), worker_ids.end(), *e.payload.req.worker_id);
  };
  queue_.Scan([&](const RouteQueue::Entry& e) { return gone(e) ? ScanStep::kTake : ScanStep::kKeep; },
              [&](RouteQueue::Entry&& e) {
                mu_.AssertHeld();
                UnqueueIdLocked(e.payload.req.request_id);
                CountLocked(e.payload.generate ? Kind::kGenerate : Kind::kRoute, StatusCodeName(StatusCode::kNotFound));
                out.errors.emplace_back(std::move(e.payload.reply),
                                        NotFound(fmt::format("worker {} is gone", *e.payload.req.worker_id)));
              });
}

bool Routing::CancelQueuedLocked(const std::string& request_id, Outbox& out) {
  if (request_id.empty() || !queued_ids_.count(request_id)) return false;
  bool found = false;
  queue_.Scan(
      [&](const RouteQueue::Entry& e) {
        if (found || e.payload.req.request_id != request_id) return ScanStep::kKeep;
        found = true;
        return ScanStep::kTake;
      },
      [&](RouteQueue::Entry&& e) {
        mu_.AssertHeld();
        CountLocked(e.payload.generate ? Kind::kGenerate : Kind::kRoute, StatusCodeName(StatusCode::kTimeout));
        out.errors.emplace_back(std::move(e.payload.reply), Status(StatusCode::kTimeout, "freed while queued"));
      });
  UnqueueIdLocked(request_id);
  return found;
}

bool Routing::LifecycleLocked(const std::string& request_id, bool free, Outbox& out) {
  const WorkerKey* w = load_.WorkerOf(request_id);
  const WorkerKey worker = w ? *w : WorkerKey{};
  const bool did = free ? load_.Free(request_id) : load_.MarkPrefill(request_id);
  if (free) peers_.Released(request_id);
  if (free && !did) CancelQueuedLocked(request_id, out);  // freed before it left the queue
  if (did) {
    metrics_dirty_.push_back(worker);
    if (config_.replica_sync) {
      SyncLocked(free ? ActiveSequenceEvent::Kind::kFree : ActiveSequenceEvent::Kind::kPrefillDone, request_id, worker);
    }
    DrainLocked(out);  // load dropped: queued requests may fit now
  }
  TakeDeferredLocked(out);
  return did;
}

bool Routing::MarkPrefill(const std::string& request_id, Outbox& out) {
  KvMutexLock g(mu_);
  return LifecycleLocked(request_id, false, out);
}

bool Routing::Free(const std::string& request_id, Outbox& out) {
  KvMutexLock g(mu_);
  return LifecycleLocked(request_id, true, out);
}

void Routing::ForgetWorkers(std::span<const std::uint64_t> worker_ids, Outbox& out) {
  if (worker_ids.empty()) return;
  KvMutexLock g(mu_);
  for (std::uint64_t id : worker_ids) {
    load_.RemoveWorker(id);
    if (approx_) approx_->RemoveWorker(id);
    for (auto r = routed_to_.lower_bound({id, 0}); r != routed_to_.end() && r->first.worker_id == id;) {
      r = routed_to_.erase(r);
    }
  }
  // Their bookings are gone: so are the entries naming the replicas that made them.
  peers_.Prune([&](const std::string& request) {
    mu_.AssertHeld();
    return load_.WorkerOf(request) == nullptr;
  });
  FailPinnedLocked(worker_ids, out);
  DrainLocked(out);
}

void Routing::Tick(Outbox& out) {
  const SteadyTime now = clock_();
  KvMutexLock g(mu_);
  ReleasePeerBookingsLocked(peers_.TakeSilent(now));
  if (load_.Sweep(now) > 0) {
    peers_.Prune([&](const std::string& id) {
      mu_.AssertHeld();  // called right here, under mu_
      return load_.WorkerOf(id) == nullptr;
    });
  }
  if (approx_) approx_->Expire(now);
  ExpireQueuedLocked(out);
  DrainLocked(out);
}

void Routing::FillStats(StatsReply& r) const {
  KvMutexLock g(mu_);
  for (WorkerStats& w : r.workers) {
    const WorkerKey k{w.worker_id, w.dp_rank};
    const WorkerLoad l = load_.Load(k);
    w.active_blocks = l.active_blocks;
    w.active_prefill_tokens = l.active_prefill_tokens;
    w.active_requests = l.active_requests;
    if (approx_) w.blocks = approx_->TreeSize(k);
    auto routed = routed_to_.find(k);
    w.routed_requests = routed == routed_to_.end() ? 0 : routed->second;
  }
  r.breakdowns["routed"] = routed_;
  r.breakdowns["route_errors"] = route_errors_;
  r.breakdowns["requests"] = {requests_.begin(), requests_.end()};
  r.breakdowns["replica_sync_refused"] = replica_refused_;
  r.counters["replica_peers"] = peers_.peers();
  r.counters["replica_peers_dead"] = peers_.dead();
  r.counters["replica_bookings_released"] = replica_released_;
  r.counters["queue_length"] = queue_.size();
  r.counters["queue_blocks"] = queue_.weight();
  r.counters["queue_admitted"] = queue_admitted_;
  r.counters["queue_timed_out"] = queue_timed_out_;
  r.counters["queue_refused"] = queue_refused_;
  r.counters["active_requests"] = load_.requests();
  r.counters["active_booked_blocks"] = load_.booked_blocks();
  r.counters["predicted_blocks"] = approx_ ? approx_->size() : 0;
  r.counters["predictions_expired"] = approx_ ? approx_->expired() : 0;
  r.counters["predictions_pruned"] = approx_ ? approx_->pruned() : 0;
}

}  // namespace kvrouter
