// MockWorkerFleet's HTTP face (docs/protocol.md section 11): the listeners, the requests as the
// HTTP threads see them, and the engine thread's answers to HTTP clients. The rest of the fleet
// is in fleet.cc.
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <thread>
#include <utility>

#include "router/kvmocker/fleet.h"
#include "transport/http_client.h"
#include "transport/http_io.h"
#include "transport/http_listener.h"

namespace kvrouter {

namespace {

// The HttpIo threads of every worker's listener: they only parse JSON and queue work.
constexpr std::size_t kHttpThreads = 2;

HttpHeaders JsonHeaders(const FaceResponse& r) {
  HttpHeaders h = {{"content-type", r.content_type}};
  h.insert(h.end(), r.headers.begin(), r.headers.end());
  return h;
}

void SendFace(HttpReply& reply, const FaceResponse& r) { reply.Send(r.status, JsonHeaders(r), r.body); }

// A room's answer body is one KvTransferParams object: far below this.
constexpr std::size_t kMaxRoomAnswerBytes = 16 * 1024 * 1024;

}  // namespace

Status MockWorkerFleet::StartHttp() {
  if (config_.http_port == 0) return Status::Ok();
  http_io_ = std::make_unique<HttpIo>(kHttpThreads);
  for (std::size_t w = 0; w < worker_ids_.size(); ++w) {
    HttpListenerOptions options{.host = config_.http_host,
                                .port = static_cast<std::uint16_t>(config_.http_port + w),
                                .max_body_bytes = config_.http_max_body_bytes,
                                .server_name = "kvmocker",
                                .error_body = ListenerErrorBody};
    auto listener = HttpListener::Start(*http_io_, std::move(options),
                                        [this, w](HttpRequest request, std::shared_ptr<HttpReply> reply) {
                                          OnHttp(w, std::move(request), std::move(reply));
                                        });
    if (!listener.ok()) {
      StopHttp(std::chrono::milliseconds(0));
      return Internal(
          fmt::format("--http-port {} (worker {}): {}", config_.http_port + w, w, listener.status().message()));
    }
    listeners_.push_back(std::move(listener).value());
  }
  peer_client_ = std::make_unique<HttpClient>(*http_io_, HttpClient::Options{});
  if (config_.role == WorkerRole::kPrefill && config_.kv_connector == KvConnector::kSglang) {
    HttpListenerOptions options{.host = config_.http_host,
                                .port = static_cast<std::uint16_t>(config_.bootstrap_port),
                                .max_body_bytes = 64 * 1024,
                                .server_name = "kvmocker",
                                .error_body = ListenerErrorBody};
    auto listener = HttpListener::Start(*http_io_, std::move(options),
                                        [this](HttpRequest request, std::shared_ptr<HttpReply> reply) {
                                          OnBootstrapHttp(std::move(request), std::move(reply));
                                        });
    if (!listener.ok()) {
      StopHttp(std::chrono::milliseconds(0));
      return Internal(fmt::format("--bootstrap-port {}: {}", config_.bootstrap_port, listener.status().message()));
    }
    listeners_.push_back(std::move(listener).value());
  }
  return Status::Ok();
}

double MockWorkerFleet::LegWaitMs(std::size_t worker_index) const {
  const MockEngineConfig e = WorkerEngineConfig(config_, static_cast<std::uint32_t>(worker_index));
  return std::max(kMinLegWaitMs, e.kv_lease_ms / e.speedup_ratio);
}

void MockWorkerFleet::StopHttp(std::chrono::milliseconds grace) {
  if (!http_io_) return;
  // The answers Stop just handed to HttpReply are written by the HttpIo threads; HttpReply does
  // not tell when a response has gone out, so they get a short, bounded while. HttpListener::Stop
  // is not called while those threads run: it closes the connections with writes still in
  // flight, and a closed connection's pending whole-response write then touches its freed
  // message (transport/http_listener.cc, Session::Shutdown clears out_). Stopping HttpIo first
  // drops the pending work without running it; the listeners are destroyed after.
  if (grace.count() > 0) std::this_thread::sleep_for(grace);
  if (peer_client_) peer_client_->Stop();  // their on_done answers their clients (503: stopping)
  http_io_->Stop();  // no handler or client-gone callback runs after this
  listeners_.clear();
  peer_client_.reset();
}

void MockWorkerFleet::OnHttp(std::size_t worker_index, HttpRequest&& request, std::shared_ptr<HttpReply> reply) {
  if (request.Path() == kKvPulledPath) {
    const FaceResponse r =
        request.method == "POST" ? OnKvPulled(request.body) : OpenAiError(405, "method_not_allowed", "POST only");
    if (r.status >= 400) ++http_errors_;
    SendFace(*reply, r);
    return;
  }
  auto handled =
      face_.Handle(request.method, request.Path(), request.body, request.Header("x-request-id").value_or(""));
  if (auto* answer = std::get_if<FaceResponse>(&handled)) {
    if (answer->status >= 400) ++http_errors_;
    reply->Send(answer->status, JsonHeaders(*answer), std::move(answer->body));
    return;
  }
  OpenAiGeneration& generation = std::get<OpenAiGeneration>(handled);

  // vLLM's data-parallel header picks the rank; without it the worker's least busy rank serves.
  std::optional<std::uint32_t> dp_rank;
  if (auto header = request.Header("x-data-parallel-rank")) {
    std::uint32_t rank = 0;
    const auto [end, ec] = std::from_chars(header->data(), header->data() + header->size(), rank);
    if (ec != std::errc() || end != header->data() + header->size() || rank >= config_.dp_size) {
      ++http_errors_;
      const FaceResponse bad =
          OpenAiError(400, "invalid_argument", fmt::format("x-data-parallel-rank must be in [0, {})", config_.dp_size));
      reply->Send(bad.status, JsonHeaders(bad), bad.body);
      return;
    }
    dp_rank = rank;
  }

  GenerateJob job{.id = ++next_job_id_,
                  .worker_index = worker_index,
                  .dp_rank = dp_rank,
                  .tokens = std::move(generation.prompt),
                  .mm_items = std::move(generation.mm_items),
                  .max_tokens = generation.max_tokens,
                  .target = HttpTarget{.reply = reply, .answer = std::move(generation.answer)},
                  .arrival_ms = NowMs()};
  // The leg (section 13): kv_transfer_params on any worker, SGLang's bootstrap fields by role.
  LegFields& legs = generation.legs;
  switch (legs.nixl) {
    case LegFields::Nixl::kPrefill:
      job.legs.leg = EngineLeg::kPrefill;
      job.max_tokens = 1;
      break;
    case LegFields::Nixl::kDecode: {
      KvTransferParams& p = *legs.params;
      job.legs.leg = EngineLeg::kDecode;
      job.transfer = KvPull{.source_worker_id = p.remote_engine.worker_id,
                            .source_request_id = p.remote_request_id,
                            .blocks = std::move(p.remote_block_ids)};
      job.legs.source = std::move(p);
      break;
    }
    case LegFields::Nixl::kInvalidDecode:
      // As vLLM: the decode engine prefills the prompt itself.
      job.legs.leg = EngineLeg::kDecode;
      ++invalid_transfers_;
      log_.Log(LogLevel::kWarning, "kv-transfer-invalid",
               "decode leg with invalid kv_transfer_params ({}): prefilling locally", legs.invalid);
      break;
    case LegFields::Nixl::kNone:
      if (!legs.bootstrap || config_.kv_connector != KvConnector::kSglang) break;
      if (config_.role == WorkerRole::kPrefill) {
        job.legs.leg = EngineLeg::kPrefill;
        job.legs.room = legs.bootstrap->room;
        job.max_tokens = 1;
        // SGLang's data-parallel controller serves a room on rank room % dp_size (the router
        // chose the room so); a rank header still wins.
        if (!job.dp_rank) job.dp_rank = static_cast<std::uint32_t>(legs.bootstrap->room % config_.dp_size);
      } else if (config_.role == WorkerRole::kDecode) {
        AwaitRoom(std::move(job), *legs.bootstrap);
        return;
      }
      break;
  }
  QueueHttpJob(job);
}

void MockWorkerFleet::QueueHttpJob(GenerateJob& job) {
  const std::uint64_t id = job.id;
  const std::shared_ptr<HttpReply> reply = std::get<HttpTarget>(job.target).reply;
  switch (Enqueue(job)) {  // moved from only when queued
    case Admission::kQueued:
      ++http_requests_;
      // After the job is queued, so its abort can never overtake it. A client gone already is
      // reported at once.
      reply->OnClientGone([this, id] { AbortJob(id); });
      break;
    case Admission::kFull:
      ++http_errors_;
      AnswerOverloaded(job.target);
      break;
    case Admission::kStopping:
      ++http_errors_;
      AnswerShutdown(job.target);
      break;
  }
}

FaceResponse MockWorkerFleet::OnKvPulled(std::string_view body) {
  auto pulled = ParseKvPulled(body);
  if (!pulled.ok()) return OpenAiError(400, "invalid_argument", pulled.status().message());
  const auto worker = std::find(worker_ids_.begin(), worker_ids_.end(), pulled->engine.worker_id);
  if (worker == worker_ids_.end() || pulled->engine.dp_rank >= config_.dp_size) {
    return OpenAiError(404, "not_found",
                       fmt::format("no engine {} in this process", FormatRemoteEngineId(pulled->engine)));
  }
  const std::size_t rank_index =
      static_cast<std::size_t>(worker - worker_ids_.begin()) * config_.dp_size + pulled->engine.dp_rank;
  bool released = false;
  {
    KvMutexLock g(engine_mu_);
    released = ranks_[rank_index]->engine->ReleasePinned(pulled->remote_request_id);
  }
  return FaceResponse{.status = 200, .body = fmt::format(R"({{"released":{}}})", released)};
}

void MockWorkerFleet::TellPulled(const KvTransferParams& source) {
  const auto worker = std::find(worker_ids_.begin(), worker_ids_.end(), source.remote_engine.worker_id);
  if (worker != worker_ids_.end() && source.remote_engine.dp_rank < config_.dp_size) {
    // The prefill engine is in this process: no HTTP between them.
    const std::size_t rank_index =
        static_cast<std::size_t>(worker - worker_ids_.begin()) * config_.dp_size + source.remote_engine.dp_rank;
    (void)ranks_[rank_index]->engine->ReleasePinned(source.remote_request_id);
    return;
  }
  if (!peer_client_) return;
  auto status = std::make_shared<int>(0);
  const std::string where = fmt::format("{}:{}", source.remote_host, source.remote_port);
  peer_client_->Start(HttpEndpoint{.host = source.remote_host, .port = source.remote_port},
                      HttpCallSpec{.method = "POST",
                                   .target = std::string(kKvPulledPath),
                                   .headers = {{"content-type", "application/json"}},
                                   .body = KvPulledJson(source.remote_engine, source.remote_request_id),
                                   .head_timeout = std::chrono::seconds(10),
                                   .read_timeout = std::chrono::seconds(10)},
                      {.on_head = [status](int s, const HttpHeaders&) { *status = s; },
                       .on_data = [](std::string_view) {},
                       .on_done =
                           [this, status, where](const Status& s) {
                             if (s.ok() && *status == 200) return;
                             ++pull_notice_failures_;
                             log_.Log(LogLevel::kWarning, "kv-pulled-notice",
                                      "cannot tell {} of a pull (its lease frees the blocks): {}", where,
                                      s.ok() ? fmt::format("HTTP {}", *status) : s.message());
                           }});
}

void MockWorkerFleet::AwaitRoom(GenerateJob job, SglangBootstrap bootstrap) {
  struct Wait {
    GenerateJob job;
    int status = 0;
    std::string body;
  };
  const auto wait_ms = std::chrono::milliseconds(static_cast<std::int64_t>(LegWaitMs(job.worker_index)));
  auto w = std::make_shared<Wait>(Wait{.job = std::move(job)});
  const std::string where = fmt::format("room {} at {}:{}", bootstrap.room, bootstrap.host, bootstrap.port);
  peer_client_->Start(HttpEndpoint{.host = bootstrap.host, .port = bootstrap.port},
                      HttpCallSpec{.method = "GET",
                                   .target = fmt::format("{}{}", kBootstrapRoomsPath, bootstrap.room),
                                   .head_timeout = wait_ms,
                                   .read_timeout = wait_ms},
                      {.on_head = [w](int s, const HttpHeaders&) { w->status = s; },
                       .on_data =
                           [w](std::string_view d) {
                             if (w->body.size() + d.size() <= kMaxRoomAnswerBytes) w->body.append(d);
                           },
                       .on_done =
                           [this, w, where](const Status& s) {
                             Result<KvTransferParams> params = Internal("");
                             if (!s.ok()) {
                               params = Internal(s.message());
                             } else if (w->status != 200) {
                               params = Internal(fmt::format("HTTP {}: {}", w->status, w->body.substr(0, 256)));
                             } else {
                               params = ParseKvTransferParams(w->body);
                             }
                             if (!params.ok()) {
                               ++bootstrap_failures_;
                               ++http_errors_;
                               log_.Log(LogLevel::kWarning, "kv-bootstrap", "SGLang decode leg failed: {}: {}", where,
                                        params.status().message());
                               FailHttp(std::get<HttpTarget>(w->job.target), 502, "kv_bootstrap_failed",
                                        fmt::format("the prefill leg of bootstrap {} did not come: {}", where,
                                                    params.status().message()));
                               return;
                             }
                             GenerateJob& decode = w->job;
                             decode.legs.leg = EngineLeg::kDecode;
                             decode.transfer = KvPull{.source_worker_id = params->remote_engine.worker_id,
                                                      .source_request_id = params->remote_request_id,
                                                      .blocks = std::move(params->remote_block_ids)};
                             decode.legs.source = std::move(params).value();
                             QueueHttpJob(decode);
                           }});
}

void MockWorkerFleet::OnBootstrapHttp(HttpRequest&& request, std::shared_ptr<HttpReply> reply) {
  const std::string_view path = request.Path();
  if (path == kKvPulledPath) {
    SendFace(*reply,
             request.method == "POST" ? OnKvPulled(request.body) : OpenAiError(405, "method_not_allowed", "POST only"));
    return;
  }
  std::uint64_t room = 0;
  if (!path.starts_with(kBootstrapRoomsPath) || request.method != "GET") {
    SendFace(*reply, OpenAiError(404, "not_found", fmt::format("no such path: {} {}", request.method, path)));
    return;
  }
  const std::string_view digits = path.substr(kBootstrapRoomsPath.size());
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), room);
  if (digits.empty() || ec != std::errc() || end != digits.data() + digits.size()) {
    SendFace(*reply, OpenAiError(400, "invalid_argument", "the room must be an unsigned 64-bit integer"));
    return;
  }
  KvMutexLock g(rooms_mu_);
  const double now = NowMs();
  ExpireRooms(now);
  auto it = rooms_.find(room);
  if (it != rooms_.end() && it->second.ready) {
    reply->Send(200, {{"content-type", "application/json"}}, KvTransferParamsJson(*it->second.ready));
    rooms_.erase(it);  // one decode leg pulls a room
    return;
  }
  if (it != rooms_.end() && it->second.failed) {
    SendFace(*reply, OpenAiError(502, "prefill_failed", *it->second.failed));
    rooms_.erase(it);
    return;
  }
  if ((it == rooms_.end() && rooms_.size() >= kMaxRooms) ||
      (it != rooms_.end() && it->second.waiters.size() >= kMaxRoomWaiters)) {
    SendFace(*reply, OpenAiError(503, "overloaded", "too many bootstrap rooms waited for"));
    return;
  }
  if (it == rooms_.end()) {
    const double expires = now + LegWaitMs(0);
    it = rooms_.emplace(room, Room{.expires_ms = expires}).first;
    room_expiry_.emplace_back(expires, room);
  }
  it->second.waiters.push_back(std::move(reply));
}

void MockWorkerFleet::PublishRoom(std::uint64_t room, std::optional<KvTransferParams> params, double lease_ms,
                                  std::string_view why) {
  KvMutexLock g(rooms_mu_);
  const double now = NowMs();
  ExpireRooms(now);
  auto it = rooms_.find(room);
  if (it != rooms_.end() && !it->second.waiters.empty()) {
    const FaceResponse failed = OpenAiError(502, "prefill_failed", fmt::format("room {}: {}", room, why));
    const std::string ready = params ? KvTransferParamsJson(*params) : std::string();
    for (const auto& waiter : it->second.waiters) {
      if (params) {
        waiter->Send(200, {{"content-type", "application/json"}}, ready);
      } else {
        SendFace(*waiter, failed);
      }
    }
    rooms_.erase(it);
    return;
  }
  if (it == rooms_.end() && rooms_.size() >= kMaxRooms) {
    log_.Log(LogLevel::kWarning, "rooms-full", "{} bootstrap rooms held: room {} dropped", kMaxRooms, room);
    return;
  }
  // No decode leg yet: the room waits for one (the lease frees the blocks when none comes).
  const double expires = now + (params ? lease_ms : LegWaitMs(0));
  Room& r = rooms_[room];
  r.waiters.clear();
  r.ready = std::move(params);
  if (!r.ready) r.failed = fmt::format("room {}: {}", room, why);
  r.expires_ms = expires;
  room_expiry_.emplace_back(expires, room);
}

void MockWorkerFleet::ExpireRooms(double now_ms) {
  while (!room_expiry_.empty() && room_expiry_.front().first <= now_ms) {
    const auto [expires, room] = room_expiry_.front();
    room_expiry_.pop_front();
    const auto it = rooms_.find(room);
    if (it == rooms_.end() || it->second.expires_ms != expires) continue;  // taken, or renewed
    const FaceResponse late =
        OpenAiError(504, "prefill_timeout", fmt::format("room {}: no prefill leg came in time", room));
    for (const auto& waiter : it->second.waiters) SendFace(*waiter, late);
    rooms_.erase(it);
  }
}

KvTransferParams MockWorkerFleet::PinnedParams(const InFlight& f, const std::string& id) {
  const Rank& rank = *ranks_[f.rank_index];
  const std::span<const SequenceHash> blocks = rank.engine->PinnedBlocksOf(id);
  return KvTransferParams{.remote_engine = {.worker_id = worker_ids_[rank.worker_index], .dp_rank = rank.dp_rank},
                          .remote_block_ids = {blocks.begin(), blocks.end()},
                          .remote_host = config_.http_advertise_host,
                          .remote_port = static_cast<std::uint16_t>(
                              f.legs.room ? config_.bootstrap_port : config_.http_port + rank.worker_index),
                          .remote_request_id = id};
}

void MockWorkerFleet::AbortJob(std::uint64_t id) {
  {
    KvMutexLock g(inbox_mu_);
    if (stopping_) return;  // Stop answers every job itself
    aborts_.push_back(id);
  }
  inbox_cv_.notify_one();
}

void MockWorkerFleet::AnswerHttp(HttpTarget& target, const InFlight& f, const EngineOutput& o) {
  const OpenAiAnswer& answer = target.answer;
  const bool stream = answer.delivery() == OpenAiAnswer::Delivery::kStream;
  switch (o.kind) {
    case EngineOutput::kFirstToken:
      if (!stream) break;
      target.reply->Begin(
          200, {{"content-type", std::string(OpenAiAnswer::kEventStreamType)}, {"cache-control", "no-cache"}});
      target.begun = true;
      target.reply->Write(answer.TokenEvent(0, o.output_tokens >= f.max_tokens));
      break;
    case EngineOutput::kToken:
      if (stream) target.reply->Write(answer.TokenEvent(o.output_tokens - 1, o.output_tokens >= f.max_tokens));
      break;
    case EngineOutput::kFinished: {
      const OpenAiUsage usage{
          .prompt_tokens = o.prompt_tokens, .completion_tokens = o.output_tokens, .cached_tokens = o.cached_tokens};
      if (f.legs.leg == EngineLeg::kPrefill) {
        // The blocks stay pinned for the decode engine: tell it where (section 13).
        const KvTransferParams params = PinnedParams(f, o.id);
        if (f.legs.room) {
          const Rank& rank = *ranks_[f.rank_index];
          const MockEngineConfig e = WorkerEngineConfig(config_, static_cast<std::uint32_t>(rank.worker_index));
          PublishRoom(*f.legs.room, params, e.kv_lease_ms / e.speedup_ratio, "");
        } else if (!stream) {
          target.reply->Send(200, {{"content-type", "application/json"}}, answer.Body(usage, &params));
          break;
        }
      }
      if (!stream) {
        target.reply->Send(200, {{"content-type", "application/json"}}, answer.Body(usage));
        break;
      }
      std::string tail;
      if (answer.include_usage()) tail = answer.UsageEvent(usage);
      tail += OpenAiAnswer::kDoneEvent;
      target.reply->Write(std::move(tail));
      target.reply->End();
      break;
    }
    case EngineOutput::kPulled: break;  // the engine's KV pull: nothing for the client
    case EngineOutput::kRejected:       // the face refuses prompts over the cache: not expected
      ++http_errors_;
      if (f.legs.room) PublishRoom(*f.legs.room, std::nullopt, 0, "its prefill leg was rejected");
      FailHttp(target, 400, "invalid_argument",
               fmt::format("prompt of {} tokens needs more than the {} blocks of the KV cache", o.prompt_tokens,
                           config_.num_gpu_blocks));
      break;
  }
}

void MockWorkerFleet::FailHttp(HttpTarget& target, int status, std::string_view code, std::string_view message) {
  if (target.begun) {
    target.reply->Write(OpenAiAnswer::ErrorEvent(code, message) + std::string(OpenAiAnswer::kDoneEvent));
    target.reply->End();
    return;
  }
  const FaceResponse r = OpenAiError(status, code, message);
  target.reply->Send(r.status, JsonHeaders(r), r.body);
}

}  // namespace kvrouter
