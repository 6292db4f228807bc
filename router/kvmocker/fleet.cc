#include "router/kvmocker/fleet.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <random>
#include <utility>

#include "events/event_codec.h"
#include "events/registration_codec.h"
#include "events/msgpack_reader.h"
#include "events/subjects.h"
#include "router/common/metrics.h"
#include "events/vllm_codec.h"
#include "transport/http_client.h"
#include "transport/http_io.h"
#include "transport/http_listener.h"

namespace kvrouter {

namespace {

constexpr double kInfinity = std::numeric_limits<double>::infinity();

double UnixSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::uint64_t UnixMs() {
  return static_cast<std::uint64_t>(
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count());
}

// The k-th generated token of every NATS request (the mock generates no real text).
std::uint32_t FakeToken(std::uint32_t k) { return 1 + k % 127; }

// The longest prompt an engine can ever admit, for the HTTP face's context-length check.
std::uint32_t MaxModelLen(const MockerConfig& c) {
  return static_cast<std::uint32_t>(std::min<std::uint64_t>(std::uint64_t{c.num_gpu_blocks} * c.block_size,
                                                            std::numeric_limits<std::uint32_t>::max()));
}

// request_id of an undecodable request when it can still be read, else "".
std::string PeekRequestId(std::span<const std::byte> body) {
  auto doc = ParseMsgpack(body);
  if (!doc.ok()) return {};
  auto id = ReadStr(FindKey(doc->get(), "request_id"), "request_id");
  return id.ok() ? std::string(*id) : std::string();
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// MockWorkerFleet.

MockWorkerFleet::MockWorkerFleet(MockerConfig config, NatsClient& nats)
    : config_(std::move(config)),
      nats_(nats),
      kv_events_subject_(KvEventsSubject(config_.ns, config_.component)),
      instances_subject_(InstancesSubject(config_.ns, config_.component)),
      start_(std::chrono::steady_clock::now()),
      log_(std::chrono::seconds(10), nullptr,
           [](LogLevel, std::string_view line) {
             // RateLimitedLog writes "kvrouter <level> [key] ...": this process is kvmocker.
             if (line.starts_with("kvrouter ")) line.remove_prefix(9);
             fmt::print(stderr, "kvmocker {}\n", line);
           }),
      face_({.model = config_.model, .max_model_len = MaxModelLen(config_)}) {
  std::uint64_t base = 0;
  if (config_.worker_id_base) {
    base = *config_.worker_id_base;
  } else {
    std::random_device rd;
    const std::uint64_t r = (static_cast<std::uint64_t>(rd()) << 32) | rd();
    base = 1 + r % ((std::uint64_t{1} << 48) - 1 - config_.num_workers);
  }
  KvMutexLock g(engine_mu_);
  for (std::uint32_t w = 0; w < config_.num_workers; ++w) {
    worker_ids_.push_back(base + w);
    envelope_seq_.push_back(0);
    for (std::uint32_t d = 0; d < config_.dp_size; ++d) {
      auto rank = std::make_unique<Rank>();
      rank->worker_index = w;
      rank->dp_rank = d;
      rank->vllm_events_subject = VllmEventsSubject(config_.ns, config_.component, base + w, d);
      Rank* r = rank.get();
      rank->publisher = std::make_unique<KvEventPublisher>(PublisherConfig{.worker_id = base + w, .dp_rank = d});
      rank->engine = std::make_unique<MockEngine>(WorkerEngineConfig(config_, w), [this, r](KvEventData&& data) {
        engine_mu_.AssertHeld();  // the engine calls its sink from Step, under engine_mu_
        PublishEvent(*r, r->publisher->Publish(std::move(data)));
      });
      ranks_.push_back(std::move(rank));
    }
  }
}

MockWorkerFleet::~MockWorkerFleet() { Stop(); }

double MockWorkerFleet::NowMs() const {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_).count();
}

MockWorkerFleet::Counters MockWorkerFleet::counters() const {
  return {.requests = requests_.load(),
          .bad_requests = bad_requests_.load(),
          .inbox_full = inbox_full_.load(),
          .events = events_.load(),
          .publish_failures = publish_failures_.load(),
          .http_requests = http_requests_.load(),
          .http_errors = http_errors_.load(),
          .aborted = aborted_.load(),
          .invalid_transfers = invalid_transfers_.load(),
          .pull_notice_failures = pull_notice_failures_.load(),
          .bootstrap_failures = bootstrap_failures_.load()};
}

std::string MockWorkerFleet::MetricsText() {
  MetricSet m;
  const Counters c = counters();
  m.Counter("kvmocker_requests_total", "generate requests accepted", static_cast<double>(c.requests));
  m.Counter("kvmocker_bad_requests_total", "undecodable or out-of-range requests and queries",
            static_cast<double>(c.bad_requests));
  m.Counter("kvmocker_requests_refused_total", "requests refused because the inbox was full",
            static_cast<double>(c.inbox_full));
  m.Counter("kvmocker_events_published_total", "KV event messages published", static_cast<double>(c.events));
  m.Counter("kvmocker_publish_failures_total", "publishes that failed", static_cast<double>(c.publish_failures));
  m.Counter("kvmocker_http_requests_total", "HTTP generations accepted", static_cast<double>(c.http_requests));
  m.Counter("kvmocker_http_errors_total", "HTTP requests answered with an error status",
            static_cast<double>(c.http_errors));
  m.Counter("kvmocker_requests_aborted_total", "HTTP generations whose client went away before the end",
            static_cast<double>(c.aborted));
  m.Counter("kvmocker_invalid_kv_transfers_total",
            "decode legs whose kv_transfer_params were missing or bad: prefilled locally",
            static_cast<double>(c.invalid_transfers));
  m.Counter("kvmocker_kv_pull_notice_failures_total", "kv_pulled notices a prefill process did not take",
            static_cast<double>(c.pull_notice_failures));
  m.Counter("kvmocker_bootstrap_failures_total", "SGLang decode legs failed because their bootstrap room never came",
            static_cast<double>(c.bootstrap_failures));
  m.Gauge("kvmocker_outstanding_requests", "generate requests not finished", static_cast<double>(outstanding_.load()));
  KvMutexLock g(engine_mu_);
  for (const auto& r : ranks_) {
    const MetricLabels l = {{"worker_id", std::to_string(worker_ids_[r->worker_index])},
                            {"dp_rank", std::to_string(r->dp_rank)}};
    m.Gauge("kvmocker_cached_blocks", "KV blocks holding content (active and evictable)",
            static_cast<double>(r->engine->CachedBlocks()), l);
    m.Gauge("kvmocker_active_blocks", "KV blocks referenced by running requests",
            static_cast<double>(r->engine->ActiveBlocks()), l);
    m.Gauge("kvmocker_running_requests", "requests running", static_cast<double>(r->engine->NumRunning()), l);
    m.Gauge("kvmocker_waiting_requests", "requests waiting for room", static_cast<double>(r->engine->NumWaiting()), l);
    m.Gauge("kvmocker_pinned_blocks", "KV blocks a prefill engine holds for pulls not yet done (each block once)",
            static_cast<double>(r->engine->PinnedBlocks()), l);
    m.Counter("kvmocker_local_prefills_on_invalid_transfer_total",
              "decode legs run as local prefills: transfer missing or its blocks unequal to the prompt's",
              static_cast<double>(r->engine->local_prefills_on_invalid_transfer()), l);
  }
  return RenderMetrics(m.Take());
}

Status MockWorkerFleet::Start() {
  if (started_) return Internal("MockWorkerFleet already started");
  // The ports listen before any registration names them.
  if (Status s = StartHttp(); !s.ok()) return s;
  started_ = true;
  for (std::size_t w = 0; w < worker_ids_.size(); ++w) {
    auto sub = nats_.Subscribe(WorkerGenerateSubject(config_.ns, config_.component, worker_ids_[w]), "",
                               [this, w](const IncomingMessage& m) { OnGenerate(w, m); });
    if (!sub.ok()) return sub.status();
    subscriptions_.push_back(std::move(sub).value());
    for (std::uint32_t d = 0; d < config_.dp_size; ++d) {
      const std::size_t index = w * config_.dp_size + d;
      auto q = nats_.Subscribe(RecoverySubject(config_.ns, config_.component, worker_ids_[w], d), "",
                               [this, index](const IncomingMessage& m) { OnRecovery(index, m); });
      if (!q.ok()) return q.status();
      subscriptions_.push_back(std::move(q).value());
    }
  }
  // The endpoints are known to the server before the router hears of the workers (it may ask
  // for a dump at once). Not connected yet (retry_on_failed_connect): nats.c sends both later.
  (void)nats_.Flush(std::chrono::seconds(2));
  PublishRegistrations(WorkerStatus::kUp);
  engine_thread_ = std::thread([this] { EngineLoop(); });
  return Status::Ok();
}

void MockWorkerFleet::Stop() {
  if (!started_ || stopped_) return;
  stopped_ = true;
  // The engine thread (which also sends heartbeats) stops first, so no heartbeat can follow
  // `leaving`. From here on the inbox takes nothing: requests are answered where they arrive.
  {
    KvMutexLock g(inbox_mu_);
    stopping_ = true;
  }
  inbox_cv_.notify_all();
  if (engine_thread_.joinable()) engine_thread_.join();
  PublishRegistrations(WorkerStatus::kLeaving);
  subscriptions_.clear();  // no handler runs after this

  // Nobody will finish these: tell their clients instead of letting them time out.
  std::vector<GenerateJob> queued;
  {
    KvMutexLock g(inbox_mu_);
    queued.swap(inbox_);
    aborts_.clear();
  }
  std::size_t http_answers = 0;
  for (GenerateJob& j : queued) http_answers += AnswerShutdown(j.target);
  {
    KvMutexLock g(engine_mu_);
    for (auto& [id, f] : in_flight_) http_answers += AnswerShutdown(f.target);
    in_flight_.clear();
  }
  {
    KvMutexLock g(rooms_mu_);
    for (auto& [room, r] : rooms_) {
      const FaceResponse gone = OpenAiError(503, "unavailable", "the prefill worker is shutting down");
      for (const auto& waiter : r.waiters) waiter->Send(gone.status, {{"content-type", gone.content_type}}, gone.body);
      http_answers += r.waiters.size();
    }
    rooms_.clear();
  }
  queued.clear();
  StopHttp(http_answers > 0 ? kHttpAnswerGrace : std::chrono::milliseconds(0));
  (void)nats_.Flush(std::chrono::seconds(2));
}

void MockWorkerFleet::AnswerOverloaded(ReplyTarget& target) {
  if (auto* nats = std::get_if<NatsTarget>(&target)) {
    RespondError(nats->reply, nats->request_id, "overloaded: worker inbox full");
  } else {
    FailHttp(std::get<HttpTarget>(target), 503, "overloaded", "worker inbox full: retry later");
  }
}

bool MockWorkerFleet::AnswerShutdown(ReplyTarget& target) {
  if (auto* nats = std::get_if<NatsTarget>(&target)) {
    RespondError(nats->reply, nats->request_id, "worker shutting down");
    return false;
  }
  FailHttp(std::get<HttpTarget>(target), 503, "unavailable", "worker shutting down");
  return true;
}

MockWorkerFleet::Admission MockWorkerFleet::Enqueue(GenerateJob& job) {
  {
    KvMutexLock g(inbox_mu_);
    if (stopping_) return Admission::kStopping;
    // Bounded by every request not yet finished, wherever it is (inbox, engine queue, running).
    if (outstanding_.load() >= kMaxOutstanding) {
      ++inbox_full_;
    } else {
      ++outstanding_;
      inbox_.push_back(std::move(job));
      inbox_cv_.notify_one();
      return Admission::kQueued;
    }
  }
  log_.Log(LogLevel::kWarning, "inbox-full", "{} requests outstanding: refusing", kMaxOutstanding);
  return Admission::kFull;
}

void MockWorkerFleet::PublishRegistrations(WorkerStatus status) {
  for (std::uint32_t worker = 0; worker < worker_ids_.size(); ++worker) {
    const std::uint64_t id = worker_ids_[worker];
    const WorkerRegistration reg{
        .worker_id = id,
        .dp_start = 0,
        .dp_size = config_.dp_size,
        .block_size = config_.block_size,
        .total_kv_blocks = config_.num_gpu_blocks,
        .max_num_seqs = config_.max_num_seqs,
        .max_num_batched_tokens = config_.max_num_batched_tokens,
        .device = config_.device,
        .lease_ms = config_.lease_ms,
        .leaving = status == WorkerStatus::kLeaving,
        .http_url = WorkerHttpUrl(config_, worker),
        .models = config_.http_port > 0 ? std::vector<std::string>{config_.model} : std::vector<std::string>{},
        .role = config_.role,
        .kv_connector = config_.kv_connector,
        .bootstrap_port = config_.bootstrap_port};
    CountPublish(nats_.Publish(instances_subject_, AsBytes(EncodeWorkerRegistration(reg))), "registration");
  }
}

void MockWorkerFleet::CountPublish(const Status& s, std::string_view what) {
  if (s.ok()) return;
  ++publish_failures_;
  log_.Log(LogLevel::kWarning, fmt::format("publish-{}", what), "cannot publish {}: {}", what, s.message());
}

// ---------------------------------------------------------------------------------------------
// NATS delivery threads.

void MockWorkerFleet::OnGenerate(std::size_t worker_index, const IncomingMessage& m) {
  if (m.reply.empty()) {
    ++bad_requests_;
    log_.Log(LogLevel::kWarning, "generate-no-reply", "dropped a generate request on {} without a reply subject",
             m.subject);
    return;
  }
  auto req = GenerateRequest::Decode(m.data);
  if (req.ok() && req->dp_rank >= config_.dp_size) {
    req = InvalidArgument(fmt::format("dp_rank {} is not served (dp_size {})", req->dp_rank, config_.dp_size));
  }
  if (!req.ok()) {
    ++bad_requests_;
    log_.Log(LogLevel::kWarning, "generate-bad", "bad generate request on {}: {}", m.subject, req.status().message());
    RespondError(m.reply, PeekRequestId(m.data), req.status().message());
    return;
  }
  GenerateJob job{.id = ++next_job_id_,
                  .worker_index = worker_index,
                  .dp_rank = req->dp_rank,
                  .tokens = std::move(req->token_ids),
                  .max_tokens = req->max_tokens,
                  .target = NatsTarget{.reply = std::string(m.reply), .request_id = std::move(req->request_id)},
                  .arrival_ms = NowMs()};
  switch (Enqueue(job)) {  // moved from only when queued
    case Admission::kQueued: ++requests_; break;
    case Admission::kFull: AnswerOverloaded(job.target); break;
    case Admission::kStopping: AnswerShutdown(job.target); break;
  }
}

void MockWorkerFleet::OnRecovery(std::size_t rank_index, const IncomingMessage& m) {
  if (m.reply.empty()) {
    ++bad_requests_;
    return;
  }
  const auto query = RecoveryQuery::Decode(m.data);
  RecoveryReply reply;
  {
    KvMutexLock g(engine_mu_);
    reply = ranks_[rank_index]->publisher->Answer(query);
  }
  if (!query.ok()) {
    ++bad_requests_;
    log_.Log(LogLevel::kWarning, "recovery-bad", "bad recovery query on {}: {}", m.subject, query.status().message());
  }
  // A large dump goes in parts that each fit the server's max payload.
  auto parts = EncodeRecoveryReplyParts(reply, nats_.MaxPayload());
  Status s = parts.status();
  for (std::size_t i = 0; s.ok() && i < parts->size(); ++i) s = nats_.Respond(m, AsBytes((*parts)[i]));
  if (!s.ok()) {
    CountPublish(s, "recovery-reply");
    RecoveryReply error{
        .kind = "error", .last_event_id = reply.last_event_id, .message = "cannot send the reply: " + s.message()};
    (void)nats_.Respond(m, AsBytes(EncodeRecoveryReply(error)));
  }
}

// ---------------------------------------------------------------------------------------------
// Engine thread.

void MockWorkerFleet::EngineLoop() {
  using Ms = std::chrono::duration<double, std::milli>;
  std::vector<GenerateJob> jobs;
  std::vector<std::uint64_t> aborts;
  double next_heartbeat = NowMs() + config_.heartbeat_ms;
  inbox_mu_.lock();  // explicit lock / unlock: the thread-safety analysis follows them
  while (!stopping_) {
    jobs.swap(inbox_);
    aborts.swap(aborts_);
    inbox_mu_.unlock();
    double wake = 0;
    {
      KvMutexLock g(engine_mu_);
      wake = AdvanceEngines(jobs, aborts, NowMs());
    }
    jobs.clear();
    aborts.clear();
    const double now = NowMs();
    if (now >= next_heartbeat) {
      PublishRegistrations(WorkerStatus::kUp);
      next_heartbeat += config_.heartbeat_ms;
      if (next_heartbeat <= now) next_heartbeat = now + config_.heartbeat_ms;  // fell behind
    }
    wake = std::min(wake, next_heartbeat);
    inbox_mu_.lock();
    inbox_cv_.wait_until(inbox_mu_, start_ + std::chrono::duration_cast<std::chrono::steady_clock::duration>(Ms(wake)),
                         [&] {
                           inbox_mu_.AssertHeld();
                           return stopping_ || !inbox_.empty() || !aborts_.empty();
                         });
  }
  inbox_mu_.unlock();
}

double MockWorkerFleet::AdvanceEngines(std::vector<GenerateJob>& jobs, const std::vector<std::uint64_t>& aborts,
                                       double now_ms) {
  for (GenerateJob& j : jobs) {
    const std::string id = std::to_string(j.id);
    const std::size_t rank_index =
        j.dp_rank ? j.worker_index * config_.dp_size + *j.dp_rank : LeastBusyRank(j.worker_index);
    const EngineLeg leg = j.legs.leg;
    in_flight_.emplace(id, InFlight{.rank_index = rank_index,
                                    .target = std::move(j.target),
                                    .arrival_ms = j.arrival_ms,
                                    .max_tokens = j.max_tokens,
                                    .legs = std::move(j.legs)});
    ranks_[rank_index]->engine->Add({.id = id,
                                     .tokens = std::move(j.tokens),
                                     .max_tokens = j.max_tokens,
                                     .mm_items = std::move(j.mm_items),
                                     .leg = leg,
                                     .transfer = std::move(j.transfer)});
  }
  // After the jobs: a job and its abort may come in the same batch.
  for (std::uint64_t job : aborts) {
    const auto it = in_flight_.find(std::to_string(job));
    if (it == in_flight_.end()) continue;  // finished before its client went away
    // Its outputs of a step in progress find no InFlight and are dropped.
    MockEngine& engine = *ranks_[it->second.rank_index]->engine;
    // A prefill leg whose step has run but not ended (real time) is already pinned in the engine:
    // nobody will learn of the pin, so it goes too.
    if (!engine.Abort(it->first) && it->second.legs.leg == EngineLeg::kPrefill) (void)engine.ReleasePinned(it->first);
    if (it->second.legs.room) PublishRoom(*it->second.legs.room, std::nullopt, 0, "its prefill leg was cancelled");
    // A decode leg cancelled before its pull ended pulls nothing more: the prefill engine need
    // not hold the blocks until its lease.
    if (it->second.legs.source && !it->second.pulled) TellPulled(*it->second.legs.source);
    in_flight_.erase(it);
    --outstanding_;
    ++aborted_;
  }

  double earliest = kInfinity;
  for (auto& rank : ranks_) {
    Rank& r = *rank;
    // Back-to-back steps continue from the previous step's end (not from when this thread
    // woke), so wake-up latency does not stretch virtual time; the loop catches up when late.
    // A step that computes nothing (the engine waits for a KV transfer or a lease) ends at once;
    // the engine is stepped again at its next timer (MockEngine's contract), at the timer's own
    // time when the thread woke after it.
    double cursor = now_ms;
    for (;;) {
      if (r.stepping) {
        if (r.step_end_ms > now_ms) break;
        DeliverOutputs(r);
        r.stepping = false;
        cursor = r.step_end_ms;
      }
      if (r.engine->Idle()) break;
      r.outputs.clear();
      const double duration = r.engine->Step(cursor, r.outputs);
      if (duration > 0) {
        r.step_end_ms = cursor + duration;
        r.stepping = true;
        continue;
      }
      DeliverOutputs(r);  // a pull's end or a rejection: due at once
      const std::optional<double> timer = r.engine->NextTimerMs();
      if (!timer || *timer > now_ms) break;
      cursor = *timer;  // later than cursor: Step fired every timer up to it
    }
    if (r.stepping) {
      earliest = std::min(earliest, r.step_end_ms);
    } else if (const std::optional<double> timer = r.engine->NextTimerMs()) {
      earliest = std::min(earliest, *timer);
    }
  }
  return earliest;
}

std::size_t MockWorkerFleet::LeastBusyRank(std::size_t worker_index) {
  const std::size_t first = worker_index * config_.dp_size;
  std::size_t best = first;
  std::size_t best_load = std::numeric_limits<std::size_t>::max();
  for (std::size_t r = first; r < first + config_.dp_size; ++r) {
    const MockEngine& e = *ranks_[r]->engine;
    if (const std::size_t load = e.NumRunning() + e.NumWaiting(); load < best_load) {
      best = r;
      best_load = load;
    }
  }
  return best;
}

void MockWorkerFleet::DeliverOutputs(Rank& rank) {
  for (const EngineOutput& o : rank.outputs) {
    auto it = in_flight_.find(o.id);
    if (it == in_flight_.end()) continue;  // aborted while its step ran
    InFlight& f = it->second;
    if (o.kind == EngineOutput::kFirstToken) f.first_token_ms = o.at_ms;
    if (o.kind == EngineOutput::kPulled && f.legs.source) {
      f.pulled = true;
      TellPulled(*f.legs.source);
    }
    if (auto* nats = std::get_if<NatsTarget>(&f.target)) {
      AnswerNats(*nats, f, o);
    } else {
      AnswerHttp(std::get<HttpTarget>(f.target), f, o);
    }
    if (o.kind == EngineOutput::kFinished || o.kind == EngineOutput::kRejected) {
      in_flight_.erase(it);
      --outstanding_;
    }
  }
  rank.outputs.clear();
}

void MockWorkerFleet::AnswerNats(const NatsTarget& target, const InFlight& f, const EngineOutput& o) {
  switch (o.kind) {
    case EngineOutput::kFirstToken:
      Respond(target.reply, {.request_id = target.request_id, .token_ids = {FakeToken(0)}, .index = 0});
      break;
    case EngineOutput::kToken: break;   // section 7 answers the first token and the rest at the end
    case EngineOutput::kPulled: break;  // the engine's KV pull: nothing for the client
    case EngineOutput::kFinished: {
      GenerateResponse fin{.request_id = target.request_id,
                           .index = 1,
                           .finish_reason = "length",
                           .cached_tokens = o.cached_tokens,
                           .prompt_tokens = o.prompt_tokens,
                           // A late engine thread may start a step a little before a
                           // request it admits arrived: never report a negative TTFT.
                           .ttft_ms = std::max(0.0, f.first_token_ms - f.arrival_ms)};
      fin.token_ids.reserve(f.max_tokens - 1);
      for (std::uint32_t k = 1; k < f.max_tokens; ++k) fin.token_ids.push_back(FakeToken(k));
      Respond(target.reply, fin);
      break;
    }
    case EngineOutput::kRejected:
      Respond(target.reply, {.request_id = target.request_id,
                             .finish_reason = "error",
                             .prompt_tokens = o.prompt_tokens,
                             .message = fmt::format("prompt of {} tokens needs more than the {} "
                                                    "blocks of the KV cache",
                                                    o.prompt_tokens, config_.num_gpu_blocks)});
      break;
  }
}

void MockWorkerFleet::PublishEvent(Rank& rank, KvEventBatch&& batch) {
  const std::uint64_t worker_id = worker_ids_[rank.worker_index];
  Status s;
  if (config_.event_format == MockEventFormat::kDynamo) {
    const EnvelopeHeader header{
        .publisher_id = worker_id, .sequence = envelope_seq_[rank.worker_index]++, .published_at_ms = UnixMs()};
    s = nats_.Publish(kv_events_subject_, AsBytes(EncodeDynamoEnvelope(batch, header)));
  } else {
    std::vector<VllmEvent> events;
    for (KvOp& op : batch.ops) {
      if (auto* stored = std::get_if<KvStored>(&op.data)) {
        const auto tokens = rank.engine->stored_tokens();
        VllmStoredEvent e{.parent_block_hash = stored->parent_hash,
                          .token_ids = {tokens.begin(), tokens.end()},
                          .block_size = config_.block_size};
        for (const StoredBlock& b : stored->blocks) e.block_hashes.push_back(b.block_hash);
        events.emplace_back(std::move(e));
      } else if (auto* removed = std::get_if<KvRemoved>(&op.data)) {
        events.emplace_back(VllmRemovedEvent{.block_hashes = std::move(removed->block_hashes)});
      } else {
        events.emplace_back(VllmClearedEvent{});
      }
    }
    s = nats_.PublishWithHeaders(rank.vllm_events_subject,
                                 AsBytes(EncodeVllmBatch(UnixSeconds(), events, rank.dp_rank)),
                                 {{"Kv-Seq", std::to_string(rank.vllm_seq++)}});
  }
  if (s.ok()) ++events_;
  CountPublish(s, "kv-event");
}

void MockWorkerFleet::Respond(std::string_view reply, const GenerateResponse& response) {
  CountPublish(nats_.Publish(reply, AsBytes(response.Encode())), "response");
}

void MockWorkerFleet::RespondError(std::string_view reply, std::string request_id, std::string message) {
  Respond(reply, {.request_id = std::move(request_id), .finish_reason = "error", .message = std::move(message)});
}

}  // namespace kvrouter
