// MockWorkerFleet's HTTP face (docs/protocol.md section 11): the listeners, the requests as the
// HTTP threads see them, and the engine thread's answers to HTTP clients. The rest of the fleet
// is in fleet.cc.
#include <fmt/format.h>

#include <charconv>
#include <chrono>
#include <thread>
#include <utility>

#include "router/kvmocker/fleet.h"
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
  return Status::Ok();
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
  http_io_->Stop();  // no handler or client-gone callback runs after this
  listeners_.clear();
}

void MockWorkerFleet::OnHttp(std::size_t worker_index, HttpRequest&& request, std::shared_ptr<HttpReply> reply) {
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

  const std::uint64_t id = ++next_job_id_;
  GenerateJob job{.id = id,
                  .worker_index = worker_index,
                  .dp_rank = dp_rank,
                  .tokens = std::move(generation.prompt),
                  .mm_items = std::move(generation.mm_items),
                  .max_tokens = generation.max_tokens,
                  .target = HttpTarget{.reply = reply, .answer = std::move(generation.answer)},
                  .arrival_ms = NowMs()};
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
