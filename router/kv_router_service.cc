#include "router/kv_router_service.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <limits>

#include "events/event_codec.h"
#include "events/msgpack_reader.h"
#include "events/vllm_codec.h"

namespace kvrouter {
namespace {

using Packer = msgpack::packer<msgpack::sbuffer>;

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

void PackCounts(Packer& pk, const std::map<std::string, std::uint64_t>& m) {
  pk.pack_map(static_cast<std::uint32_t>(m.size()));
  for (const auto& [k, v] : m) {
    PackKey(pk, k);
    pk.pack(v);
  }
}

}  // namespace

Subjects::Subjects(const std::string& ns, const std::string& comp) {
  const std::string c = fmt::format("namespace.{}.component.{}.", ns, comp);
  const std::string r = fmt::format("namespace.{}.router.", ns);
  kv_events = c + "kv-events";
  vllm_events_prefix = c + "vllm-kv-events.";
  instances = c + "instances";
  active_sequences = c + "active_sequences_events";
  route = r + "route";
  best_worker = r + "best_worker";
  mark_prefill = r + "mark_prefill";
  free = r + "free";
  stats = r + "stats";
  kv_metrics = fmt::format("namespace.{}.kv_metrics", ns);
  generate = r + "generate";
  worker_generate_prefix = c + "generate.";
}

KvRouterService::KvRouterService(RouterConfig config, MessageBus& bus, Clock clock, std::uint64_t seed)
    : config_(std::move(config)),
      bus_(bus),
      clock_(clock ? std::move(clock) : Clock([] { return std::chrono::steady_clock::now(); })),
      subjects_(config_.ns, config_.component),
      router_id_(std::random_device{}() * 0x9E3779B97F4A7C15ULL ^ seed),
      index_({.num_shards = config_.index_shards}),
      rng_(seed),
      queue_(config_.queue_policy, config_.queue_max, config_.max_active_blocks),
      approx_(!config_.use_kv_events && !config_.load_aware
                  ? std::make_unique<ApproxIndex>(
                        std::chrono::milliseconds(static_cast<std::int64_t>(config_.ttl_secs * 1000)),
                        config_.max_tree_size, config_.prune_target_ratio)
                  : nullptr),
      relay_prefix_(fmt::format("_KVR.{:x}.", router_id_)) {}

KvRouterService::~KvRouterService() { Stop(); }

Status KvRouterService::Start() {
  // Flags whose features later issues bring: refuse rather than silently ignore them.
  struct Sub {
    std::string subject;
    std::string group;
    MessageBus::Handler handler;
  };
  std::vector<Sub> subs;
  if (config_.use_kv_events) {
    subs.push_back({subjects_.kv_events, "", [this](const BusMessage& m) { HandleKvEvent(m); }});
    subs.push_back({subjects_.vllm_events_prefix + "*.*", "", [this](const BusMessage& m) { HandleVllmEvent(m); }});
  }
  subs.push_back({subjects_.instances, "", [this](const BusMessage& m) { HandleInstances(m); }});
  subs.push_back({subjects_.route, "kvrouter", [this](const BusMessage& m) { HandleRoute(m, RouteKind::kRoute); }});
  subs.push_back({subjects_.best_worker, "kvrouter",
                  [this](const BusMessage& m) { HandleRoute(m, RouteKind::kBestWorker); }});
  subs.push_back({subjects_.generate, "kvrouter", [this](const BusMessage& m) { HandleRoute(m, RouteKind::kGenerate); }});
  subs.push_back({relay_prefix_ + "*", "", [this](const BusMessage& m) { HandleRelay(m); }});
  // Lifecycle messages go to every replica: each one's bookings must be released.
  subs.push_back({subjects_.mark_prefill, "", [this](const BusMessage& m) { HandleLifecycle(m, false); }});
  subs.push_back({subjects_.free, "", [this](const BusMessage& m) { HandleLifecycle(m, true); }});
  subs.push_back({subjects_.stats, "kvrouter", [this](const BusMessage& m) { HandleStats(m); }});
  if (config_.replica_sync) {
    subs.push_back({subjects_.active_sequences, "", [this](const BusMessage& m) { HandleReplicaSync(m); }});
  }
  for (auto& s : subs) {
    // Nothing may escape a handler: count it, log it, answer `internal` when a reply is expected.
    MessageBus::Handler guarded = [this, h = std::move(s.handler)](const BusMessage& m) {
      try {
        h(m);
      } catch (const std::exception& e) {
        CountDrop("handler_exception");
        log_.Log(LogLevel::kError, "handler exception", "handler for {} failed: {}", m.subject, e.what());
        if (!m.reply.empty()) (void)bus_.Publish(m.reply, AsBytes(EncodeErrorReply(Internal(e.what()))));
      }
    };
    auto r = bus_.Subscribe(s.subject, s.group, std::move(guarded));
    if (!r.ok()) {
      subs_.clear();
      return Status(r.status().code(), fmt::format("subscribe {}: {}", s.subject, r.status().message()));
    }
    subs_.push_back(std::move(r).value());
  }
  return Status::Ok();
}

void KvRouterService::Stop() { subs_.clear(); }

void KvRouterService::CountDrop(const std::string& reason) {
  std::lock_guard g(mu_);
  ++drops_[reason];
}

const char* KvRouterService::AdmitEventWorker(std::uint64_t worker_id, std::uint32_t dp_rank) {
  static constexpr const char* kOutOfRange = "dp_rank_out_of_range";
  static constexpr const char* kTooMany = "too_many_workers";
  std::lock_guard g(mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) {
    // A new event-only worker serves ranks [0, dp_rank].
    if (dp_rank >= config_.max_dp_size) return kOutOfRange;
    if (ranks_total_ + dp_rank + 1 > config_.max_worker_ranks) return kTooMany;
    WorkerRegistration& reg = workers_[worker_id].reg;
    reg.worker_id = worker_id;
    reg.block_size = config_.block_size;
    reg.dp_size = dp_rank + 1;
    ranks_total_ += reg.dp_size;
    return nullptr;
  }
  WorkerRegistration& reg = it->second.reg;
  if (dp_rank >= reg.dp_start && dp_rank - reg.dp_start < reg.dp_size) return nullptr;
  // A registered worker's ranks are what it registered; an event-only worker's are what it uses.
  if (it->second.has_lease || dp_rank < reg.dp_start) return kOutOfRange;
  const std::uint64_t size = std::uint64_t{dp_rank} - reg.dp_start + 1;
  if (size > config_.max_dp_size) return kOutOfRange;
  if (ranks_total_ - reg.dp_size + size > config_.max_worker_ranks) return kTooMany;
  ranks_total_ = ranks_total_ - reg.dp_size + size;
  reg.dp_size = static_cast<std::uint32_t>(size);
  return nullptr;
}

void KvRouterService::HandleKvEvent(const BusMessage& m) {
  auto batch = DecodeDynamoEvent(m.data);
  if (!batch.ok()) {
    CountDrop("decode_error");
    log_.Log(LogLevel::kWarning, "kv-events decode", "dropped undecodable KV event on {}: {}", m.subject,
             batch.status().message());
    return;
  }
  if (const char* refused = AdmitEventWorker(batch->worker_id, batch->dp_rank)) {
    CountDrop(refused);
    log_.Log(LogLevel::kWarning, "event refused", "dropped KV event of worker {} rank {}: {}", batch->worker_id,
             batch->dp_rank, refused);
    return;
  }
  const std::uint64_t worker = batch->worker_id;
  if (!index_.Submit(std::move(batch).value())) {
    log_.Log(LogLevel::kWarning, "index queue full", "index queue full: dropped an event of worker {}", worker);
  }
}

void KvRouterService::HandleVllmEvent(const BusMessage& m) {
  VllmBatchContext ctx;
  ctx.block_size = config_.block_size;
  if (!m.subject.starts_with(subjects_.vllm_events_prefix) ||
      !ParseWorkerRank(m.subject.substr(subjects_.vllm_events_prefix.size()), ctx.worker_id, ctx.dp_rank)) {
    CountDrop("decode_error");
    log_.Log(LogLevel::kWarning, "vllm subject", "dropped vLLM event on malformed subject {}", m.subject);
    return;
  }
  if (auto seq = m.Header("Kv-Seq")) ctx.kv_seq = ParseKvSeqHeader(*seq);
  auto decoded = DecodeVllmBatch(m.data, ctx);
  if (!decoded.ok()) {
    CountDrop("decode_error");
    log_.Log(LogLevel::kWarning, "vllm decode", "dropped undecodable vLLM batch on {}: {}", m.subject,
             decoded.status().message());
    return;
  }
  if (decoded->block_size_mismatches > 0) {
    {
      std::lock_guard g(mu_);
      drops_["block_size_mismatch"] += decoded->block_size_mismatches;
    }
    log_.Log(LogLevel::kWarning, "vllm block size", "worker {}: stored blocks cut short (block size is {})",
             ctx.worker_id, config_.block_size);
  }
  if (const char* refused = AdmitEventWorker(ctx.worker_id, ctx.dp_rank)) {
    CountDrop(refused);
    log_.Log(LogLevel::kWarning, "event refused", "dropped vLLM batch of worker {} rank {}: {}", ctx.worker_id,
             ctx.dp_rank, refused);
    return;
  }
  if (!index_.Submit(std::move(decoded->batch))) {
    log_.Log(LogLevel::kWarning, "index queue full", "index queue full: dropped an event of worker {}", ctx.worker_id);
  }
}

void KvRouterService::HandleInstances(const BusMessage& m) {
  auto reg = DecodeWorkerRegistration(m.data);
  Outbox out;
  std::unique_lock lk(mu_);
  if (!reg.ok()) {
    RefuseRegistrationLocked("invalid", reg.status().message());
    return;
  }
  if (reg->leaving) {
    ForgetLocked(reg->worker_id);
    const std::uint64_t gone[] = {reg->worker_id};
    FailPinnedLocked(gone, out);  // its queued pins get not_found now
    DrainLocked(out);
    lk.unlock();
    Send(out);
    return;
  }
  std::string detail;
  if (const char* reason = RegistrationRefusalLocked(*reg, detail)) {
    RefuseRegistrationLocked(reason, detail);
    return;
  }
  auto [it, inserted] = workers_.try_emplace(reg->worker_id);
  WorkerInfo& w = it->second;
  const bool is_new = !w.has_lease;
  ranks_total_ = ranks_total_ - (inserted ? 0 : w.reg.dp_size) + reg->dp_size;
  w.reg = std::move(reg).value();
  w.has_lease = true;
  w.lease_deadline = clock_() + std::chrono::milliseconds(w.reg.lease_ms);
  if (is_new) DrainLocked(out);  // new capacity
  lk.unlock();
  Send(out);
}

const char* KvRouterService::RegistrationRefusalLocked(const WorkerRegistration& reg, std::string& detail) const {
  if (reg.block_size && *reg.block_size != config_.block_size) {
    detail = fmt::format("worker {}: block size {} differs from the router's {}", reg.worker_id, *reg.block_size,
                         config_.block_size);
    return "block_size";
  }
  if (reg.dp_size > config_.max_dp_size) {
    detail = fmt::format("worker {}: dp_size {} is above --router-max-dp-size {}", reg.worker_id, reg.dp_size,
                         config_.max_dp_size);
    return "dp_size";
  }
  auto it = workers_.find(reg.worker_id);
  const std::uint64_t before = it == workers_.end() ? 0 : it->second.reg.dp_size;
  if (ranks_total_ - before + reg.dp_size > config_.max_worker_ranks) {
    detail = fmt::format("worker {}: {} more dp ranks would pass --router-max-worker-ranks {}", reg.worker_id,
                         reg.dp_size, config_.max_worker_ranks);
    return "too_many_workers";
  }
  return nullptr;
}

void KvRouterService::RefuseRegistrationLocked(std::string_view reason, const std::string& detail) {
  ++workers_refused_;
  ++registrations_refused_[std::string(reason)];
  log_.Log(LogLevel::kWarning, "registration refused", "refused a registration ({}): {}", reason, detail);
}

void KvRouterService::ForgetLocked(std::uint64_t worker_id) {
  auto it = workers_.find(worker_id);
  if (it != workers_.end()) {
    ranks_total_ -= it->second.reg.dp_size;
    workers_.erase(it);
  }
  load_.RemoveWorker(worker_id);
  index_.RemoveWorker(worker_id);
  if (approx_) approx_->RemoveWorker(worker_id);
  for (auto r = routed_to_.lower_bound({worker_id, 0}); r != routed_to_.end() && r->first.worker_id == worker_id;) {
    r = routed_to_.erase(r);
  }
}

void KvRouterService::Tick() {
  const SteadyTime now = clock_();
  Outbox out;
  std::unique_lock lk(mu_);
  std::vector<std::uint64_t> expired;  // ascending, as workers_ is
  for (const auto& [id, w] : workers_) {
    if (w.has_lease && now > w.lease_deadline) expired.push_back(id);
  }
  for (std::uint64_t id : expired) {
    ++leases_expired_;
    log_.Log(LogLevel::kInfo, "lease", "worker {} lease expired: forgotten", id);
    ForgetLocked(id);
  }
  FailPinnedLocked(expired, out);
  load_.Sweep(now);
  if (approx_) approx_->Expire(now);
  ExpireQueuedLocked(out);
  ExpireInFlightLocked(out);  // a full scan of the queue: on the tick only, not on every drain
  DrainLocked(out);
  lk.unlock();
  Send(out);
}

Result<KvRouterService::Prepared> KvRouterService::Prepare(const RouteRequest& req) const {
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
  p.params = {.block_size = bs,
              .overlap_score_credit = config_.overlap_score_credit,
              .prefill_load_scale = config_.prefill_load_scale,
              .temperature = config_.temperature,
              .track_prefill_tokens = config_.track_prefill_tokens,
              .device_ratio = config_.device_ratio};
  const auto& o = req.config_override;
  if (o.overlap_score_credit) p.params.overlap_score_credit = *o.overlap_score_credit;
  if (o.prefill_load_scale) p.params.prefill_load_scale = *o.prefill_load_scale;
  if (o.router_temperature) p.params.temperature = *o.router_temperature;
  return p;
}

OverlapScores KvRouterService::Overlaps(const Prepared& p) const {
  OverlapScores out;
  if (config_.mode != RouterMode::kKv || p.seq.empty()) return out;
  if (approx_) {
    approx_->FindMatches(p.seq, out);
  } else if (config_.use_kv_events) {
    out = index_.FindMatches(p.seq);
  }
  return out;
}

Result<std::vector<Candidate>> KvRouterService::CandidatesLocked(const RouteRequest& req,
                                                                 std::span<const SequenceHash> seq,
                                                                 const OverlapScores& overlaps) const {
  std::vector<Candidate> cands;
  auto add_rank = [&](const WorkerInfo& w, std::uint32_t r) {
    Candidate c;
    c.worker = {w.reg.worker_id, r};
    c.is_cpu = w.reg.device == "cpu";
    c.capacity = w.reg.max_num_seqs;
    c.max_num_batched_tokens = w.reg.max_num_batched_tokens;
    cands.push_back(c);
  };
  auto add_worker = [&](const WorkerInfo& w) {
    const std::uint64_t end = std::uint64_t{w.reg.dp_start} + w.reg.dp_size;
    if (req.dp_rank) {
      if (*req.dp_rank >= w.reg.dp_start && *req.dp_rank < end) add_rank(w, *req.dp_rank);
      return;
    }
    for (std::uint64_t r = w.reg.dp_start; r < end; ++r) add_rank(w, static_cast<std::uint32_t>(r));
  };
  if (req.worker_id) {
    auto it = workers_.find(*req.worker_id);
    if (it == workers_.end()) return NotFound(fmt::format("worker {} is not registered", *req.worker_id));
    add_worker(it->second);
    if (cands.empty()) {
      return NotFound(fmt::format("worker {} has no dp rank {}", *req.worker_id, *req.dp_rank));
    }
  } else if (req.allowed_worker_ids) {
    // Look the allowed ids up (ascending, each once) rather than test every worker against them.
    std::vector<std::uint64_t> allowed = *req.allowed_worker_ids;
    std::sort(allowed.begin(), allowed.end());
    allowed.erase(std::unique(allowed.begin(), allowed.end()), allowed.end());
    for (std::uint64_t id : allowed) {
      if (auto it = workers_.find(id); it != workers_.end()) add_worker(it->second);
    }
  } else {
    for (const auto& [id, w] : workers_) add_worker(w);
  }
  if (cands.empty()) return Status(StatusCode::kNoWorkers, "no registered worker can take this request");
  // Candidates are in ascending (worker_id, dp_rank) order: merge the overlaps in sorted too.
  std::vector<OverlapScore> sorted(overlaps.begin(), overlaps.end());
  std::sort(sorted.begin(), sorted.end(), [](const OverlapScore& a, const OverlapScore& b) { return a.worker < b.worker; });
  auto next = sorted.begin();
  for (Candidate& c : cands) {
    while (next != sorted.end() && next->worker < c.worker) ++next;
    if (next != sorted.end() && next->worker == c.worker) c.overlap_blocks = next->blocks;
    const WorkerLoad l = load_.Load(c.worker);
    c.active_blocks = l.active_blocks;
    c.active_prefill_tokens = l.active_prefill_tokens;
    c.active_requests = l.active_requests;
    c.active_prefix_blocks = load_.ActivePrefix(c.worker, seq);
  }
  return cands;
}

std::vector<Candidate> KvRouterService::OpenRanks(std::vector<Candidate> cands) const {
  if (!config_.queue_threshold) return cands;
  // Full: active prefill tokens above threshold x max_num_batched_tokens (at it is not full).
  std::erase_if(cands, [&](const Candidate& c) {
    return static_cast<double>(c.active_prefill_tokens) > *config_.queue_threshold * c.max_num_batched_tokens;
  });
  return cands;
}

Status KvRouterService::BookingRoomLocked(std::size_t blocks) const {
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

Result<RouteReply> KvRouterService::DecideLocked(const RouteRequest& req, const Prepared& p,
                                                 std::span<const Candidate> cands, double queued_ms) {
  const std::uint32_t bs = config_.block_size;
  const Candidate& chosen = cands[selector_.Pick(config_.mode, p.sel, cands, p.params, rng_)];
  const std::uint32_t overlap = std::min(chosen.overlap_blocks, p.sel.request_blocks);
  if (req.update_states && !req.request_id.empty()) {
    if (Status full = BookingRoomLocked(p.seq.size()); !full.ok()) return full;
    const std::uint64_t cached = std::uint64_t{overlap} * bs;
    const std::uint64_t prefill = p.sel.isl > cached ? p.sel.isl - cached : 0;
    if (!load_.Book(req.request_id, chosen.worker, p.seq, prefill, clock_())) {
      return InvalidArgument(fmt::format("request_id '{}' is already booked; free it first", req.request_id));
    }
    // Published under mu_ so replicas see bookings in this replica's order.
    if (config_.replica_sync) {
      PublishSync(ActiveSequenceEvent::Kind::kAdd, req.request_id, chosen.worker, p.seq, p.sel.isl, overlap);
    }
    metrics_dirty_.push_back(chosen.worker);
    // Approximate mode: the chosen rank is about to hold this prompt's blocks.
    if (approx_) approx_->Record(chosen.worker, p.local, p.seq, clock_());
  }
  ++routed_[std::string(RouterModeName(config_.mode))];
  if (req.update_states) ++routed_to_[chosen.worker];
  return RouteReply{.worker_id = chosen.worker.worker_id,
                    .dp_rank = chosen.worker.dp_rank,
                    .overlap_blocks = overlap,
                    .request_blocks = p.sel.request_blocks,
                    .cached_tokens = static_cast<std::uint32_t>(std::min<std::uint64_t>(
                        std::uint64_t{overlap} * bs, std::numeric_limits<std::uint32_t>::max())),
                    .queued_ms = queued_ms};
}

void KvRouterService::HandleRoute(const BusMessage& m, RouteKind kind) {
  Status error;
  Outbox out;
  try {
    auto req = DecodeRouteRequest(m.data);
    auto prepared = req.ok() ? Prepare(*req) : Result<Prepared>(req.status());
    if (prepared.ok() && kind == RouteKind::kGenerate && !req->has_token_ids) {
      prepared = InvalidArgument("router.generate needs token_ids (the worker must see the prompt)");
    }
    if (!prepared.ok()) {
      error = prepared.status();
    } else {
      if (kind == RouteKind::kBestWorker) req->update_states = false;
      if (kind == RouteKind::kGenerate) req->update_states = true;  // the router frees it itself
      // The event index has its own locks: read it before mu_. Predictions are under mu_.
      OverlapScores overlaps = approx_ ? OverlapScores{} : Overlaps(*prepared);
      std::lock_guard g(mu_);
      if (approx_) overlaps = Overlaps(*prepared);
      if (kind == RouteKind::kGenerate && req->request_id.empty()) {
        req->request_id = fmt::format("gen-{:x}-{}", router_id_, ++generated_ids_);
      }
      auto cands = CandidatesLocked(*req, prepared->seq, overlaps);
      if (!cands.ok()) {
        error = cands.status();
      } else {
        // best_worker answers as things stand; route and generate wait when every eligible
        // rank is full.
        std::vector<Candidate> open = kind == RouteKind::kBestWorker ? std::move(cands).value() : OpenRanks(*cands);
        if (open.empty()) {
          error = EnqueueLocked(std::move(req).value(), std::move(prepared).value(), *cands, m.reply,
                                kind == RouteKind::kGenerate);
          if (error.ok()) return;  // answered on admission
        } else {
          auto reply = DecideLocked(*req, *prepared, open, 0);
          if (!reply.ok()) {
            error = reply.status();
          } else if (kind == RouteKind::kGenerate) {
            ForwardLocked(*req, *reply, std::string(m.reply), out);
          } else {
            out.replies.emplace_back(std::string(m.reply), EncodeRouteReply(*reply));
          }
        }
      }
      TakeDeferredLocked(out);
    }
  } catch (const std::exception& e) {
    error = Internal(fmt::format("route failed: {}", e.what()));
  }
  if (!error.ok()) {
    {
      std::lock_guard g(mu_);
      ++route_errors_[std::string(StatusCodeName(error.code()))];
    }
    ReplyError(m, error);
  }
  Send(out);
}

void KvRouterService::ForwardLocked(const RouteRequest& req, const RouteReply& routed, std::string caller_reply,
                                    Outbox& out) {
  const std::uint64_t n = ++next_relay_;
  const auto timeout = req.timeout_ms ? std::chrono::milliseconds(*req.timeout_ms)
                                      : std::chrono::milliseconds(kDefaultGenerateTimeout);
  inflight_[n] = InFlight{req.request_id, std::move(caller_reply), clock_() + timeout, false};
  // PROTOCOL.md section 7: {request_id, token_ids, max_tokens, dp_rank}.
  msgpack::sbuffer body;
  Packer pk(body);
  pk.pack_map(4);
  PackKey(pk, "request_id"); pk.pack(req.request_id);
  PackKey(pk, "token_ids"); pk.pack(req.token_ids);
  PackKey(pk, "max_tokens"); pk.pack(req.max_tokens.value_or(req.expected_output_tokens.value_or(16)));
  PackKey(pk, "dp_rank"); pk.pack(routed.dp_rank);
  out.forwards.push_back({subjects_.worker_generate_prefix + std::to_string(routed.worker_id),
                          relay_prefix_ + std::to_string(n), std::move(body), n});
}

void KvRouterService::HandleRelay(const BusMessage& m) {
  std::uint64_t n = 0;
  const std::string_view tail = m.subject.substr(std::min(m.subject.size(), relay_prefix_.size()));
  if (std::from_chars(tail.data(), tail.data() + tail.size(), n).ec != std::errc()) return;
  // A worker that is gone shows as NATS "no responders" (status 503, empty body).
  const auto status = m.Header("Status");
  const bool no_responders = m.data.empty() && status && status->starts_with("503");
  bool final = no_responders;
  if (!final) {
    auto doc = ParseMsgpack(m.data);
    final = !doc.ok() || !IsNil(FindKey(doc->get(), "finish_reason"));
  }
  Outbox out;
  std::string caller;
  {
    std::lock_guard g(mu_);
    auto it = inflight_.find(n);
    if (it == inflight_.end()) return;  // late, after a timeout
    caller = it->second.caller_reply;
    const std::string id = it->second.request_id;
    const WorkerKey* w = load_.WorkerOf(id);
    if (w) metrics_dirty_.push_back(*w);
    if (!it->second.first_seen) {
      it->second.first_seen = true;
      if (load_.MarkPrefill(id)) DrainLocked(out);  // first response: prefill is done
    }
    if (final) {
      inflight_.erase(it);
      if (load_.Free(id)) DrainLocked(out);
    }
    TakeDeferredLocked(out);
  }
  if (no_responders) {
    out.errors.emplace_back(caller, Status(StatusCode::kNoWorkers, "the chosen worker did not answer"));
  } else if (!caller.empty()) {
    (void)bus_.Publish(caller, m.data);  // relayed unchanged
  }
  Send(out);
}

void KvRouterService::ExpireInFlightLocked(Outbox& out) {
  const SteadyTime now = clock_();
  for (auto it = inflight_.begin(); it != inflight_.end();) {
    if (now < it->second.deadline) {
      ++it;
      continue;
    }
    (void)load_.Free(it->second.request_id);
    out.errors.emplace_back(it->second.caller_reply, Status(StatusCode::kTimeout, "the worker did not finish in time"));
    it = inflight_.erase(it);
  }
}

Status KvRouterService::EnqueueLocked(RouteRequest req, Prepared prepared, std::span<const Candidate> all,
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

void KvRouterService::ExpireQueuedLocked(Outbox& out) {
  queue_.Expire(clock_(), [&](RouteQueue::Entry&& e) {
    if (auto it = queued_ids_.find(e.payload.req.request_id); it != queued_ids_.end() && --it->second == 0) {
      queued_ids_.erase(it);
    }
    ++queue_timed_out_;
    out.errors.emplace_back(std::move(e.payload.reply),
                            Status(StatusCode::kTimeout, "no worker had room before timeout_ms"));
  });
}

void KvRouterService::DrainLocked(Outbox& out) {
  if (queue_.empty()) return;
  const SteadyTime now = clock_();
  std::optional<msgpack::sbuffer> body;
  bool forwarded = false;
  Status failed;
  queue_.Scan(
      [&](RouteQueue::Entry& e) {
        const PendingRoute& p = e.payload;
        auto cands = CandidatesLocked(p.req, p.prepared.seq, {});
        if (!cands.ok()) {  // its worker went away while it waited
          failed = cands.status();
          return ScanStep::kTake;
        }
        const std::vector<Candidate> open = OpenRanks(*cands);
        if (open.empty()) {
          // An unfiltered request sees every rank: if it cannot go, nothing else can.
          const bool filtered = p.req.worker_id || p.req.dp_rank || p.req.allowed_worker_ids;
          return filtered ? ScanStep::kKeep : ScanStep::kStop;
        }
        // Fresh overlaps for the ranks it may go to.
        auto with_overlaps = CandidatesLocked(p.req, p.prepared.seq, Overlaps(p.prepared));
        std::vector<Candidate> ready = OpenRanks(std::move(with_overlaps).value());
        const double queued_ms = std::chrono::duration<double, std::milli>(now - e.enqueued).count();
        auto reply = DecideLocked(p.req, p.prepared, ready, queued_ms);
        if (reply.ok()) {
          ++queue_admitted_;
          if (p.generate) {
            ForwardLocked(p.req, *reply, p.reply, out);
            forwarded = true;
          } else {
            body = EncodeRouteReply(*reply);
          }
        } else {
          failed = reply.status();
        }
        return ScanStep::kTake;
      },
      [&](RouteQueue::Entry&& e) {
        if (auto it = queued_ids_.find(e.payload.req.request_id); it != queued_ids_.end() && --it->second == 0) {
          queued_ids_.erase(it);
        }
        if (forwarded) {
          forwarded = false;
        } else if (body) {
          out.replies.emplace_back(std::move(e.payload.reply), std::move(*body));
          body.reset();
        } else {
          out.errors.emplace_back(std::move(e.payload.reply), failed);
        }
      });
  TakeDeferredLocked(out);  // admissions changed loads
}

void KvRouterService::TakeDeferredLocked(Outbox& out) {
  for (WorkerKey w : metrics_dirty_) out.metrics.emplace_back(w, load_.Load(w));
  metrics_dirty_.clear();
  for (auto& b : pending_syncs_) out.syncs.push_back(std::move(b));
  pending_syncs_.clear();
}

void KvRouterService::FailPinnedLocked(std::span<const std::uint64_t> worker_ids, Outbox& out) {
  if (queue_.empty() || worker_ids.empty()) return;
  auto gone = [&](const RouteQueue::Entry& e) {
    return e.payload.req.worker_id && std::binary_search(worker_ids.begin(), worker_ids.end(), *e.payload.req.worker_id);
  };
  queue_.Scan([&](const RouteQueue::Entry& e) { return gone(e) ? ScanStep::kTake : ScanStep::kKeep; },
              [&](RouteQueue::Entry&& e) {
                if (auto it = queued_ids_.find(e.payload.req.request_id); it != queued_ids_.end() && --it->second == 0) {
                  queued_ids_.erase(it);
                }
                out.errors.emplace_back(std::move(e.payload.reply),
                                        NotFound(fmt::format("worker {} is gone", *e.payload.req.worker_id)));
              });
}

bool KvRouterService::CancelQueuedLocked(const std::string& request_id, Outbox& out) {
  if (request_id.empty() || !queued_ids_.count(request_id)) return false;
  bool found = false;
  queue_.Scan(
      [&](const RouteQueue::Entry& e) {
        if (found || e.payload.req.request_id != request_id) return ScanStep::kKeep;
        found = true;
        return ScanStep::kTake;
      },
      [&](RouteQueue::Entry&& e) {
        out.errors.emplace_back(std::move(e.payload.reply), Status(StatusCode::kTimeout, "freed while queued"));
      });
  if (auto it = queued_ids_.find(request_id); it != queued_ids_.end() && --it->second == 0) queued_ids_.erase(it);
  return found;
}

void KvRouterService::AbandonForward(const Outbox::Forward& f, const Status& why) {
  Outbox out;
  std::string caller;
  {
    std::lock_guard g(mu_);
    auto it = inflight_.find(f.relay);
    if (it == inflight_.end()) return;
    caller = it->second.caller_reply;
    if (load_.Free(it->second.request_id)) DrainLocked(out);
    inflight_.erase(it);
    TakeDeferredLocked(out);
  }
  out.errors.emplace_back(caller, why);
  Send(out);
}

void KvRouterService::Send(Outbox& out) {
  for (auto& b : out.syncs) (void)bus_.Publish(subjects_.active_sequences, AsBytes(b));
  for (auto& f : out.forwards) {
    if (Status s = bus_.PublishRequest(f.subject, f.reply, AsBytes(f.body)); !s.ok()) {
      log_.Log(LogLevel::kWarning, "forward", "forwarding to {} failed: {}", f.subject, s.message());
      AbandonForward(f, Status(StatusCode::kNoWorkers, fmt::format("could not reach the worker: {}", s.message())));
    }
  }
  for (auto& [reply, body] : out.replies) {
    if (!reply.empty()) (void)bus_.Publish(reply, AsBytes(body));
  }
  for (auto& [reply, status] : out.errors) {
    if (!reply.empty()) (void)bus_.Publish(reply, AsBytes(EncodeErrorReply(status)));
  }
  for (auto& [worker, load] : out.metrics) PublishMetrics(worker, load);
}

void KvRouterService::HandleLifecycle(const BusMessage& m, bool free) {
  auto id = DecodeLifecycleRequest(m.data);
  if (!id.ok()) {
    ReplyError(m, id.status());
    return;
  }
  Outbox out;
  {
    std::lock_guard g(mu_);
    const WorkerKey* w = load_.WorkerOf(*id);
    const WorkerKey worker = w ? *w : WorkerKey{};
    const bool did = free ? load_.Free(*id) : load_.MarkPrefill(*id);
    if (free && !did) CancelQueuedLocked(*id, out);  // freed before it left the queue
    if (did) {
      metrics_dirty_.push_back(worker);
      if (config_.replica_sync) {
        PublishSync(free ? ActiveSequenceEvent::Kind::kFree : ActiveSequenceEvent::Kind::kPrefillDone, *id, worker);
      }
      DrainLocked(out);  // load dropped: queued requests may fit now
    }
    TakeDeferredLocked(out);
  }
  Reply(m, EncodeOkReply());
  Send(out);
}

void KvRouterService::HandleStats(const BusMessage& m) {
  auto page = DecodeStatsRequest(m.data);
  if (!page.ok()) {
    ReplyError(m, page.status());
    return;
  }
  const IndexCounters c = index_.Counters();
  std::vector<WorkerTreeSize> blocks = index_.TreeSizes();
  std::sort(blocks.begin(), blocks.end(), [](const auto& a, const auto& b) { return a.worker < b.worker; });
  StatsReply r;
  r.offset = page->offset;
  std::unique_lock lk(mu_);
  r.workers_total = ranks_total_;
  // The page: ranks in ascending (worker_id, dp_rank) order from `offset`, at most `limit`.
  std::uint64_t skip = page->offset;
  for (auto it = workers_.begin(); it != workers_.end() && r.workers.size() < page->limit; ++it) {
    const WorkerRegistration& reg = it->second.reg;
    if (skip >= reg.dp_size) {
      skip -= reg.dp_size;
      continue;
    }
    for (std::uint64_t r64 = reg.dp_start + skip; r64 < std::uint64_t{reg.dp_start} + reg.dp_size; ++r64) {
      if (r.workers.size() >= page->limit) break;
      const WorkerKey k{it->first, static_cast<std::uint32_t>(r64)};
      const WorkerLoad l = load_.Load(k);
      std::uint64_t held = 0;
      if (approx_) {
        held = approx_->TreeSize(k);
      } else if (auto b = std::lower_bound(blocks.begin(), blocks.end(), k,
                                           [](const WorkerTreeSize& t, const WorkerKey& key) { return t.worker < key; });
                 b != blocks.end() && b->worker == k) {
        held = b->blocks;
      }
      auto routed = routed_to_.find(k);
      r.workers.push_back({.worker_id = k.worker_id,
                           .dp_rank = k.dp_rank,
                           .blocks = held,
                           .active_blocks = l.active_blocks,
                           .active_prefill_tokens = l.active_prefill_tokens,
                           .active_requests = l.active_requests,
                           .device = reg.device,
                           .routed_requests = routed == routed_to_.end() ? 0 : routed->second});
    }
    skip = 0;
  }
  std::map<std::string, std::uint64_t> dropped = drops_;
  dropped["parent_block_not_found"] += c.parent_block_not_found;
  dropped["block_not_found"] += c.block_not_found;
  dropped["duplicate"] += c.duplicate;
  dropped["queue_full"] += c.queue_full;
  r.breakdowns = {{"events_dropped", std::move(dropped)},
                  {"routed", routed_},
                  {"route_errors", route_errors_},
                  {"registrations_refused", registrations_refused_},
                  {"replica_sync_refused", replica_sync_refused_}};
  r.counters = {{"queue_length", queue_.size()},
                {"queue_blocks", queue_.weight()},
                {"queue_admitted", queue_admitted_},
                {"queue_timed_out", queue_timed_out_},
                {"queue_refused", queue_refused_},
                {"events_applied", c.ops_applied},
                {"workers_refused", workers_refused_},
                {"leases_expired", leases_expired_},
                {"event_gaps", c.gaps},
                {"event_restarts", c.restarts},
                {"active_requests", load_.requests()},
                {"active_booked_blocks", load_.booked_blocks()},
                {"predicted_blocks", approx_ ? approx_->size() : 0},
                {"predictions_expired", approx_ ? approx_->expired() : 0},
                {"predictions_pruned", approx_ ? approx_->pruned() : 0}};
  lk.unlock();  // never publish under mu_: a synchronous bus may call back into us
  auto body = EncodeStatsReply(r, bus_.MaxPayload());
  if (!body.ok()) {
    ReplyError(m, body.status());
    return;
  }
  Reply(m, *body);
}

void KvRouterService::PublishSync(ActiveSequenceEvent::Kind kind, const std::string& request_id, WorkerKey worker,
                                  std::span<const SequenceHash> seq, std::uint32_t isl, std::uint32_t overlap) {
  const ActiveSequenceEvent e{.router_id = router_id_,
                              .request_id = request_id,
                              .worker_id = worker.worker_id,
                              .dp_rank = worker.dp_rank,
                              .kind = kind,
                              .seq_hashes = {seq.begin(), seq.end()},
                              .isl = isl,
                              .overlap_blocks = overlap};
  pending_syncs_.push_back(EncodeActiveSequenceEvent(e));
}

void KvRouterService::HandleReplicaSync(const BusMessage& m) {
  auto e = DecodeActiveSequenceEvent(m.data);
  if (!e.ok()) {
    CountDrop("replica_sync_decode_error");
    log_.Log(LogLevel::kWarning, "replica sync decode", "dropped undecodable replica sync message: {}",
             e.status().message());
    return;
  }
  if (e->router_id == router_id_) return;  // our own, already applied
  const WorkerKey worker{e->worker_id, e->dp_rank};
  Outbox out;
  std::unique_lock lk(mu_);
  switch (e->kind) {
    case ActiveSequenceEvent::Kind::kAdd: {
      // Another replica's booking obeys this router's bounds, and names a rank it knows.
      const char* refused = nullptr;
      std::string detail;
      auto w = workers_.find(e->worker_id);
      const std::uint64_t max_blocks =
          (std::uint64_t{config_.max_prompt_tokens} + config_.block_size - 1) / config_.block_size;
      if (w == workers_.end() || e->dp_rank < w->second.reg.dp_start ||
          e->dp_rank - w->second.reg.dp_start >= w->second.reg.dp_size) {
        refused = "unknown_worker";
        detail = fmt::format("worker {} rank {} is not known here", e->worker_id, e->dp_rank);
      } else if (e->isl > config_.max_prompt_tokens || e->seq_hashes.size() > max_blocks) {
        refused = "too_long";
        detail = fmt::format("{} tokens / {} blocks exceed --router-max-prompt-tokens {}", e->isl,
                             e->seq_hashes.size(), config_.max_prompt_tokens);
      } else if (Status room = BookingRoomLocked(e->seq_hashes.size()); !room.ok()) {
        refused = "overloaded";
        detail = room.message();
      }
      if (refused) {
        ++replica_sync_refused_[refused];
        log_.Log(LogLevel::kWarning, "replica sync refused", "refused a replica booking ({}): {}", refused, detail);
        break;
      }
      const std::uint64_t cached = std::uint64_t{e->overlap_blocks} * config_.block_size;
      (void)load_.Book(e->request_id, worker, e->seq_hashes, e->isl > cached ? e->isl - cached : 0, clock_());
      break;
    }
    case ActiveSequenceEvent::Kind::kPrefillDone:
      if (load_.MarkPrefill(e->request_id)) DrainLocked(out);
      break;
    case ActiveSequenceEvent::Kind::kFree:
      if (load_.Free(e->request_id)) DrainLocked(out);
      break;
  }
  lk.unlock();
  Send(out);
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
  msgpack::sbuffer buf;
  Packer pk(buf);
  pk.pack_map(4);
  PackKey(pk, "worker_id"); pk.pack(worker.worker_id);
  PackKey(pk, "dp_rank"); pk.pack(worker.dp_rank);
  PackKey(pk, "active_decode_blocks"); pk.pack(load.active_blocks);
  PackKey(pk, "active_prefill_tokens"); pk.pack(load.active_prefill_tokens);
  (void)bus_.Publish(subjects_.kv_metrics, AsBytes(buf));
}

}  // namespace kvrouter
