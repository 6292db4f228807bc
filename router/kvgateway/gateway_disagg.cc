// Gateway: the two legs of a disaggregated request (docs/protocol.md section 13; gateway.h).
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <utility>

#include "router/kvgateway/exchange.h"
#include "router/kvgateway/headers.h"

namespace kvrouter {

void Gateway::CountDisaggPath(const std::shared_ptr<Exchange>& x) {
  bool disaggregated = false;
  std::vector<std::uint64_t> allowed, excluded;
  {
    x->AssertOnItsThread();
    disaggregated = x->routed.disaggregated;
    if (!disaggregated) {
      allowed = x->allowed;
      excluded = x->excluded;
    }
  }
  prometheus::Counter* path = disagg_disaggregated_;
  if (!disaggregated) {
    // Eligible (protocol.md section 13): the candidates hold prefill and decode workers. Whole
    // to a decode worker with every prefill candidate excluded is the fallback; otherwise the
    // router chose a local prefill (a prefill pool full under --router-queue-threshold reads as
    // local here: the reply does not say which).
    bool decode = false, prefill = false, prefill_usable = false;
    for (std::uint64_t id : allowed) {
      const WorkerRole role = directory_.Role(id);
      decode = decode || role == WorkerRole::kDecode;
      if (role != WorkerRole::kPrefill) continue;
      prefill = true;
      prefill_usable = prefill_usable || std::find(excluded.begin(), excluded.end(), id) == excluded.end();
    }
    if (!decode || !prefill) return;
    path = prefill_usable ? disagg_local_ : disagg_fallback_;
  }
  path->Increment();
}

void Gateway::Disaggregate(const std::shared_ptr<Exchange>& x, std::uint32_t attempt) {
  RouteReply routed;
  {
    if (x->done || x->attempt != attempt) return;
    x->Enter(Exchange::Stage::kCalling);
    routed = x->routed;
  }
  if (routed.kv_connector == "sglang") {
    // One body for both engines, sent to both at once: SGLang's decode engine and prefill engine
    // meet by bootstrap_room, and either waiting for the other's answer could deadlock the
    // transfer.
    auto body = WithFields(x->http.body, {{"bootstrap_host", DumpJson(nlohmann::json(routed.bootstrap_host))},
                                          {"bootstrap_port", std::to_string(routed.bootstrap_port)},
                                          {"bootstrap_room", std::to_string(routed.bootstrap_room)}});
    if (!body.ok()) return Fail(x, 400, "invalid_request", body.status().message());
    {
      x->AssertOnItsThread();
      x->leg_body = *body;
    }
    if (!StartPrefillLeg(x, attempt, std::move(body).value())) return;
    return Forward(x, attempt);
  }
  // vLLM's NixlConnector (pull): the prefill leg first, the decode leg with its answer.
  auto body = NixlPrefillBody(x->http.body);
  if (!body.ok()) return Fail(x, 400, "invalid_request", body.status().message());
  StartPrefillLeg(x, attempt, std::move(body).value());
}

bool Gateway::StartPrefillLeg(const std::shared_ptr<Exchange>& x, std::uint32_t attempt, std::string body) {
  std::uint64_t worker = 0;
  std::string url;
  bool sglang = false;
  {
    x->AssertOnItsThread();
    if (x->done || x->attempt != attempt) return false;
    worker = x->routed.prefill_worker_id;
    url = x->routed.prefill_http_url;
    sglang = x->routed.kv_connector == "sglang";
  }
  auto endpoint = EngineEndpoint(worker, std::move(url));
  if (!endpoint.ok()) {
    Retry(x, attempt, worker, fmt::format("prefill worker {} has no usable http_url", worker));
    return false;
  }
  HttpCallSpec spec = EngineCall(*x, std::move(body));
  std::uint64_t seq = 0;
  {
    x->AssertOnItsThread();
    if (x->done || x->attempt != attempt) return false;
    x->prefill_called = std::chrono::steady_clock::now();
    seq = ++x->prefill_seq;
  }
  EngineLoad::Hold load = engine_load_.Add(worker);
  auto call = client_.Start(
      *endpoint, std::move(spec),
      {.on_head =
           [ex = x, attempt](int status, const HttpHeaders& headers) {
             ex->AssertOnItsThread();
             if (ex->attempt != attempt) return;
             ex->prefill_status = status;
             ex->prefill_headers.clear();
             ForwardResponseHeaders(headers, ex->prefill_headers);
           },
       .on_data =
           [ex = x, attempt](std::string_view d) {
             ex->AssertOnItsThread();
             if (ex->done || ex->attempt != attempt) return;
             if (ex->prefill_body.size() + d.size() <= kMaxHeldBody) {
               ex->prefill_body.append(d);
             } else {
               ex->prefill_overflow = true;
             }
           },
       .on_done =
           [this, ex = x, attempt, sglang, load](const Status& s) {
             if (sglang) return OnSglangPrefillEnd(ex, attempt, s);
             OnNixlPrefillAnswer(ex, attempt, s);
           }});
  {
    x->AssertOnItsThread();
    if (!x->done && x->attempt == attempt) {
      if (x->prefill_seq == seq) x->prefill_call = std::move(call);
      return true;
    }
  }
  call->Cancel();  // the client went (or the attempt was retried) while the leg was being started
  return false;
}

namespace {

// A prefill leg's end as its handler reads it.
struct PrefillEnd {
  int status = 0;
  HttpHeaders headers;  // for the client (ForwardResponseHeaders)
  std::string body;
  bool overflow = false;
  bool began = false;  // the client has the response head
  std::uint64_t worker = 0;
  std::string booking;
  SteadyTime called;
};

// The prefill leg's end, taken from the exchange; nullopt when it is no longer at `attempt`
// (ended, or retried: a leg closed then ends unheard).
std::optional<PrefillEnd> TakePrefillEnd(Gateway::Exchange& x, std::uint32_t attempt) {
  x.AssertOnItsThread();
  if (x.done || x.attempt != attempt) return std::nullopt;
  x.prefill_call.reset();
  return PrefillEnd{.status = x.prefill_status,
                    .headers = std::move(x.prefill_headers),
                    .body = std::move(x.prefill_body),
                    .overflow = x.prefill_overflow,
                    .began = x.began(),
                    .worker = x.routed.prefill_worker_id,
                    .booking = x.booking,
                    .called = x.prefill_called};
}

std::string PrefillFailure(const Status& s, const PrefillEnd& end) {
  if (!s.ok()) return fmt::format("prefill worker {} failed: {}", end.worker, s.message());
  return fmt::format("prefill worker {} answered {}: {}", end.worker, end.status, end.body.substr(0, 256));
}

}  // namespace

void Gateway::OnNixlPrefillAnswer(const std::shared_ptr<Exchange>& x, std::uint32_t attempt, const Status& s) {
  const SteadyTime now = std::chrono::steady_clock::now();
  auto taken = TakePrefillEnd(*x, attempt);
  if (!taken) return;
  PrefillEnd& end = *taken;
  if (s.code() == StatusCode::kTimeout) {
    return Fail(x, 504, "engine_timeout", EngineTimeoutMessage(end.worker, config_.engine_timeout_ms, s));
  }
  if (!s.ok() || end.status >= 500) return Retry(x, attempt, end.worker, PrefillFailure(s, end));
  if (end.overflow) {
    return Fail(x, 502, "engine_failed", "the prefill engine's answer is larger than the gateway holds");
  }
  // The engine refused the request itself (a 4xx): another engine would too; its answer is the client's.
  if (end.status != 200) {
    return AnswerWhole(x, end.status, "application/json", std::move(end.body), std::move(end.headers));
  }
  auto answer = ParsePrefillAnswer(end.body);
  if (!answer.ok()) return Retry(x, attempt, end.worker, answer.status().message());
  prefill_leg_->Observe(Seconds(now - end.called));
  if (answer->kv_transfer_params.empty() && answer->stopped_at_length && x->request.max_tokens.value_or(2) > 1) {
    // It stopped at the leg's one-token limit yet names no KV to pull: an engine without vLLM's
    // NixlConnector (no --kv-transfer-config). Its one token is not the client's answer.
    return Retry(x, attempt, end.worker,
                 fmt::format("prefill worker {} answered without kv_transfer_params: is its engine started with "
                             "--kv-transfer-config (NixlConnector)?",
                             end.worker));
  }
  if (answer->kv_transfer_params.empty()) {
    // The engine stopped at its one token (end of sequence, a stop string, max_tokens 1): there
    // is nothing to decode, and its answer is the client's.
    if (!x->request.stream) return AnswerWhole(x, 200, "application/json", std::move(end.body), std::move(end.headers));
    auto events = AsEventStream(x->request.kind, end.body, x->request.include_usage);
    if (!events.ok()) return Fail(x, 502, "engine_failed", events.status().message());
    return AnswerWhole(x, 200, "text/event-stream", std::move(events).value(), std::move(end.headers));
  }
  auto body = WithFields(x->http.body, {{"kv_transfer_params", answer->kv_transfer_params}});
  if (!body.ok()) return Fail(x, 400, "invalid_request", body.status().message());
  {
    x->AssertOnItsThread();
    if (x->done || x->attempt != attempt) return;
    x->leg_body = std::move(body).value();
    x->prefill_answered = true;
    x->prefill_end = now;
    x->prefill_cached = answer->cached_tokens;
  }
  link_.PrefillDone(end.booking);
  Forward(x, attempt);
}

void Gateway::OnSglangPrefillEnd(const std::shared_ptr<Exchange>& x, std::uint32_t attempt, const Status& s) {
  const SteadyTime now = std::chrono::steady_clock::now();
  auto taken = TakePrefillEnd(*x, attempt);
  if (!taken) return;
  PrefillEnd& end = *taken;
  if (!s.ok() || end.status != 200) {
    // The decode engine would wait for KV that never comes. Before the client has a byte the
    // request goes elsewhere (a failure) or gets the engine's refusal (a 4xx); after it the
    // decode leg, which has its KV, goes on.
    if (end.began) {
      log_.Log(LogLevel::kWarning, "prefill-failed", "request {}: after the decode leg began: {}", x->request_id,
               PrefillFailure(s, end));
      return;
    }
    if (s.code() == StatusCode::kTimeout) {
      return Fail(x, 504, "engine_timeout", EngineTimeoutMessage(end.worker, config_.engine_timeout_ms, s));
    }
    if (!s.ok() || end.status >= 500) return Retry(x, attempt, end.worker, PrefillFailure(s, end));
    return AnswerWhole(x, end.status, "application/json", std::move(end.body), std::move(end.headers));
  }
  prefill_leg_->Observe(Seconds(now - end.called));
  std::optional<std::uint32_t> cached;
  if (!x->request.stream && !end.overflow) {
    if (auto answer = ParsePrefillAnswer(end.body); answer.ok()) cached = answer->cached_tokens;
  }
  {
    x->AssertOnItsThread();
    if (x->done || x->attempt != attempt) return;
    x->prefill_answered = true;
    x->prefill_end = now;
    x->prefill_cached = cached;
  }
  link_.PrefillDone(end.booking);
}

}  // namespace kvrouter
