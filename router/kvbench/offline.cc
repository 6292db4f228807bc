#include "router/kvbench/offline.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <list>
#include <map>
#include <queue>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include "events/block_hash.h"
#include "events/event_codec.h"
#include "events/registration_codec.h"
#include "events/router_endpoints_codec.h"
#include "events/msgpack_reader.h"
#include "events/subjects.h"
#include "events/worker_codec.h"
#include "events/worker_publisher.h"
#include "router/common/flags.h"
#include "router/service/kv_router_service.h"
#include "transport/memory_bus.h"

namespace kvrouter::bench {

namespace {

constexpr double kNever = std::numeric_limits<double>::infinity();

// One offline replay: the router service and the simulated engines on one in-memory bus and
// one virtual clock. Arrivals, engine step ends and engine wake-ups (a KV transfer's or a pin's
// lease's end, a leg given to an idle engine, pinned blocks released) are processed in time
// order. A disaggregated reply (docs/protocol.md section 13) runs as the gateway runs it: the
// prefill leg on the prefill engine; at its finish prefill_done and the decode leg, which pulls
// the pinned blocks, on the decode engine; the pull's end releases the pin.
class OfflineReplay {
 public:
  OfflineReplay(const std::vector<TraceRequest>& trace, const OfflineOptions& o)
      : trace_(trace), o_(o), records_(trace.size()) {}

  Result<Summary> Run() {
    if (Status s = Start(); !s.ok()) return s;
    const double t0 = trace_.empty() ? 0 : trace_.front().timestamp_ms;
    while (true) {
      const double t_arrival = next_ < trace_.size() ? trace_[next_].timestamp_ms - t0 : kNever;
      const double t_engine = engine_events_.empty() ? kNever : engine_events_.top().at_ms;
      if (t_arrival == kNever && t_engine == kNever) break;
      if (t_arrival <= t_engine) {
        now_ms_ = t_arrival;
        Arrive(next_++);
        CollectReplies();
        continue;
      }
      const EngineEvent ev = engine_events_.top();
      engine_events_.pop();
      now_ms_ = ev.at_ms;
      if (ev.kind == EngineEvent::kStepEnd) {
        EndStep(ev.engine);
      } else if (stepping_[ev.engine]) {
        continue;  // it steps again when its step ends, and fires its timers then
      }
      CollectReplies();
      StartStep(ev.engine);  // after the replies: requests routed to it join this step
    }
    for (auto& [i, p] : waiting_) records_[i].error = true;  // still queued when everything stopped
    Summary summary = Summarize(o_.label, records_, worker_ids_, o_.slo);
    SetTokenGaps(summary, gaps_);
    SetBusyTimes(summary, busy_ms_, pools_);
    ReadRouterStats(summary);
    return summary;
  }

 private:
  // The service, and engines registered as workers 1..N publishing their events through the
  // bus. A publisher per worker numbers them and serves the recovery endpoint (docs/protocol.md
  // section 6), as kvmocker does over NATS.
  Status Start() {
    if (Status s = CheckWorkerSpeedups(o_); !s.ok()) return s;
    if (Status s = CheckPrefillWorkers(o_.prefill_workers, o_.workers); !s.ok()) return s;
    std::vector<std::string> args = {"kvbench", "--block-size", std::to_string(o_.engine.block_size)};
    // The router's prior of the KV transfer is the engines' own, unless the run sets it.
    const auto given = [&](std::string_view flag) {
      return std::find(o_.router_flags.begin(), o_.router_flags.end(), flag) != o_.router_flags.end();
    };
    if (!given("--router-kv-bytes-per-token")) {
      args.insert(args.end(), {"--router-kv-bytes-per-token", std::to_string(o_.engine.kv_bytes_per_token)});
    }
    if (!given("--router-kv-transfer-gbps")) {
      args.insert(args.end(), {"--router-kv-transfer-gbps", fmt::format("{}", o_.engine.kv_transfer_gbps)});
    }
    args.insert(args.end(), o_.router_flags.begin(), o_.router_flags.end());
    std::vector<const char*> argv;
    for (auto& a : args) argv.push_back(a.c_str());
    auto cfg = ParseRouterConfig(static_cast<int>(argv.size()), argv.data(), [](const char*) { return nullptr; });
    if (!cfg.ok()) return cfg.status();
    svc_ = std::make_unique<KvRouterService>(
        cfg->config, bus_,
        [this] {
          return SteadyTime{} +
                 std::chrono::duration_cast<SteadyTime::duration>(std::chrono::duration<double, std::milli>(now_ms_));
        },
        o_.seed);
    if (Status s = svc_->Start(); !s.ok()) return s;
    for (std::uint32_t w = 0; w < o_.workers; ++w) {
      if (Status s = AddWorker(w, cfg->config); !s.ok()) return s;
    }
    return Status::Ok();
  }

  // Worker `index` (0-based) has id index + 1, its own engine speed, and its role: the first
  // prefill_workers are prefill workers, the rest decode workers (all `both` without any).
  Status AddWorker(std::uint32_t index, const RouterConfig& rc) {
    const Subjects& subj = svc_->subjects();
    const std::uint64_t worker_id = std::uint64_t{index} + 1;
    MockEngineConfig ec = o_.engine;
    if (!o_.worker_speedups.empty()) ec.speedup_ratio *= o_.worker_speedups[index];
    const WorkerRole role = o_.prefill_workers == 0      ? WorkerRole::kBoth
                            : index < o_.prefill_workers ? WorkerRole::kPrefill
                                                         : WorkerRole::kDecode;
    worker_ids_.push_back(worker_id);
    pools_.emplace_back(WorkerRoleName(role));
    KvEventPublisher& pub =
        *publishers_.emplace_back(std::make_unique<KvEventPublisher>(PublisherConfig{.worker_id = worker_id}));
    engines_.push_back(std::make_unique<MockEngine>(ec, [this, &subj, &pub](KvEventData&& d) {
      (void)bus_.Publish(subj.kv_events, AsBytes(EncodeDynamoEnvelope(pub.Publish(std::move(d)), {})));
    }));
    stepping_.push_back(false);
    timer_wake_ms_.push_back(kNever);
    busy_ms_.push_back(0);
    outputs_.emplace_back();
    auto sub =
        bus_.Subscribe(RecoverySubject(rc.ns, rc.component, worker_id, 0), "", [this, &pub](const BusMessage& m) {
          if (m.reply.empty()) return;
          const RecoveryReply r = pub.Answer(RecoveryQuery::Decode(m.data));
          auto parts = EncodeRecoveryReplyParts(r, bus_.MaxPayload());
          if (!parts.ok()) return;
          for (const auto& part : *parts) (void)bus_.Publish(m.reply, AsBytes(part));
        });
    if (!sub.ok()) return sub.status();
    recovery_.push_back(std::move(sub).value());
    WorkerRegistration reg{.worker_id = worker_id,
                           .block_size = ec.block_size,
                           .total_kv_blocks = ec.num_gpu_blocks,
                           .max_num_seqs = ec.max_num_seqs,
                           .max_num_batched_tokens = ec.max_num_batched_tokens,
                           .lease_ms = std::numeric_limits<std::uint32_t>::max(),
                           .role = role};
    (void)bus_.Publish(subj.instances, AsBytes(EncodeWorkerRegistration(reg)));
    return Status::Ok();
  }

  // Request i arrives: ask the router (it may queue it; the reply is collected later).
  void Arrive(std::size_t i) {
    records_[i].arrival_ms = now_ms_;
    records_[i].prompt_tokens = trace_[i].input_length;
    records_[i].output_tokens = std::max<std::uint32_t>(1, trace_[i].output_length);
    svc_->index().Flush();  // every event published so far is in the index
    RouteRequest req{.request_id = fmt::format("r{}", i), .token_ids = TokensFor(trace_[i]), .has_token_ids = true};
    req.isl = static_cast<std::uint32_t>(req.token_ids.size());
    index_of_[req.request_id] = i;
    waiting_.emplace(i, bus_.RequestAsync(svc_->subjects().route, AsBytes(EncodeRouteRequest(req))));
  }

  // Engine e's step ends at now_ms_: its outputs drive the requests' lifecycle at the router.
  void EndStep(std::size_t e) {
    stepping_[e] = false;
    HandleOutputs(e);
  }

  // Engine e's outputs (of a step that ended, or of one that computed nothing), each request's
  // lifecycle at the router as a gateway drives it.
  void HandleOutputs(std::size_t e) {
    const Subjects& subj = svc_->subjects();
    for (const EngineOutput& out : outputs_[e]) {
      const std::size_t i = index_of_[out.id];
      if (const auto leg = prefill_legs_.find(i); leg != prefill_legs_.end() && leg->second.prefill_engine == e) {
        PrefillLegOutput(i, out);
        continue;
      }
      if (out.kind == EngineOutput::kFirstToken) {
        records_[i].first_token_ms = out.at_ms;
        // A disaggregated request's cached tokens are the prefill engine's (taken at its leg).
        if (!disaggregated_.contains(i)) records_[i].cached_tokens = out.cached_tokens;
        (void)bus_.Request(subj.mark_prefill, AsBytes(EncodeLifecycleRequest(out.id)));
        continue;
      }
      if (out.kind == EngineOutput::kPulled || out.kind == EngineOutput::kToken) continue;  // see StartStep
      disaggregated_.erase(i);
      if (out.kind == EngineOutput::kRejected) {
        records_[i].error = true;  // larger than the whole cache
        (void)bus_.Request(subj.free, AsBytes(EncodeLifecycleRequest(out.id)));
      } else {
        records_[i].finished_ms = out.at_ms;
        // Freed with the engine's timing, as the gateway and the generate relay free theirs:
        // from the engine taking the request to its first token, then the mean token gap.
        const RequestRecord& rec = records_[i];
        const std::uint32_t tokens = std::max<std::uint32_t>(1, trace_[i].output_length);
        const double gap = tokens > 1 ? (rec.finished_ms - rec.first_token_ms) / (tokens - 1) : 0;
        const ResponseTiming timing{.ttfb_ms = rec.first_token_ms - routed_ms_[i],
                                    .chunks = tokens,
                                    .inter_chunk_ms_mean = gap,
                                    .inter_chunk_ms_max = gap};
        (void)bus_.Request(subj.free, AsBytes(EncodeLifecycleRequest(out.id, timing)));
      }
      Done();
    }
  }

  // An output of request i's prefill leg (on its prefill engine).
  void PrefillLegOutput(std::size_t i, const EngineOutput& out) {
    const Subjects& subj = svc_->subjects();
    if (out.kind == EngineOutput::kFirstToken) {
      records_[i].cached_tokens = out.cached_tokens;  // the prompt tokens not prefilled
      return;
    }
    if (out.kind == EngineOutput::kRejected) {
      prefill_legs_.erase(i);
      disaggregated_.erase(i);
      records_[i].error = true;
      (void)bus_.Request(subj.free, AsBytes(EncodeLifecycleRequest(out.id)));
      Done();
      return;
    }
    if (out.kind != EngineOutput::kFinished) return;
    // The gateway's step between the legs: prefill_done, then the decode leg, which pulls the
    // blocks the prefill engine pinned for it.
    const PrefillLeg leg = prefill_legs_.at(i);
    prefill_legs_.erase(i);
    (void)bus_.Request(subj.prefill_done, AsBytes(EncodeLifecycleRequest(out.id)));
    auto tokens = TokensFor(trace_[i]);
    KvPull transfer{.source_worker_id = worker_ids_[leg.prefill_engine],
                    .source_request_id = out.id,
                    .blocks = ComputeSequenceHashes(ComputeLocalHashes(tokens, o_.engine.block_size))};
    engines_[leg.decode_engine]->Add({.id = out.id,
                                      .tokens = std::move(tokens),
                                      .max_tokens = std::max<std::uint32_t>(1, trace_[i].output_length),
                                      .leg = EngineLeg::kDecode,
                                      .transfer = std::move(transfer)});
    routed_ms_[i] = now_ms_;  // the decode leg's call, which its timing at free is taken from
    pulling_from_[out.id] = leg.prefill_engine;
    WakeNow(leg.decode_engine);
  }

  void Done() {
    if (o_.progress && ++done_ % std::max<std::size_t>(1, trace_.size() / 10) == 0) {
      fmt::print(stderr, "kvbench {}: {}/{} requests done\n", o_.label, done_, trace_.size());
    }
  }

  // Engine e, not stepping, steps at now_ms_ if it has anything to compute.
  void StartStep(std::size_t e) {
    MockEngine& engine = *engines_[e];
    if (stepping_[e] || engine.Idle()) return;
    outputs_[e].clear();
    const double d = engine.Step(now_ms_, outputs_[e]);
    ReleasePulled(e);
    if (d > 0) {
      busy_ms_[e] += d;
      // An engine with running requests steps back to back (this runs when its last step
      // ended), so each later token of this step came d after its request's previous one.
      gaps_.Add(d, engine.last_step_tokens());
      stepping_[e] = true;
      engine_events_.push({now_ms_ + d, e, EngineEvent::kStepEnd});
      return;
    }
    // Nothing computes: its outputs (rejections) are due now, and it waits for its next timer
    // (or a leg or a release, which wake it).
    HandleOutputs(e);
    if (const auto t = engine.NextTimerMs()) {
      // A timer is always after now; the bound keeps a timer due now from waking it forever.
      const double at = std::max(*t, std::nextafter(now_ms_, kNever));
      if (timer_wake_ms_[e] != at) {
        timer_wake_ms_[e] = at;
        engine_events_.push({at, e, EngineEvent::kWake});
      }
    }
  }

  // Engine e steps at now_ms_ (after the replies of this moment) unless a step is under way.
  void WakeNow(std::size_t e) {
    if (!stepping_[e]) engine_events_.push({now_ms_, e, EngineEvent::kWake});
  }

  // Decode legs whose pull ended (kPulled, due at once): the prefill engine's pin is released,
  // which may let it admit what waited for room.
  void ReleasePulled(std::size_t e) {
    for (const EngineOutput& out : outputs_[e]) {
      if (out.kind != EngineOutput::kPulled) continue;
      const auto from = pulling_from_.find(out.id);
      if (from == pulling_from_.end()) continue;
      (void)engines_[from->second]->ReleasePinned(out.id);
      WakeNow(from->second);
      pulling_from_.erase(from);
    }
  }

  // From the router's stats (every page): its P/D decision counts (docs/protocol.md section 13;
  // none when it reports none), and the bookings left on its ranks.
  void ReadRouterStats(Summary& summary) {
    BookingsLeft left;
    std::optional<std::uint64_t> next = 0;
    while (next) {
      const auto reply = bus_.Request(svc_->subjects().stats,
                                      AsBytes(EncodeStatsRequest({.offset = *next, .limit = StatsRequest::kMaxLimit})));
      if (!reply) return;
      auto stats = DecodeStatsReply(*reply);
      if (!stats.ok()) return;
      if (const auto it = stats->breakdowns.find(std::string(kDisaggDecisions)); it != stats->breakdowns.end()) {
        summary.disagg_decisions = it->second;
      }
      for (const WorkerStats& w : stats->workers) {
        left.requests += w.active_requests;
        left.prefill_tokens += w.active_prefill_tokens;
        left.blocks += w.active_blocks;
      }
      next = stats->next_offset;
    }
    summary.bookings_left = left;
  }

  // Routed requests go to their engine.
  void CollectReplies() {
    for (auto it = waiting_.begin(); it != waiting_.end();) {
      if (!it->second.reply->has_value()) {
        ++it;
        continue;
      }
      const std::size_t i = it->first;
      auto r = DecodeRouteReply(**it->second.reply);
      it = waiting_.erase(it);
      if (!r.ok()) {
        records_[i].error = true;
        continue;
      }
      const std::string id = fmt::format("r{}", i);
      const std::optional<std::size_t> e = EngineOf(r->worker_id);
      const std::optional<std::size_t> p = r->disaggregated ? EngineOf(r->prefill_worker_id) : e;
      if (!e || !p) {  // a worker this replay did not register
        records_[i].error = true;
        (void)bus_.Request(svc_->subjects().free, AsBytes(EncodeLifecycleRequest(id)));
        continue;
      }
      records_[i].worker_id = r->worker_id;
      routed_ms_[i] = now_ms_;
      if (r->disaggregated) {
        prefill_legs_[i] = {.prefill_engine = *p, .decode_engine = *e};
        disaggregated_.insert(i);
        engines_[*p]->Add({.id = id, .tokens = TokensFor(trace_[i]), .max_tokens = 1, .leg = EngineLeg::kPrefill});
        StartStep(*p);
        continue;
      }
      engines_[*e]->Add({.id = id,
                         .tokens = TokensFor(trace_[i]),
                         .max_tokens = std::max<std::uint32_t>(1, trace_[i].output_length)});
      StartStep(*e);
    }
  }

  std::optional<std::size_t> EngineOf(std::uint64_t worker_id) const {
    if (worker_id < 1 || worker_id > engines_.size()) return std::nullopt;
    return static_cast<std::size_t>(worker_id - 1);
  }

  const std::vector<TraceRequest>& trace_;
  const OfflineOptions& o_;
  double now_ms_ = 0;
  InMemoryBus bus_;
  std::unique_ptr<KvRouterService> svc_;
  std::vector<std::unique_ptr<KvEventPublisher>> publishers_;
  std::vector<std::unique_ptr<MockEngine>> engines_;
  std::vector<std::unique_ptr<BusSubscription>> recovery_;  // after publishers: destroyed first
  std::vector<std::uint64_t> worker_ids_;
  std::vector<RequestRecord> records_;
  std::unordered_map<std::size_t, double> routed_ms_;  // when the engine took request i
  std::unordered_map<std::string, std::size_t> index_of_;
  // An engine's step end, or a wake-up to step if it can; earliest first, then by engine.
  struct EngineEvent {
    enum Kind { kStepEnd, kWake };
    double at_ms = 0;
    std::size_t engine = 0;
    Kind kind = kStepEnd;
    bool operator>(const EngineEvent& o) const {
      return std::tie(at_ms, engine, kind) > std::tie(o.at_ms, o.engine, o.kind);
    }
  };
  std::priority_queue<EngineEvent, std::vector<EngineEvent>, std::greater<EngineEvent>> engine_events_;
  std::vector<bool> stepping_;
  std::vector<double> timer_wake_ms_;  // per engine: the timer wake-up last queued (dedupes them)
  // Disaggregated requests: their prefill leg in flight, the prefill engine a decode leg pulls
  // from (by request id, until its kPulled), and every one until it ends.
  struct PrefillLeg {
    std::size_t prefill_engine = 0;
    std::size_t decode_engine = 0;
  };
  std::unordered_map<std::size_t, PrefillLeg> prefill_legs_;
  std::unordered_map<std::string, std::size_t> pulling_from_;
  std::unordered_set<std::size_t> disaggregated_;
  std::vector<double> busy_ms_;     // per engine: the durations of the steps it ran, summed
  std::vector<std::string> pools_;  // per engine: its worker's role name
  TokenGaps gaps_;                  // every later token's gap since its request's previous one
  std::vector<std::vector<EngineOutput>> outputs_;
  std::map<std::size_t, InMemoryBus::PendingRequest> waiting_;  // queued in the router
  std::size_t next_ = 0;
  std::size_t done_ = 0;
};

}  // namespace

Status CheckWorkerSpeedups(const OfflineOptions& o) {
  if (o.worker_speedups.empty()) return Status::Ok();
  if (o.worker_speedups.size() != o.workers) {
    return InvalidArgument(
        fmt::format("--worker-speedups has {} values for {} workers (--workers): give one per worker",
                    o.worker_speedups.size(), o.workers));
  }
  for (double v : o.worker_speedups) {
    if (!(v > 0) || !std::isfinite(v) || !std::isfinite(v * o.engine.speedup_ratio)) {
      return FlagOutOfRange("worker-speedups", fmt::format("a finite number > 0 for every worker (got {})", v));
    }
  }
  return Status::Ok();
}

Status CheckPrefillWorkers(std::uint32_t prefill_workers, std::uint32_t workers, std::string_view workers_flag) {
  if (prefill_workers < workers) return Status::Ok();
  return InvalidArgument(
      fmt::format("--prefill-workers {} needs more workers than that ({} {}): the workers after the first {} are the "
                  "decode workers, and a disaggregated fleet needs at least one",
                  prefill_workers, workers_flag, workers, prefill_workers));
}

Result<Summary> RunOffline(const std::vector<TraceRequest>& trace, const OfflineOptions& options) {
  return OfflineReplay(trace, options).Run();
}

double PooledLruHitRate(const std::vector<TraceRequest>& trace, std::uint64_t total_blocks, std::uint32_t block_size) {
  std::list<SequenceHash> lru;  // front = least recently used
  std::unordered_map<SequenceHash, std::list<SequenceHash>::iterator> where;
  double prompt = 0, cached = 0;
  for (const TraceRequest& r : trace) {
    const auto seq = ComputeSequenceHashes(ComputeLocalHashes(TokensFor(r), block_size));
    std::size_t hits = 0;
    while (hits < seq.size() && where.count(seq[hits])) ++hits;
    prompt += r.input_length;
    cached += static_cast<double>(hits) * block_size;
    for (SequenceHash h : seq) {
      auto it = where.find(h);
      if (it != where.end()) {
        lru.splice(lru.end(), lru, it->second);
        continue;
      }
      lru.push_back(h);
      where[h] = std::prev(lru.end());
      if (lru.size() > total_blocks) {
        where.erase(lru.front());
        lru.pop_front();
      }
    }
  }
  return prompt > 0 ? cached / prompt : 0;
}

}  // namespace kvrouter::bench
