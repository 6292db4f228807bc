#include "router/scheduling/scheduler.h"

#include <fmt/format.h>

#include <algorithm>

namespace kvrouter {

Scheduler::Scheduler(SchedulerOptions options, const ShardedIndex& index, Clock clock, std::uint64_t seed)
    : options_(std::move(options)),
      index_(index),
      clock_(std::move(clock)),
      rng_(seed),
      approx_(options_.predictions
                  ? std::make_unique<ApproxIndex>(options_.predictions->ttl, options_.predictions->max_blocks,
                                                  options_.predictions->prune_target_ratio)
                  : nullptr),
      transfer_(options_.disagg.kv_bytes_per_token, options_.disagg.kv_transfer_gbps),
      kept_crowds_(std::max<std::size_t>(16, 4 * index.num_shards())) {}

Result<PreparedRequest> PrepareRequest(const SchedulerOptions& options, const RouteRequest& req) {
  const std::uint32_t bs = options.block_size;
  PreparedRequest p;
  std::vector<LocalHash> local;
  std::uint32_t isl = req.isl;
  const std::uint64_t prompt = req.has_token_ids ? req.token_ids.size() : req.isl;
  if (prompt > options.max_prompt_tokens) {
    return InvalidArgument(fmt::format("the prompt has {} tokens; the limit is {} (--router-max-prompt-tokens)", prompt,
                                       options.max_prompt_tokens));
  }
  if (req.has_token_ids) {
    local = ComputeLocalHashes(req.token_ids, bs, req.lora_name, req.mm_items);
    isl = static_cast<std::uint32_t>(req.token_ids.size());
  } else {
    if (req.block_hashes.size() > (std::uint64_t{isl} + bs - 1) / bs) {
      return InvalidArgument(
          fmt::format("{} block_hashes do not fit in isl {} at block size {}", req.block_hashes.size(), isl, bs));
    }
    local = req.block_hashes;
  }
  if (options.mode == RouterMode::kDirect && !req.worker_id) {
    return InvalidArgument("router mode 'direct' needs worker_id in the request");
  }
  p.seq = ComputeSequenceHashes(local);
  p.local = std::move(local);
  p.sel = {isl, static_cast<std::uint32_t>((std::uint64_t{isl} + bs - 1) / bs)};
  p.params = options.cost;
  const auto& o = req.config_override;
  // A request that sets Dynamo's weights gets Dynamo's formula with them.
  if (o.overlap_score_credit || o.prefill_load_scale) p.params.model = CostModel::kKvBlocks;
  if (o.overlap_score_credit) p.params.overlap_score_credit = *o.overlap_score_credit;
  if (o.prefill_load_scale) p.params.prefill_load_scale = *o.prefill_load_scale;
  if (o.router_temperature) p.params.temperature = *o.router_temperature;
  return p;
}

void IndexOverlaps(const SchedulerOptions& options, const ShardedIndex& index, const PreparedRequest& p,
                   OverlapScores& out) {
  out.clear();
  if (options.mode != RouterMode::kKv || p.seq.empty() || options.predictions || !options.use_kv_events) return;
  index.FindMatches(p.seq, out);
}

bool IndexRuns(const SchedulerOptions& options, const ShardedIndex& index, const PreparedRequest& p, IndexMatches& out,
               std::span<const std::uint64_t> known) {
  if (options.mode != RouterMode::kKv || p.seq.empty() || options.predictions || !options.use_kv_events) return false;
  index.FindMatches(p.seq, out, known);
  return true;
}

void Scheduler::PredictedOverlaps(const PreparedRequest& p, OverlapScores& out) const {
  out.clear();
  if (options_.mode == RouterMode::kKv && approx_ && !p.seq.empty()) approx_->FindMatches(p.seq, out);
}

void Scheduler::FreshOverlaps(const PreparedRequest& p, OverlapScores& out) const {
  if (approx_) {
    PredictedOverlaps(p, out);
  } else {
    IndexOverlaps(options_, index_, p, out);
  }
}

void Scheduler::PriceSpread(PreparedRequest& p) const {
  if (p.params.model == CostModel::kPredicted) {
    p.params.spread_scale = PredictedTimeCost::SpreadScaleOf(rates_.Typical().prefill);
  }
}

Scheduler::CandidateContext Scheduler::ContextNow() const {
  return {.recent_scale = load_.RecentScale(clock_()),
          .no_load = load_.workers() == 0,
          .no_rates = rates_.ranks() == 0,
          .typical = rates_.Typical()};
}

Candidate Scheduler::CandidateOf(const RankInfo& r, const TieredOverlap& overlap, std::span<const SequenceHash> seq,
                                 const CandidateContext& ctx) const {
  Candidate c;
  c.worker = r.worker;
  c.is_cpu = r.is_cpu;
  c.capacity = r.max_num_seqs;
  c.max_num_batched_tokens = r.max_num_batched_tokens;
  c.total_kv_blocks = r.total_kv_blocks;
  c.overlap_blocks = overlap.device;
  c.host_overlap_blocks = overlap.host;
  c.any_overlap_blocks = overlap.any;
  // A rank the router never booked, or has nothing active on, needs no second lookup.
  if (!ctx.no_load) {
    const WorkerLoad l = load_.Load(c.worker);
    c.active_blocks = l.active_blocks;
    c.active_prefill_tokens = l.active_prefill_tokens;
    c.active_prefill_squares = l.active_prefill_squares;
    c.active_requests = l.active_requests;
    c.recent_requests = l.recent_scaled * ctx.recent_scale;
    if (l.active_blocks > 0) c.active_prefix_blocks = load_.ActivePrefix(c.worker, seq);
  }
  const WorkerRates::Rates rate = ctx.no_rates ? ctx.typical : rates_.Of(c.worker);
  if (!ctx.no_rates) c.recent_requests *= RecentWeight(rate.prefill, ctx.typical.prefill);
  c.prefill_factor = rate.prefill;
  c.decode_factor = rate.decode;
  return c;
}

std::vector<Candidate> Scheduler::Candidates(std::span<const RankInfo> ranks, std::span<const SequenceHash> seq,
                                             OverlapScores& overlaps) const {
  // Ranks come in ascending (worker_id, dp_rank) order, as RankOverlaps reads them.
  RankOverlaps by_rank(overlaps);
  std::vector<Candidate> cands;
  cands.reserve(ranks.size());
  const CandidateContext ctx = ContextNow();
  for (const RankInfo& r : ranks) cands.push_back(CandidateOf(r, by_rank.At(r.worker), seq, ctx));
  return cands;
}

bool Scheduler::Full(const Candidate& c) const {
  return options_.queue_threshold &&
         static_cast<double>(c.active_prefill_tokens) > *options_.queue_threshold * c.max_num_batched_tokens;
}

std::vector<Candidate> Scheduler::OpenRanks(std::vector<Candidate> cands) const {
  if (!options_.queue_threshold) return cands;
  std::erase_if(cands, [&](const Candidate& c) { return Full(c); });
  return cands;
}

Status Scheduler::BookingRoom(std::size_t blocks) const {
  if (load_.requests() >= options_.max_active_requests) {
    return Status(StatusCode::kOverloaded,
                  fmt::format("{} requests are booked (--router-max-active-requests); free some", load_.requests()));
  }
  if (blocks > options_.max_active_blocks - std::min(options_.max_active_blocks, load_.booked_blocks())) {
    return Status(StatusCode::kOverloaded,
                  fmt::format("{} blocks are booked (--router-max-active-blocks); free some", load_.booked_blocks()));
  }
  return Status::Ok();
}

Decision Scheduler::DecisionOf(const Candidate& chosen, const SelectionRequest& req) {
  const std::uint32_t host = std::max(chosen.host_overlap_blocks, chosen.overlap_blocks);
  return Decision{.worker = chosen.worker,
                  .overlap_blocks = std::min(chosen.overlap_blocks, req.request_blocks),
                  .overlap_by_tier = {.device = std::min(chosen.overlap_blocks, req.request_blocks),
                                      .host = std::min(host, req.request_blocks),
                                      .any = std::min(std::max(chosen.any_overlap_blocks, host), req.request_blocks)}};
}

Result<Decision> Scheduler::Decide(const RouteRequest& req, const PreparedRequest& p,
                                   std::span<const Candidate> cands) {
  if (cands.empty()) return Status(StatusCode::kNoWorkers, "no registered worker can take this request");
  const Candidate& chosen = cands[selector_.Pick(options_.mode, p.sel, cands, p.params, rng_)];
  Decision d = DecisionOf(chosen, p.sel);
  if (req.update_states && !req.request_id.empty()) {
    if (Status full = BookingRoom(p.seq.size()); !full.ok()) return full;
    const std::uint64_t cached = std::uint64_t{d.overlap_blocks} * options_.block_size;
    const std::uint64_t prefill = p.sel.isl > cached ? p.sel.isl - cached : 0;
    if (!load_.Book(req.request_id, chosen.worker, p.seq, prefill, clock_())) {
      return InvalidArgument(fmt::format("request_id '{}' is already booked; free it first", req.request_id));
    }
    d.booked = true;
    load_.SetPrior(req.request_id, PriorTtftOf(chosen, p.sel, p.params));
    // Approximate mode: the chosen rank is about to hold this prompt's blocks.
    if (approx_) approx_->Record(chosen.worker, p.local, p.seq, clock_());
  }
  return d;
}

Result<DisaggDecision> Scheduler::DecideDisagg(const RouteRequest& req, const PreparedRequest& p,
                                               std::span<const Candidate> decode, std::span<const Candidate> prefill,
                                               bool whole) {
  if (decode.empty() || prefill.empty()) {
    return Status(StatusCode::kNoWorkers, "no registered worker can take this request");
  }
  auto pick = [&](std::span<const Candidate> cands) {
    return selector_.Pick(options_.mode, p.sel, cands, p.params, rng_);
  };
  const std::size_t local = pick(decode);
  // A prefill rank decodes nothing: its requests are prefills queued there (in its prefill
  // tokens), not requests a prefill would stall.
  thread_local std::vector<Candidate> prefilling;
  prefilling.assign(prefill.begin(), prefill.end());
  for (Candidate& c : prefilling) c.active_requests = 0;
  const std::size_t prefill_at = pick(prefilling);
  // By load: the same cost with no rank's cache counted (the KV arrives from the prefill rank).
  thread_local std::vector<Candidate> uncached;
  uncached.assign(decode.begin(), decode.end());
  for (Candidate& c : uncached) {
    c.overlap_blocks = c.host_overlap_blocks = c.any_overlap_blocks = c.active_prefix_blocks = 0;
  }
  const std::size_t remote = pick(uncached);
  DisaggDecision out;
  out.choice = ChooseDisagg(options_.disagg, {decode[local], prefill[prefill_at], decode[remote]}, p.sel, p.params,
                            transfer_);
  if (whole || !out.choice.disaggregated) {
    auto d = Decide(req, p, decode.subspan(local, 1));
    if (!d.ok()) return d.status();
    out.decode = *d;
    return out;
  }
  const Candidate& d = decode[remote];
  const Candidate& pf = prefill[prefill_at];
  out.decode = DecisionOf(d, p.sel);
  out.prefill = DecisionOf(pf, p.sel);
  if (req.update_states && !req.request_id.empty()) {
    if (Status full = BookingRoom(p.seq.size()); !full.ok()) return full;
    const SteadyTime now = clock_();
    if (!load_.Book(req.request_id, d.worker, p.seq, 0, now)) {
      return InvalidArgument(fmt::format("request_id '{}' is already booked; free it first", req.request_id));
    }
    const std::uint64_t cached = std::uint64_t{out.prefill->overlap_blocks} * options_.block_size;
    (void)load_.BookPrefill(req.request_id, pf.worker, p.sel.isl > cached ? p.sel.isl - cached : 0, now);
    out.decode.booked = out.prefill->booked = true;
    PriorTtft prefill_prior = PriorTtftOf(pf, p.sel, p.params);
    prefill_prior.decode_ms = 0;  // a prefill engine decodes nothing: its steps are its prefills
    transfers_[req.request_id] = {
        .predicted_ms = transfer_.PriorMs(UncachedTokens(d, p.sel, p.params)) +
                        predicted_cost::Predict(d, p.sel, p.params).prior.decode_step_ms,
        .prefill_worker = pf.worker,
        .prefill_prior = prefill_prior,
        .booked_at = now};
    if (approx_) {
      approx_->Record(pf.worker, p.local, p.seq, now);
      approx_->Record(d.worker, p.local, p.seq, now);
    }
  }
  return out;
}

bool Scheduler::PrefillDone(const std::string& request_id) {
  if (!load_.ReleasePrefill(request_id)) return false;
  auto it = transfers_.find(request_id);
  if (it == transfers_.end()) return true;  // another replica's booking
  PendingTransfer& t = it->second;
  const SteadyTime now = clock_();
  t.prefill_done_at = now;
  const double took = std::chrono::duration<double, std::milli>(now - t.booked_at).count();
  rates_.Drift(now);
  (void)rates_.Observe(t.prefill_worker, t.prefill_prior, ResponseTiming{.ttfb_ms = took}, now);
  return true;
}

bool Scheduler::MarkPrefill(const std::string& request_id) {
  if (auto it = transfers_.find(request_id); it != transfers_.end()) {
    if (it->second.prefill_done_at) {
      const double observed = std::chrono::duration<double, std::milli>(clock_() - *it->second.prefill_done_at).count();
      (void)transfer_.Observe(it->second.predicted_ms, observed);
    }
    transfers_.erase(it);
  }
  return load_.MarkPrefill(request_id);
}

bool Scheduler::Learn(const std::string& request_id, const ResponseTiming& timing) {
  const WorkerKey* worker = load_.WorkerOf(request_id);
  const PriorTtft* prior = load_.PriorOf(request_id);
  const SteadyTime now = clock_();
  rates_.Drift(now);  // also where nothing calls DriftRates (kvbench's offline replay)
  return worker && prior && rates_.Observe(*worker, *prior, timing, now);
}

void Scheduler::ForgetTransfersOf(std::uint64_t worker_id) {
  std::erase_if(transfers_, [&](const auto& t) { return t.second.prefill_worker.worker_id == worker_id; });
}

std::size_t Scheduler::ForgetWorker(std::uint64_t worker_id) {
  if (approx_) approx_->RemoveWorker(worker_id);
  rates_.RemoveWorker(worker_id);
  ForgetTransfersOf(worker_id);
  return load_.RemoveWorker(worker_id);
}

void Scheduler::ExpirePredictions(SteadyTime now) {
  if (approx_) approx_->Expire(now);
  std::erase_if(transfers_, [&](const auto& t) { return load_.WorkerOf(t.first) == nullptr; });
}

}  // namespace kvrouter
