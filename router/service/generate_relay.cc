#include "router/service/generate_relay.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <optional>

#include "events/msgpack_reader.h"
#include "events/worker_codec.h"

namespace kvrouter {

GenerateRelay::GenerateRelay(MessageBus& bus, Routing& routing, std::string reply_prefix, Routing::Clock clock,
                             RateLimitedLog& log)
    : bus_(bus), routing_(routing), reply_prefix_(std::move(reply_prefix)), clock_(std::move(clock)), log_(log) {}

void GenerateRelay::Forward(Outbox::Forward f, const std::string& worker_subject, Outbox& out) {
  const RouteRequest& req = f.request;
  const auto timeout =
      req.timeout_ms ? std::chrono::milliseconds(*req.timeout_ms) : std::chrono::milliseconds(kDefaultTimeout);
  std::uint64_t n = 0;
  {
    KvMutexLock g(mu_);
    n = ++next_;
    const SteadyTime now = clock_();
    inflight_[n] = InFlight{.request_id = req.request_id,
                            .caller_reply = f.caller_reply,
                            .deadline = now + timeout,
                            .idle = timeout,
                            .forwarded = now};
  }
  const msgpack::sbuffer body =
      GenerateRequest{.request_id = req.request_id,
                      .token_ids = req.token_ids,
                      .max_tokens = req.max_tokens.value_or(req.expected_output_tokens.value_or(16)),
                      .dp_rank = f.routed.dp_rank}
          .Encode();
  const Status s = bus_.PublishRequest(worker_subject, reply_prefix_ + std::to_string(n), AsBytes(body));
  if (s.ok()) return;
  log_.Log(LogLevel::kWarning, "forward", "forwarding to {} failed: {}", worker_subject, s.message());
  {
    KvMutexLock g(mu_);
    inflight_.erase(n);
  }
  (void)routing_.Free(req.request_id, out);
  out.errors.emplace_back(std::move(f.caller_reply),
                          Status(StatusCode::kNoWorkers, fmt::format("could not reach the worker: {}", s.message())));
}

void GenerateRelay::OnResponse(const BusMessage& m, Outbox& out) {
  std::uint64_t n = 0;
  const std::string_view tail = m.subject.substr(std::min(m.subject.size(), reply_prefix_.size()));
  if (std::from_chars(tail.data(), tail.data() + tail.size(), n).ec != std::errc()) return;
  // A worker that is gone shows as NATS "no responders" (status 503, empty body).
  const auto status = m.Header("Status");
  const bool no_responders = m.data.empty() && status && status->starts_with("503");
  // Its tokens, for the timing (a worker may send several in one response), and whether it is
  // the final one. An undecodable response ends the request too (the caller gets it as it came),
  // unless it is a map without finish_reason.
  const auto decoded = no_responders ? Result<GenerateResponse>(Internal("none")) : GenerateResponse::Decode(m.data);
  bool final = no_responders;
  if (!final) {
    if (decoded.ok()) {
      final = decoded->is_final();
    } else {
      auto is_final = IsFinalGenerateResponse(m.data);
      final = !is_final.ok() || *is_final;
    }
  }
  std::string caller, request_id;
  bool first = false;
  std::optional<ResponseTiming> timing;
  {
    KvMutexLock g(mu_);
    auto it = inflight_.find(n);
    if (it == inflight_.end()) return;  // late, after a timeout
    InFlight& f = it->second;
    caller = f.caller_reply;
    request_id = f.request_id;
    first = !f.first_seen;
    f.first_seen = true;
    const SteadyTime now = clock_();
    f.deadline = now + f.idle;  // the worker is alive: as long again
    if (!no_responders) {
      ResponseTiming& t = f.timing;
      if (first) {
        t.ttfb_ms = std::chrono::duration<double, std::milli>(now - f.forwarded).count();
        f.first_response = now;
        t.chunks = 1;
      } else {
        t.inter_chunk_ms_max =
            std::max(t.inter_chunk_ms_max, std::chrono::duration<double, std::milli>(now - f.last_response).count());
        // Chunks are tokens here: the mean time per token after the first response.
        t.chunks += decoded.ok() ? static_cast<std::uint32_t>(decoded->token_ids.size()) : 0;
        if (t.chunks > 1) {
          t.inter_chunk_ms_mean =
              std::chrono::duration<double, std::milli>(now - f.first_response).count() / (t.chunks - 1);
        }
      }
      f.last_response = now;
      // A worker that fails at once must not look fast: only a final response that decodes and
      // did not end in an error teaches its rank's rates.
      if (final && decoded.ok() && decoded->finish_reason != "error") timing = t;
    }
    if (final) inflight_.erase(it);
  }
  if (first) (void)routing_.MarkPrefill(request_id, out);  // first response: prefill is done
  if (final) (void)routing_.Free(request_id, out, timing);
  if (no_responders) {
    out.errors.emplace_back(caller, Status(StatusCode::kNoWorkers, "the chosen worker did not answer"));
  } else if (!caller.empty()) {
    (void)bus_.Publish(caller, m.data);  // relayed unchanged
  }
}

void GenerateRelay::Expire(Outbox& out) {
  const SteadyTime now = clock_();
  std::vector<InFlight> expired;
  {
    KvMutexLock g(mu_);
    for (auto it = inflight_.begin(); it != inflight_.end();) {
      if (now < it->second.deadline) {
        ++it;
        continue;
      }
      expired.push_back(std::move(it->second));
      it = inflight_.erase(it);
    }
  }
  for (InFlight& f : expired) {
    (void)routing_.Free(f.request_id, out);
    out.errors.emplace_back(std::move(f.caller_reply),
                            Status(StatusCode::kTimeout, "the worker did not finish in time"));
  }
}

std::size_t GenerateRelay::in_flight() const {
  KvMutexLock g(mu_);
  return inflight_.size();
}

}  // namespace kvrouter
