#include "router/kvbench/online.h"

#include <fmt/format.h>

#include <charconv>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "events/router_endpoints_codec.h"
#include "events/msgpack_reader.h"
#include "events/subjects.h"
#include "events/worker_codec.h"
#include "router/kvbench/fleet_stats.h"
#include "transport/nats_client.h"
#include "events/base/thread_annotations.h"

namespace kvrouter::bench {
namespace {

using Clock = std::chrono::steady_clock;

// One online replay: requests sent through router.generate on the trace's schedule, at most
// `concurrency` unanswered, their responses collected on one inbox subscription (its thread).
// A request that gets NATS "no responders", a retryable error (`no_workers`, `timeout`), or no
// message for request_timeout_s is sent again (as a new attempt with its own inbox and request
// id, so a late answer to an old attempt is ignored), up to `retries` times.
class OnlineReplay {
 public:
  OnlineReplay(NatsClient& client, const std::vector<TraceRequest>& trace, const OnlineOptions& o)
      : client_(client),
        trace_(trace),
        o_(o),
        start_(Clock::now()),
        inbox_(fmt::format("_KVBENCH.{:x}.", std::random_device{}() * 0x9E3779B97F4A7C15ULL)),
        records_(trace.size()),
        attempt_(trace.size(), 0),
        heard_ms_(trace.size(), -1),
        last_token_ms_(trace.size(), -1) {}

  Result<std::vector<RequestRecord>> Run() {
    auto sub = client_.Subscribe(inbox_ + ">", "", [this](const IncomingMessage& m) { OnResponse(m); });
    if (!sub.ok()) return sub.status();
    std::thread watchdog;
    if (o_.request_timeout_s > 0) watchdog = std::thread([this] { Watch(); });
    for (std::size_t i = 0; i < trace_.size(); ++i) {
      if (!Send(i)) break;
      if (o_.progress && (i + 1) % std::max<std::size_t>(1, trace_.size() / 10) == 0) {
        fmt::print(stderr, "kvbench {}: {}/{} sent\n", o_.label, i + 1, trace_.size());
      }
    }
    std::vector<RequestRecord> out;
    {
      KvMutexLock lk(mu_);
      const bool all = cv_.wait_for(mu_, std::chrono::duration<double>(o_.timeout_s), [&] {
        mu_.AssertHeld();
        return done_ == trace_.size();
      });
      if (!all) {
        for (auto& r : records_) {
          if (r.finished_ms < 0) r.error = true;
        }
      }
      out = records_;
      stopping_ = true;
      cv_.notify_all();
    }
    if (watchdog.joinable()) watchdog.join();
    sub->reset();  // no handler runs after this
    return out;
  }

  std::size_t retries() {
    KvMutexLock g(mu_);
    return retries_;
  }

  // Every gap between a request's tokens, when each message after the first carried one token;
  // empty when some carried several (the worker answers later tokens together, as section 7's
  // NATS generate does), so their gaps are unknown.
  TokenGaps token_gaps() {
    KvMutexLock g(mu_);
    return tokens_batched_ ? TokenGaps{} : gaps_;
  }

 private:
  double MsSinceStart() const { return std::chrono::duration<double, std::milli>(Clock::now() - start_).count(); }

  // Waits for request i's time and for room, then sends it; false when the run gives up.
  bool Send(std::size_t i) {
    SleepUntilDue(trace_, i, start_);
    {
      KvMutexLock lk(mu_);
      if (!AwaitRoom(mu_, cv_, in_flight_, o_)) {  // the rest of the trace counts as errors
        for (std::size_t k = i; k < trace_.size(); ++k) {
          records_[k].error = true;
          ++done_;
        }
        return false;
      }
      ++in_flight_;
      records_[i].arrival_ms = MsSinceStart();
      records_[i].prompt_tokens = trace_[i].input_length;
    }
    Publish(i, 0);
    return true;
  }

  // Sends attempt `attempt` of request i (its own inbox subject and request id).
  void Publish(std::size_t i, std::uint32_t attempt) {
    {
      KvMutexLock g(mu_);
      attempt_[i] = attempt;
      heard_ms_[i] = MsSinceStart();
      last_token_ms_[i] = -1;  // the attempt generates every token again
      records_[i].output_tokens = 0;
    }
    RouteRequest req{.request_id = fmt::format("kvbench-{}-{}-{}", start_.time_since_epoch().count(), i, attempt),
                     .token_ids = TokensFor(trace_[i]),
                     .has_token_ids = true};
    req.isl = static_cast<std::uint32_t>(req.token_ids.size());
    req.max_tokens = std::max<std::uint32_t>(1, trace_[i].output_length);
    if (o_.request_timeout_s > 0) {  // the router abandons it (and frees its booking) as we do
      req.timeout_ms = static_cast<std::uint32_t>(o_.request_timeout_s * 1000);
    }
    const std::string subject = RouterEndpointSubject(o_.ns, router_endpoint::kGenerate);
    if (Status s = client_.PublishRequest(subject, fmt::format("{}{}.{}", inbox_, i, attempt),
                                          AsBytes(EncodeRouteRequest(req)));
        !s.ok()) {
      KvMutexLock g(mu_);
      if (attempt_[i] == attempt) Fail(i);
    }
  }

  // Request i's current attempt failed in a way worth another try: true when one is left (the
  // caller publishes it after releasing mu_), else the request is closed as an error.
  bool RetryOrFail(std::size_t i) KV_REQUIRES(mu_) {
    if (attempt_[i] < o_.retries) {
      ++retries_;
      ++attempt_[i];  // answers to the old attempt are ignored from now on
      return true;
    }
    Fail(i);
    return false;
  }

  void Fail(std::size_t i) KV_REQUIRES(mu_) {
    records_[i].error = true;
    Finish();
  }

  // A response (or an error reply) for request i, on the inbox subscription's thread.
  void OnResponse(const IncomingMessage& m) {
    std::size_t i = 0;
    std::uint32_t attempt = 0;
    const std::string_view tail = m.subject.substr(inbox_.size());
    const char* end = tail.data() + tail.size();
    auto [p, ec] = std::from_chars(tail.data(), end, i);
    if (ec != std::errc() || i >= trace_.size() || p == end || *p != '.' ||
        std::from_chars(p + 1, end, attempt).ec != std::errc()) {
      return;
    }
    const double now = MsSinceStart();
    std::optional<std::uint32_t> again;
    {
      KvMutexLock g(mu_);
      RequestRecord& r = records_[i];
      if (r.finished_ms >= 0 || r.error || attempt != attempt_[i]) return;  // closed, or an old attempt
      heard_ms_[i] = now;
      const auto status = m.Header("Status");
      const Status err = DecodeErrorReply(m.data);
      const bool no_responders = m.data.empty() && status && status->starts_with("503");
      const bool retryable =
          no_responders || err.code() == StatusCode::kNoWorkers || err.code() == StatusCode::kTimeout;
      auto resp = GenerateResponse::Decode(m.data);
      if (retryable) {
        if (RetryOrFail(i)) again = attempt_[i];
      } else if (!err.ok() || !resp.ok()) {
        Fail(i);
      } else {
        if (r.first_token_ms < 0) r.first_token_ms = now;
        CountTokens(i, resp->token_ids.size(), now);
        if (!resp->is_final()) return;
        r.finished_ms = now;
        r.cached_tokens = resp->cached_tokens;
        if (resp->prompt_tokens > 0) r.prompt_tokens = resp->prompt_tokens;
        if (*resp->finish_reason == "error") r.error = true;
        Finish();
      }
    }
    if (again) Publish(i, *again);
  }

  // Every 100 ms: requests silent for request_timeout_s are tried again (or closed).
  void Watch() {
    while (true) {
      std::vector<std::pair<std::size_t, std::uint32_t>> again;
      {
        KvMutexLock lk(mu_);
        // A timer, not a wait for a condition: a silent request has no event to wait on.
        cv_.wait_for(mu_, std::chrono::milliseconds(100), [&] {
          mu_.AssertHeld();
          return stopping_;
        });
        if (stopping_) return;
        const double now = MsSinceStart();
        for (std::size_t i = 0; i < records_.size(); ++i) {
          const RequestRecord& r = records_[i];
          if (heard_ms_[i] < 0) continue;  // not sent yet
          if (r.finished_ms >= 0 || r.error || now - heard_ms_[i] < o_.request_timeout_s * 1000) continue;
          if (RetryOrFail(i)) again.emplace_back(i, attempt_[i]);
          heard_ms_[i] = now;
        }
      }
      for (auto [i, attempt] : again) Publish(i, attempt);
    }
  }

  // A message of request i's current attempt carried `tokens` tokens at `now`.
  void CountTokens(std::size_t i, std::size_t tokens, double now) KV_REQUIRES(mu_) {
    if (tokens == 0) return;
    records_[i].output_tokens += static_cast<std::uint32_t>(tokens);
    if (last_token_ms_[i] >= 0 && tokens == 1) {
      gaps_.Add(now - last_token_ms_[i]);
    } else if (tokens > 1) {
      tokens_batched_ = true;  // several tokens in one message: the gaps between them are unknown
    }
    last_token_ms_[i] = now;
  }

  void Finish() KV_REQUIRES(mu_) {
    --in_flight_;
    ++done_;
    cv_.notify_all();
  }

  NatsClient& client_;
  const std::vector<TraceRequest>& trace_;
  const OnlineOptions& o_;
  const Clock::time_point start_;
  const std::string inbox_;
  KvMutex mu_;
  std::condition_variable_any cv_;
  std::vector<RequestRecord> records_ KV_GUARDED_BY(mu_);
  std::vector<std::uint32_t> attempt_ KV_GUARDED_BY(mu_);  // per request: its current attempt
  std::vector<double> heard_ms_ KV_GUARDED_BY(mu_);        // per request: last sent or answered; -1: unsent
  std::vector<double> last_token_ms_ KV_GUARDED_BY(mu_);   // per request: its attempt's last token; -1: none
  TokenGaps gaps_ KV_GUARDED_BY(mu_);
  bool tokens_batched_ KV_GUARDED_BY(mu_) = false;  // a message carried several tokens
  std::size_t in_flight_ KV_GUARDED_BY(mu_) = 0;
  std::size_t done_ KV_GUARDED_BY(mu_) = 0;
  std::size_t retries_ KV_GUARDED_BY(mu_) = 0;
  bool stopping_ KV_GUARDED_BY(mu_) = false;
};

}  // namespace

Result<Summary> RunOnline(const std::vector<TraceRequest>& trace, const OnlineOptions& o) {
  return RunWithFleetStats(trace, o, [&](NatsClient& client) -> Result<ReplayOutcome> {
    OnlineReplay replay(client, trace, o);
    auto records = replay.Run();
    if (!records.ok()) return records.status();
    return ReplayOutcome{.records = std::move(records).value(), .gaps = replay.token_gaps(), .retries = replay.retries()};
  });
}

}  // namespace kvrouter::bench
