#include "router/kvgateway/gateway.h"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "router/kvgateway/exchange.h"
#include "router/kvgateway/headers.h"

namespace kvrouter {

namespace {

constexpr std::size_t kMaxIdBytes = 256;  // request and session ids, as the router bounds them

std::string_view ErrorType(int status) {
  if (status == 429) return "rate_limit_error";
  return status >= 500 ? "server_error" : "invalid_request_error";
}

// The client's x-request-id when it has a usable one (non-empty, at most kMaxIdBytes).
std::optional<std::string> ClientRequestId(const HttpRequest& request) {
  auto id = request.Header("x-request-id");
  if (!id || id->empty() || id->size() > kMaxIdBytes) return std::nullopt;
  return std::string(*id);
}

// The client's end-to-end headers go to the engine: its API key (vLLM's --api-key), the
// formats it accepts, the trace context (traceparent, tracestate, baggage), ...
void PassClientHeaders(const HttpRequest& request, HttpHeaders& to) { ForwardRequestHeaders(request.headers, to); }

}  // namespace

void Gateway::Handle(HttpRequest request, std::shared_ptr<HttpReply> reply) {
  const std::string_view path = request.Path();
  const bool get = request.method == "GET";
  const bool post = request.method == "POST";
  auto error = [&](int status, std::string_view code, std::string_view message, HttpHeaders h = {}) {
    h.emplace_back("content-type", "application/json");
    if (auto id = ClientRequestId(request)) h.emplace_back("x-request-id", *id);
    reply->Send(status, std::move(h), OpenAiError(message, ErrorType(status), code));
  };
  // /health and /ready stay on the API port as well: a load balancer probes the port it sends
  // to, and /ready's 503 while draining must reach it there. /metrics (the fleet's insides) is
  // only on --metrics-port, which need not be reachable from where the clients are.
  if (path == "/health") return reply->Send(get ? 200 : 405, {{"content-type", "text/plain"}}, "ok\n");
  if (path == "/ready") {
    const bool ready = Ready(std::chrono::steady_clock::now());
    return reply->Send(ready ? 200 : 503, {{"content-type", "text/plain"}}, ready ? "ready\n" : "not ready\n");
  }
  if (path == "/v1/models") {
    if (!get) return error(405, "method_not_allowed", "use GET");
    return Models(reply);
  }
  ApiKind kind;
  if (path == ApiPath(ApiKind::kChat)) {
    kind = ApiKind::kChat;
  } else if (path == ApiPath(ApiKind::kCompletions)) {
    kind = ApiKind::kCompletions;
  } else {
    return error(404, "not_found", fmt::format("no route for {}", path.substr(0, 128)));
  }
  const std::string endpoint = kind == ApiKind::kChat ? "chat" : "completions";
  if (!post) {
    Count(endpoint, 405);
    return error(405, "method_not_allowed", "use POST");
  }
  auto parsed = ParseOpenAiRequest(kind, request.body);
  if (!parsed.ok()) {
    Count(endpoint, 400);
    return error(400, "invalid_request", parsed.status().message());
  }
  const bool fallback = SkipsRouter(std::chrono::steady_clock::now());
  if (!nats_connected_.load() && !fallback) {  // before the render call: no router could take the request
    Count(endpoint, 503);
    return error(503, "no_workers", RouterLink::kNotConnected, {{"retry-after", "1"}});
  }
  auto x = std::make_shared<Exchange>();
  x->allowed = directory_.Serving(parsed->model);
  if (x->allowed.empty()) {
    Count(endpoint, 404);
    return error(404, "model_not_found",
                 fmt::format("no registered worker serves the model '{}'", parsed->model.substr(0, 256)));
  }
  x->reply = std::move(reply);
  x->request = std::move(parsed).value();
  x->endpoint = endpoint;
  x->arrival = std::chrono::steady_clock::now();
  x->booking_base = id_prefix_ + std::to_string(++next_id_);
  x->request_id = ClientRequestId(request).value_or(x->booking_base);
  auto session = request.Header("x-session-id");
  if (!session) session = request.Header("x-dynamo-session-id");
  if (session && session->size() <= kMaxIdBytes) x->session_id = std::string(*session);
  x->http = std::move(request);
  if (fallback) {
    // Not rendered: no render_at.
  } else if (render_endpoint_) {
    x->render_at.push_back(*render_endpoint_);
  } else {
    // The engines serving the model, starting at a different one each time.
    const std::size_t n = x->allowed.size();
    const std::size_t start = next_id_.load() % n;
    for (std::size_t k = 0; k < n; ++k) {
      if (auto e = directory_.Endpoint(x->allowed[(start + k) % n])) x->render_at.push_back(std::move(*e));
    }
  }
  in_flight_->Increment();
  std::weak_ptr<Exchange> weak = x;
  x->reply->OnClientGone([this, weak] {
    auto ex = weak.lock();
    if (!ex) return;
    std::shared_ptr<HttpCall> call, prefill;
    {
      ex->AssertOnItsThread();
      if (ex->done) return;
      ex->done = true;
      call = ex->call;
      prefill = ex->prefill_call;
    }
    clients_gone_->Increment();
    if (call) call->Cancel();  // the engine sees its client go and aborts
    if (prefill) prefill->Cancel();  // and so does a prefill engine (no decode leg starts after it)
    Free(ex);
    Count(ex->endpoint, 499);
    in_flight_->Decrement();
  });
  if (fallback) return Fallback(x);  // no render call: its token ids would serve no router
  if (x->render_at.empty())
    return Fail(x, 503, "no_workers", "no engine serving the model has a usable http_url", {{"retry-after", "1"}});
  Render(x, 0, false);
}

void Gateway::Render(const std::shared_ptr<Exchange>& x, std::size_t candidate, bool tokenize) {
  HttpCallSpec spec{.method = "POST",
                    .target = std::string(tokenize ? std::string_view("/tokenize") : RenderPath(x->request.kind)),
                    .headers = {{"content-type", "application/json"}},
                    .body = tokenize ? TokenizeBody(x->request, x->http.body) : x->http.body,
                    .connect_timeout = std::chrono::milliseconds(config_.engine_connect_timeout_ms),
                    .head_timeout = std::chrono::milliseconds(config_.render_timeout_ms),
                    .read_timeout = std::chrono::milliseconds(config_.render_timeout_ms)};
  PassClientHeaders(x->http, spec.headers);
  std::uint64_t seq = 0;
  {
    if (x->done) return;
    x->Enter(Exchange::Stage::kRendering);
    x->render_status = 0;
    x->render_body.clear();
    seq = ++x->call_seq;
  }
  // The callbacks own the exchange while the call runs (the call drops them when it is done).
  auto call = client_.Start(
      x->render_at[candidate], std::move(spec),
      {.on_head =
           [x](int status, const HttpHeaders&) {
             x->AssertOnItsThread();
             x->render_status = status;
           },
       .on_data =
           [x](std::string_view d) {
             x->AssertOnItsThread();
             if (x->render_body.size() + d.size() <= kMaxRenderBytes) x->render_body.append(d);
           },
       .on_done = [this, ex = x, candidate, tokenize](const Status& s) { OnRendered(ex, candidate, tokenize, s); }});
  KeepCall(x, 0, seq, std::move(call));  // rendering comes before the first route
}

void Gateway::OnRendered(const std::shared_ptr<Exchange>& ex, std::size_t candidate, bool tokenize, const Status& s) {
  int status = 0;
  std::string body;
  {
    ex->AssertOnItsThread();
    if (ex->done) return;
    ex->call.reset();
    status = ex->render_status;
    body = std::move(ex->render_body);
  }
  if (!s.ok() || status >= 500) {  // that engine cannot render now: another one may
    if (candidate + 1 < ex->render_at.size() && !stopping_.load()) return Render(ex, candidate + 1, tokenize);
    return Fail(
        ex, 502, "render_failed",
        fmt::format("no engine could render the prompt: {}", s.ok() ? fmt::format("status {}", status) : s.message()));
  }
  if (status == 404 && !tokenize) {
    render_fallbacks_->Increment();
    return Render(ex, candidate, true);
  }
  if (status != 200) {
    return Fail(ex, status == 404 ? 502 : 400, "invalid_request",
                fmt::format("the engine refused the prompt ({}): {}", status, body.substr(0, 512)));
  }
  auto rendered = [&]() -> Result<RenderedPrompt> {
    if (!tokenize) return ParseRenderAnswer(ex->request.kind, body);
    auto ids = ParseTokenizeAnswer(body);
    if (!ids.ok()) return ids.status();
    return RenderedPrompt{.token_ids = std::move(ids).value()};
  }();
  if (!rendered.ok()) return Fail(ex, 502, "render_failed", rendered.status().message());
  ex->mm_items = RouteItems(ex->request, *rendered);
  ex->token_ids = std::move(rendered->token_ids);
  Route(ex);
}

void Gateway::Route(const std::shared_ptr<Exchange>& x) {
  RouteRequest r;
  std::uint32_t attempt = 0;
  {
    if (x->done) return;
    x->Enter(Exchange::Stage::kRouting);
    attempt = x->attempt;
    x->booking = x->attempt == 0 ? x->booking_base : fmt::format("{}#{}", x->booking_base, x->attempt);
    r.request_id = x->booking;
    r.token_ids = x->token_ids;
    r.mm_items = x->mm_items;
    r.has_token_ids = true;
    r.isl = static_cast<std::uint32_t>(r.token_ids.size());
    r.allowed_worker_ids = x->allowed;
    if (!x->excluded.empty()) r.excluded_worker_ids = x->excluded;
    r.session_id = x->session_id;
  }
  std::string booking = r.request_id;
  // The answer is continued on the client connection's thread, where the rest of the exchange
  // runs (the engine call started there stays there).
  link_.Route(std::move(r), [this, ex = x, booking = std::move(booking), attempt](Result<RouteReply> routed) mutable {
    auto reply = ex->reply;
    reply->Defer([this, ex = std::move(ex), booking = std::move(booking), attempt, routed = std::move(routed)] {
      OnRouted(ex, booking, attempt, routed);
    });
  });
}

void Gateway::OnRouted(const std::shared_ptr<Exchange>& ex, const std::string& booking, std::uint32_t attempt,
                       const Result<RouteReply>& routed) {
  ex->AssertOnItsThread();
  if (ex->done) {
    if (routed.ok()) link_.Free(booking);  // the client left while the router decided
    return;
  }
  if (routed.ok()) {
    ex->booked = true;
    ex->routed = *routed;
    if (stopping_.load()) return Fail(ex, 503, "shutting_down", "the gateway is stopping");
    route_time_->Observe(Seconds(std::chrono::steady_clock::now() - ex->arrival));
    CountDisaggPath(ex);
    return routed->disaggregated ? Disaggregate(ex, attempt) : Forward(ex, attempt);
  }
  const Status& s = routed.status();
  const bool router_gone = s.code() == StatusCode::kNoWorkers || s.code() == StatusCode::kTimeout;
  if (router_gone && FallsBack(std::chrono::steady_clock::now()) && !stopping_.load()) return Fallback(ex);
  switch (s.code()) {
    case StatusCode::kOverloaded:
    case StatusCode::kTimeout:
      return Fail(ex, 429, "overloaded", "every worker is busy: " + s.message(), {{"retry-after", "1"}});
    case StatusCode::kInvalidArgument: return Fail(ex, 400, "invalid_request", s.message());
    case StatusCode::kNoWorkers:
    case StatusCode::kNotFound:
      if (ex->attempt > 0 && nats_connected_.load()) {
        return Fail(ex, 502, "engine_failed", "every engine tried failed: " + s.message());
      }
      return Fail(ex, 503, "no_workers", s.message(), {{"retry-after", "1"}});
    default: return Fail(ex, 502, "router_error", s.message());
  }
}

namespace {

// The engine's headers passed on, with the request id and the router's choice.
HttpHeaders ResponseHead(const Gateway::Exchange& ex) {
  HttpHeaders h = ex.engine_headers;
  h.emplace_back("x-request-id", ex.request_id);
  h.emplace_back("x-kvrouter-worker-id", std::to_string(ex.routed.worker_id));
  if (ex.routed.disaggregated) {
    h.emplace_back("x-kvrouter-prefill-worker-id", std::to_string(ex.routed.prefill_worker_id));
  }
  if (ex.fallback) {
    h.emplace_back("x-kvrouter-fallback", "least-loaded");
  } else {
    h.emplace_back("x-kvrouter-cached-tokens", std::to_string(ex.routed.cached_tokens));
  }
  return h;
}

}  // namespace

Result<HttpEndpoint> Gateway::EngineEndpoint(std::uint64_t worker, std::string url) const {
  if (!url.empty()) return ParseHttpUrl(url);
  if (auto e = directory_.Endpoint(worker)) return std::move(*e);
  return ParseHttpUrl(directory_.HttpUrl(worker).value_or(""));  // its error, or "not known"
}

HttpCallSpec Gateway::EngineCall(const Exchange& x, std::string body) const {
  HttpCallSpec spec{.method = "POST",
                    .target = x.http.target,
                    .headers = {{"content-type", "application/json"}, {"x-request-id", x.request_id}},
                    .body = std::move(body),
                    .connect_timeout = std::chrono::milliseconds(config_.engine_connect_timeout_ms),
                    .head_timeout = std::chrono::milliseconds(config_.engine_timeout_ms),
                    .read_timeout = std::chrono::milliseconds(config_.engine_timeout_ms)};
  PassClientHeaders(x.http, spec.headers);
  return spec;
}

void Gateway::Forward(const std::shared_ptr<Exchange>& x, std::uint32_t attempt) {
  std::string url;
  std::uint64_t worker = 0;
  std::string body;
  {
    x->AssertOnItsThread();
    if (x->done || x->attempt != attempt) return;
    worker = x->routed.worker_id;
    url = x->routed.http_url;
    body = x->leg_body.empty() ? x->http.body : x->leg_body;
  }
  auto endpoint = EngineEndpoint(worker, std::move(url));
  if (!endpoint.ok()) return Retry(x, attempt, worker, fmt::format("worker {} has no usable http_url", worker));
  HttpCallSpec spec = EngineCall(*x, std::move(body));
  std::uint64_t seq = 0;
  {
    if (x->done || x->attempt != attempt) return;
    x->Enter(Exchange::Stage::kCalling);
    x->called = std::chrono::steady_clock::now();
    x->timing = {};
    seq = ++x->call_seq;
  }
  EngineLoad::Hold load = engine_load_.Add(worker);  // until the call's callbacks are dropped
  // The callbacks own the exchange (and the engine's load count) while the call runs.
  auto call = client_.Start(
      *endpoint, std::move(spec),
      {.on_head = [this, ex = x, attempt](int status, const HttpHeaders& h) { OnEngineHead(ex, attempt, status, h); },
       .on_data = [this, ex = x, attempt, seq](std::string_view d) { OnEngineData(ex, attempt, seq, d); },
       .on_done = [this, ex = x, attempt, worker, load](const Status& s) { OnEngineDone(ex, attempt, worker, s); }});
  KeepCall(x, attempt, seq, std::move(call));
}

void Gateway::OnEngineHead(const std::shared_ptr<Exchange>& ex, std::uint32_t attempt, int status,
                           const HttpHeaders& headers) {
  ex->AssertOnItsThread();
  if (ex->attempt != attempt) return;  // a leg closed by a retry
  ex->engine_status = status;
  ex->engine_headers.clear();
  ForwardResponseHeaders(headers, ex->engine_headers);
}

void Gateway::OnEngineData(const std::shared_ptr<Exchange>& ex, std::uint32_t attempt, std::uint64_t seq,
                           std::string_view d) {
  bool mark = false;
  std::string booking;
  std::shared_ptr<HttpCall> pause;  // this call, to pause until the client drains
  bool first_pause = false;
  {
    ex->AssertOnItsThread();
    if (ex->done || ex->attempt != attempt) return;
    if (ex->engine_status >= 500) {  // not for the client: the request goes elsewhere
      if (ex->engine_error.size() < 4096) ex->engine_error.append(d.substr(0, 4096));
      return;
    }
    const SteadyTime now = std::chrono::steady_clock::now();
    if (!ex->first_byte) {
      ex->first_byte = true;
      // A plain answer's first byte is (nearly) its end: free says it all, and a
      // mark_prefill there would teach the router a prefill (or KV transfer) as long
      // as the whole generation. Nothing is booked when the gateway fell back.
      mark = ex->booked && ex->request.stream;
    if (mark) booking = ex->booking;
      if (!std::exchange(ex->ttfb_observed, true)) ttfb_->Observe(Seconds(now - ex->arrival));
      ex->timing.ttfb_ms = Seconds(now - ex->called) * 1000;
      if (ex->prefill_answered) decode_wait_->Observe(Seconds(now - ex->prefill_end));
    } else {
      const double gap = Seconds(now - ex->last_chunk);
      inter_chunk_->Observe(gap);
      ResponseTiming& t = ex->timing;
      t.inter_chunk_ms_mean += (gap * 1000 - t.inter_chunk_ms_mean) / static_cast<double>(t.chunks);
      t.inter_chunk_ms_max = std::max(t.inter_chunk_ms_max, gap * 1000);
    }
    ++ex->timing.chunks;
    ex->last_chunk = now;
    // A plain response goes to the client whole when it ends, with its length, in one
    // write; a streamed one (or a plain one past kMaxHeldBody) chunk by chunk as it comes.
    if (!ex->began() && !ex->request.stream && ex->held.size() + d.size() <= kMaxHeldBody) {
      ex->held.append(d);
    } else if (!ex->began()) {
      ex->Enter(Exchange::Stage::kResponding);
      ex->reply->Begin(ex->engine_status, ResponseHead(*ex));
      ex->held.append(d);
      ex->reply->Write(std::exchange(ex->held, {}));
    } else {
      ex->reply->Write(std::string(d));
    }
    // The call is known once KeepCall kept it; a chunk before that is not paused on
    // (the next one is).
    if (ex->began() && !ex->read_paused && ex->call && ex->call_seq == seq && ex->reply->Backlog() > kClientHighWater) {
      ex->read_paused = true;
      first_pause = !std::exchange(ex->slowed, true);
      pause = ex->call;
    }
  }
  if (mark) link_.MarkPrefill(booking);
  if (pause) {
    if (first_pause) slow_clients_->Increment();
    pause->Pause();  // here, on the call's own thread: before its next read
    std::weak_ptr<Exchange> weak = ex;
    ex->reply->OnDrained(kClientLowWater, [weak, call = std::weak_ptr<HttpCall>(pause)] {
      if (auto e = weak.lock()) {
        e->AssertOnItsThread();
        e->read_paused = false;
      }
      if (auto c = call.lock()) c->Resume();
    });
  }
}

void Gateway::OnEngineDone(const std::shared_ptr<Exchange>& ex, std::uint32_t attempt, std::uint64_t worker,
                           const Status& s) {
  bool began = false;
  int status = 0;
  std::string error;
  std::shared_ptr<HttpCall> prefill_call;
  {
    ex->AssertOnItsThread();
    if (ex->done || ex->attempt != attempt) return;
    ex->call.reset();
    began = ex->began();
    status = ex->engine_status;
    error = std::move(ex->engine_error);
  }
  if (!began && s.code() == StatusCode::kTimeout) {
    return Fail(ex, 504, "engine_timeout", EngineTimeoutMessage(worker, config_.engine_timeout_ms, s));
  }
  if (!began && (!s.ok() || status >= 500)) {
    // Nothing reached the client. A client error the engine broke off in the middle of
    // is not another engine's to answer.
    if (!s.ok() && status >= 400 && status < 500) {
      return Fail(ex, 502, "engine_failed", "the engine's answer broke off: " + s.message());
    }
    return Retry(ex, attempt, worker,
                 s.ok() ? fmt::format("the engine answered {}: {}", status, error.substr(0, 256)) : s.message());
  }
  // The booking is freed before the client has its answer: a client's next turn,
  // sent the moment this one ends, must not find it still booked (a plain answer sends
  // no mark_prefill, so the router holds its prefill tokens until this free).
  std::optional<std::pair<HttpHeaders, std::string>> whole;
  bool end = false;
  {
    ex->AssertOnItsThread();
    ex->done = true;                             // from here no other path touches ex->reply
    prefill_call = std::move(ex->prefill_call);  // an SGLang prefill leg not ended yet
    if (!s.ok()) {
      ex->engine_broke = true;
      ex->reply->Abort();     // cut off mid-response: the client sees the connection end
    } else if (!ex->began()) {  // a plain response (or an empty body): whole
      // A disaggregated answer's prompt cache is the prefill engine's, not the decode
      // engine's (which received every block).
      if (ex->prefill_cached && status == 200) {
        if (auto patched = WithCachedTokens(ex->held, *ex->prefill_cached)) ex->held = std::move(*patched);
      }
      whole.emplace(ResponseHead(*ex), std::exchange(ex->held, {}));
    } else {
      end = true;
    }
  }
  if (prefill_call) prefill_call->Cancel();
  Free(ex);
  if (whole) ex->reply->Send(status, std::move(whole->first), std::move(whole->second));
  if (end) ex->reply->End();
  Count(ex->endpoint, s.ok() ? status : 502);
  in_flight_->Decrement();
}

void Gateway::AnswerWhole(const std::shared_ptr<Exchange>& x, int status, std::string content_type, std::string body,
                          HttpHeaders engine_headers) {
  Finish(x, status, [&](Exchange& e) {
    e.engine_headers = {{"content-type", std::move(content_type)}};
    for (auto& h : engine_headers) {
      if (h.first != "content-type") e.engine_headers.push_back(std::move(h));
    }
    e.reply->Send(status, ResponseHead(e), std::move(body));
  });
}

void Gateway::Finish(const std::shared_ptr<Exchange>& x, int status, const std::function<void(Exchange&)>& answer) {
  std::shared_ptr<HttpCall> call, prefill_call;
  {
    x->AssertOnItsThread();
    if (x->done) return;
    x->done = true;
    call = std::move(x->call);
    prefill_call = std::move(x->prefill_call);
    answer(*x);
  }
  if (call) call->Cancel();
  if (prefill_call) prefill_call->Cancel();
  Free(x);
  Count(x->endpoint, status);
  in_flight_->Decrement();
}

void Gateway::KeepCall(const std::shared_ptr<Exchange>& x, std::uint32_t attempt, std::uint64_t seq,
                       std::shared_ptr<HttpCall> call) {
  {
    x->AssertOnItsThread();
    if (!x->done && x->attempt == attempt) {
      // A later call started meanwhile (this one ended already and the exchange went on): that
      // one is the call to cancel.
      if (x->call_seq == seq) x->call = std::move(call);
      return;
    }
  }
  call->Cancel();  // the client went (or the exchange ended or was retried) while the call was being started
}

void Gateway::Retry(const std::shared_ptr<Exchange>& x, std::uint32_t attempt, std::uint64_t worker,
                    const std::string& why) {
  std::shared_ptr<HttpCall> call, prefill_call;
  std::uint32_t next = 0;
  {
    x->AssertOnItsThread();
    if (x->done || x->attempt != attempt) return;
    x->excluded.push_back(worker);
    next = ++x->attempt;
    x->engine_status = 0;
    x->engine_headers.clear();
    x->first_byte = false;
    x->held.clear();
    x->leg_body.clear();
    x->prefill_status = 0;
    x->prefill_headers.clear();
    x->prefill_body.clear();
    x->prefill_overflow = false;
    x->prefill_answered = false;
    x->prefill_cached.reset();
    call = std::move(x->call);  // the other leg of a disaggregated attempt
    prefill_call = std::move(x->prefill_call);
  }
  if (call) call->Cancel();
  if (prefill_call) prefill_call->Cancel();
  Free(x);
  engine_load_.Failed(worker, std::chrono::steady_clock::now());  // passed over by the fallback for a while
  if (stopping_.load()) return Fail(x, 503, "shutting_down", "the gateway is stopping");
  log_.Log(LogLevel::kWarning, "engine-failed", "request {}: worker failed before its answer reached the client: {}",
           x->request_id, why);
  if (next > config_.retries) {
    return Fail(x, 502, "engine_failed", fmt::format("the engine failed after {} tries: {}", next, why));
  }
  retries_->Increment();
  bool fallback = false;
  {
    x->AssertOnItsThread();
    fallback = x->fallback;
  }
  // A request the gateway never rendered is not the router's to route; nor is one whose router
  // is known to be gone (its route would wait the route timeout first).
  fallback || SkipsRouter(std::chrono::steady_clock::now()) ? Fallback(x) : Route(x);
}

void Gateway::Fallback(const std::shared_ptr<Exchange>& x) {
  std::vector<std::uint64_t> candidates, excluded;
  std::uint32_t attempt = 0;
  bool first = false;
  {
    if (x->done) return;
    x->Enter(Exchange::Stage::kRouting);
    first = !std::exchange(x->fallback, true);
    attempt = x->attempt;
    candidates = x->allowed;
    excluded = x->excluded;
  }
  std::vector<std::uint64_t> usable, prefill;
  for (std::uint64_t id : candidates) {
    if (std::find(excluded.begin(), excluded.end(), id) != excluded.end()) continue;
    if (!directory_.ServesAlone(id)) continue;  // an SGLang engine of a disaggregated pair
    // Prefill engines only when nothing else is left: the decode pool is sized for generating.
    (directory_.Role(id) == WorkerRole::kPrefill ? prefill : usable).push_back(id);
  }
  const SteadyTime now = std::chrono::steady_clock::now();
  // The prefill pool when no other engine is left, or none of the others is healthy and one of it is.
  if (usable.empty() || (!engine_load_.AnyHealthy(usable, now) && engine_load_.AnyHealthy(prefill, now))) {
    usable = std::move(prefill);
  }
  if (stopping_.load()) return Fail(x, 503, "shutting_down", "the gateway is stopping");
  const auto worker = engine_load_.Least(usable, next_id_.load(), now);
  if (!worker) {
    return Fail(x, 503, "no_workers",
                "no router answers, and no engine serving the model that serves a request alone is left to try",
                {{"retry-after", "1"}});
  }
  if (first) {
    router_fallbacks_->Increment();
    log_.Log(LogLevel::kWarning, "router-fallback",
             "no router answers: request {} goes to the least loaded engine, worker {} (--router-fallback)",
             x->request_id, *worker);
  }
  {
    x->AssertOnItsThread();
    if (x->done || x->attempt != attempt) return;
    x->routed = RouteReply{};
    x->routed.worker_id = *worker;
  }
  Forward(x, attempt);
}

void Gateway::Fail(const std::shared_ptr<Exchange>& x, int status, std::string_view code, const std::string& message,
                   HttpHeaders extra) {
  Finish(x, status, [&](Exchange& e) {
    if (e.began()) return e.reply->Abort();
    extra.emplace_back("content-type", "application/json");
    extra.emplace_back("x-request-id", e.request_id);
    e.reply->Send(status, std::move(extra), OpenAiError(message, ErrorType(status), code));
  });
}

void Gateway::Free(const std::shared_ptr<Exchange>& x) {
  std::string booking;
  std::optional<ResponseTiming> timing;
  {
    x->AssertOnItsThread();
    if (!x->booked) return;
    x->booked = false;
    booking = x->booking;
    // A streamed 200 only: a plain response's first byte comes after the whole generation, an
    // error's says nothing of the engine's speed, nor does a response the engine broke off (a
    // dying engine's stall). A client going away leaves what was measured true.
    if (x->began() && x->request.stream && x->engine_status == 200 && !x->engine_broke) timing = x->timing;
  }
  link_.Free(booking, timing);
}

}  // namespace kvrouter
