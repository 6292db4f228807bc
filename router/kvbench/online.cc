#include "router/kvbench/online.h"

#include <fmt/format.h>

#include <charconv>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "events/message_codec.h"
#include "events/msgpack_reader.h"
#include "events/worker_codec.h"
#include "router/worker_key.h"
#include "transport/nats_client.h"

namespace kvrouter::bench {
namespace {

using Clock = std::chrono::steady_clock;

// Requests routed so far per (worker, dp_rank), from the router's stats (every page).
Result<std::map<WorkerKey, std::uint64_t>> RoutedPerWorker(NatsClient& nc, const std::string& ns) {
  std::map<WorkerKey, std::uint64_t> out;
  std::optional<std::uint64_t> next = 0;
  while (next) {
    auto reply = nc.Request(fmt::format("namespace.{}.router.stats", ns),
                            AsBytes(EncodeStatsRequest({.offset = *next, .limit = StatsRequest::kMaxLimit})),
                            std::chrono::seconds(5));
    if (!reply.ok()) return reply.status();
    auto stats = DecodeStatsReply(*reply);
    if (!stats.ok()) return stats.status();
    for (const WorkerStats& w : stats->workers) out[{w.worker_id, w.dp_rank}] = w.routed_requests;
    next = stats->next_offset;
  }
  return out;
}

}  // namespace

Result<Summary> RunOnline(const std::vector<TraceRequest>& trace, const OnlineOptions& o) {
  auto nc = NatsClient::Connect({.url = o.nats_url, .name = "kvbench", .retry_on_failed_connect = false, .send_asap = true}, {});
  if (!nc.ok()) return nc.status();
  NatsClient& client = **nc;
  if (o.wait_workers > 0) {
    // Workers register with heartbeats; poll the router's stats until they are all in.
    const auto deadline = Clock::now() + std::chrono::seconds(30);
    while (true) {
      auto known = RoutedPerWorker(client, o.ns);
      if (known.ok() && known->size() >= o.wait_workers) break;
      if (Clock::now() > deadline) {
        return Status(StatusCode::kNoWorkers, fmt::format("the router did not see {} workers within 30 s", o.wait_workers));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  auto before = RoutedPerWorker(client, o.ns);
  if (!before.ok()) return Status(before.status().code(), "router stats: " + before.status().message());

  std::mutex mu;
  std::condition_variable cv;
  std::vector<RequestRecord> records(trace.size());  // GUARDED_BY(mu)
  std::size_t in_flight = 0, done = 0;               // GUARDED_BY(mu)
  const Clock::time_point start = Clock::now();
  auto ms_since_start = [&] { return std::chrono::duration<double, std::milli>(Clock::now() - start).count(); };

  const std::string inbox = fmt::format("_KVBENCH.{:x}.", std::random_device{}() * 0x9E3779B97F4A7C15ULL);
  auto sub = client.Subscribe(inbox + "*", "", [&](const IncomingMessage& m) {
    std::size_t i = 0;
    const std::string_view tail = m.subject.substr(inbox.size());
    if (std::from_chars(tail.data(), tail.data() + tail.size(), i).ec != std::errc() || i >= records.size()) return;
    const double now = ms_since_start();
    bool finished = false;
    std::lock_guard g(mu);
    RequestRecord& r = records[i];
    if (r.finished_ms >= 0 || r.error) return;  // already closed
    if (Status err = DecodeErrorReply(m.data); !err.ok()) {
      r.error = true;
      finished = true;
    } else if (auto resp = GenerateResponse::Decode(m.data); !resp.ok()) {
      r.error = true;
      finished = true;
    } else {
      if (r.first_token_ms < 0) r.first_token_ms = now;
      if (resp->is_final()) {
        finished = true;
        r.finished_ms = now;
        r.cached_tokens = resp->cached_tokens;
        if (resp->prompt_tokens > 0) r.prompt_tokens = resp->prompt_tokens;
        if (*resp->finish_reason == "error") r.error = true;
      }
    }
    if (finished) {
      --in_flight;
      ++done;
      cv.notify_all();
    }
  });
  if (!sub.ok()) return sub.status();

  const std::string subject = fmt::format("namespace.{}.router.generate", o.ns);
  const double t0 = trace.empty() ? 0 : trace.front().timestamp_ms;
  const std::size_t report_every = std::max<std::size_t>(1, trace.size() / 10);
  for (std::size_t i = 0; i < trace.size(); ++i) {
    // Pacing a load generator on the wall clock is its job, not a wait for a condition.
    std::this_thread::sleep_until(start + std::chrono::microseconds(static_cast<std::int64_t>((trace[i].timestamp_ms - t0) * 1000)));
    {
      std::unique_lock lk(mu);
      // Responses that never come (a worker killed, messages dropped) must not hang the run:
      // after timeout_s without room, the rest of the trace is counted as errors.
      if (!cv.wait_for(lk, std::chrono::duration<double>(o.timeout_s), [&] { return in_flight < o.concurrency; })) {
        fmt::print(stderr, "kvbench {}: no response for {} s with {} requests in flight; giving up\n", o.label,
                   o.timeout_s, in_flight);
        for (std::size_t k = i; k < trace.size(); ++k) {
          records[k].error = true;
          ++done;
        }
        break;
      }
      ++in_flight;
      records[i].arrival_ms = ms_since_start();
      records[i].prompt_tokens = trace[i].input_length;
    }
    RouteRequest req{.request_id = fmt::format("kvbench-{}-{}", start.time_since_epoch().count(), i),
                     .token_ids = TokensFor(trace[i]),
                     .has_token_ids = true};
    req.isl = static_cast<std::uint32_t>(req.token_ids.size());
    req.max_tokens = std::max<std::uint32_t>(1, trace[i].output_length);
    if (Status s = client.PublishRequest(subject, inbox + std::to_string(i), AsBytes(EncodeRouteRequest(req))); !s.ok()) {
      std::lock_guard g(mu);
      records[i].error = true;
      --in_flight;
      ++done;
    }
    if (o.progress && (i + 1) % report_every == 0) fmt::print(stderr, "kvbench {}: {}/{} sent\n", o.label, i + 1, trace.size());
  }
  {
    std::unique_lock lk(mu);
    const bool all = cv.wait_for(lk, std::chrono::duration<double>(o.timeout_s), [&] { return done == trace.size(); });
    if (!all) {
      for (auto& r : records) {
        if (r.finished_ms < 0) r.error = true;
      }
    }
  }
  sub->reset();  // no handler runs after this
  auto after = RoutedPerWorker(client, o.ns);
  std::vector<RequestRecord> final_records;
  {
    std::lock_guard g(mu);
    final_records = records;
  }
  // Attribute requests to workers by the router's per-worker counters.
  Summary s = Summarize(o.label, final_records, {});
  if (!after.ok()) {
    fmt::print(stderr, "kvbench: router stats after the run: {}\n", after.status().message());
  } else {
    for (const auto& [w, n] : *after) {
      const auto b = before->find(w);
      s.worker_requests.push_back(n - (b == before->end() ? 0 : b->second));
    }
  }
  return s;
}

}  // namespace kvrouter::bench
