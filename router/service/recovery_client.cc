#include "router/service/recovery_client.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>

#include "events/msgpack_reader.h"
#include "events/subjects.h"
#include "events/worker_codec.h"

namespace kvrouter {
namespace {

constexpr std::chrono::milliseconds kFirstBackoff{100};
constexpr std::chrono::milliseconds kMaxBackoff{10000};

}  // namespace

RecoveryClient::RecoveryClient(Options options, MessageBus& bus, ShardedIndex& index, Clock clock, RateLimitedLog& log)
    : options_(std::move(options)), bus_(bus), index_(index), clock_(std::move(clock)), log_(log) {}

void RecoveryClient::Need(WorkerKey worker, SequenceKind numbering, std::optional<std::uint64_t> start,
                          std::uint64_t generation) {
  std::vector<std::pair<std::uint64_t, Ask>> starts;
  bool backed_off = false;
  {
    KvMutexLock g(mu_);
    const auto now = clock_();
    auto b = backoff_.find(worker.worker_id);
    if (b != backoff_.end() && now < b->second.until) {
      ++counters_.backed_off;
      backed_off = true;
    } else {
      waiting_.push_back({worker, numbering, start, generation});
      starts = StartLocked(now);
    }
  }
  // It failed recently: do not hold its events for another try now.
  if (backed_off) {
    index_.Recovered(
        {.worker = worker, .numbering = numbering, .kind = RecoveryPart::Kind::kFailed, .generation = generation});
  }
  Publish(std::move(starts));
}

void RecoveryClient::Pause() {
  KvMutexLock g(mu_);
  paused_ = true;
}

void RecoveryClient::Cancel(std::span<const std::pair<WorkerKey, std::uint64_t>> asks) {
  KvMutexLock g(mu_);
  for (const auto& ask : asks) {
    const std::size_t before = waiting_.size();
    std::erase_if(waiting_, [&](const Ask& a) { return a.worker == ask.first && a.generation == ask.second; });
    counters_.cancelled += before - waiting_.size();
  }
  if (in_flight_.empty() && waiting_.empty()) idle_.notify_all();
}

void RecoveryClient::Resume() {
  std::vector<std::pair<std::uint64_t, Ask>> starts;
  {
    KvMutexLock g(mu_);
    paused_ = false;
    starts = StartLocked(clock_());
  }
  Publish(std::move(starts));
}

std::vector<std::pair<std::uint64_t, RecoveryClient::Ask>> RecoveryClient::StartLocked(SteadyTime now) {
  std::vector<std::pair<std::uint64_t, Ask>> starts;
  if (paused_) return starts;
  for (auto it = waiting_.begin(); it != waiting_.end() && in_flight_.size() < options_.max_in_flight;) {
    const std::uint64_t n = ++next_;
    in_flight_[n] = {*it, now, now + options_.timeout};
    ++counters_.started;
    if (!it->start) ++counters_.dumps;
    starts.emplace_back(n, *it);
    it = waiting_.erase(it);
  }
  return starts;
}

void RecoveryClient::Publish(std::vector<std::pair<std::uint64_t, Ask>> starts) {
  while (!starts.empty()) {
    std::vector<std::pair<std::uint64_t, Ask>> more;
    for (const auto& [n, ask] : starts) {
      const RecoveryQuery q{.start_event_id = ask.start};
      const msgpack::sbuffer body = q.Encode();
      const std::string subject =
          RecoverySubject(options_.ns, options_.component, ask.worker.worker_id, ask.worker.dp_rank);
      if (Status s = bus_.PublishRequest(subject, options_.reply_prefix + std::to_string(n), AsBytes(body)); !s.ok()) {
        auto next = Fail(n, fmt::format("cannot ask {}: {}", subject, s.message()));
        more.insert(more.end(), next.begin(), next.end());
      }
    }
    starts = std::move(more);
  }
}

std::vector<std::pair<std::uint64_t, RecoveryClient::Ask>> RecoveryClient::Fail(std::uint64_t n, const std::string& why,
                                                                                Failure failure) {
  const bool too_new = failure == Failure::kTooNew;
  RecoveryPart part;
  std::vector<std::pair<std::uint64_t, Ask>> starts;
  {
    KvMutexLock g(mu_);
    auto it = in_flight_.find(n);
    if (it == in_flight_.end()) return {};
    const auto now = clock_();
    // A part may have come between the Tick that found it late and now.
    if (failure == Failure::kLate && now < it->second.deadline && now - it->second.started < options_.max_duration)
      return {};
    part = {.worker = it->second.ask.worker,
            .numbering = it->second.ask.numbering,
            .kind = RecoveryPart::Kind::kFailed,
            .generation = it->second.ask.generation,
            .too_new = too_new};
    // A worker that answers too_new serves the endpoint: no backoff for it. Its range was not
    // recovered, nor did the recovery fail: the dump that follows ends it either way.
    FinishLocked(n, too_new ? Outcome::kRestarted : Outcome::kFailed, now);
    starts = StartLocked(now);
  }
  log_.Log(LogLevel::kInfo, "recovery failed", "recovery of worker {} rank {} failed: {}", part.worker.worker_id,
           part.worker.dp_rank, why);
  index_.Recovered(std::move(part));
  return starts;
}

void RecoveryClient::FinishLocked(std::uint64_t n, Outcome outcome, SteadyTime now) {
  auto it = in_flight_.find(n);
  const double ms = std::chrono::duration<double, std::milli>(now - it->second.started).count();
  ++(outcome == Outcome::kServed ? counters_.succeeded
     : outcome == Outcome::kRestarted ? counters_.restarted
                                      : counters_.failed);
  if (outcome == Outcome::kFailed) {
    Backoff& b = backoff_[it->second.ask.worker.worker_id];
    b.wait = std::min(kMaxBackoff, b.wait.count() == 0 ? kFirstBackoff : b.wait * 2);
    b.until = now + b.wait;
  } else {
    backoff_.erase(it->second.ask.worker.worker_id);
  }
  counters_.total_ms += ms;
  counters_.max_ms = std::max(counters_.max_ms, ms);
  in_flight_.erase(it);
  if (in_flight_.empty() && waiting_.empty()) idle_.notify_all();
}

void RecoveryClient::OnReply(const BusMessage& m) {
  std::uint64_t n = 0;
  const std::string_view tail = m.subject.substr(std::min(m.subject.size(), options_.reply_prefix.size()));
  if (std::from_chars(tail.data(), tail.data() + tail.size(), n).ec != std::errc()) return;
  // NATS "no responders" (status 503, empty body): the worker does not serve the endpoint.
  const auto status = m.Header("Status");
  if (m.data.empty() && status && status->starts_with("503")) return Publish(Fail(n, "no responders"));
  Ask ask;
  {
    KvMutexLock g(mu_);
    auto it = in_flight_.find(n);
    if (it == in_flight_.end()) return;  // late, after a timeout
    ask = it->second.ask;
  }
  auto reply = DecodeRecoveryReply(m.data, ask.worker.worker_id);
  if (!reply.ok()) return Publish(Fail(n, "undecodable reply: " + reply.status().message()));
  if (reply->kind != "events" && reply->kind != "tree_dump") {
    // too_new answers a range only (a dump has no start): then the worker restarted.
    const bool too_new = reply->kind == "too_new" && ask.start.has_value();
    return Publish(
        Fail(n, fmt::format("{}: {}", reply->kind, reply->message), too_new ? Failure::kTooNew : Failure::kError));
  }
  RecoveryPart part{.worker = ask.worker,
                    .numbering = ask.numbering,
                    .kind = reply->kind == "tree_dump" ? RecoveryPart::Kind::kDump : RecoveryPart::Kind::kEvents,
                    .events = std::move(reply->events),
                    .last_event_id = reply->last_event_id,
                    .final = !reply->more,
                    .generation = ask.generation};
  std::vector<std::pair<std::uint64_t, Ask>> starts;
  {
    KvMutexLock g(mu_);
    auto it = in_flight_.find(n);
    if (it == in_flight_.end()) return;
    ++counters_.parts;
    const auto now = clock_();
    if (part.final) {
      FinishLocked(n, Outcome::kServed, now);
      starts = StartLocked(now);
    } else {
      it->second.deadline = now + options_.timeout;  // the next part has as long
    }
  }
  index_.Recovered(std::move(part));
  Publish(std::move(starts));
}

void RecoveryClient::Tick() {
  const auto now = clock_();
  std::vector<std::uint64_t> late;
  {
    KvMutexLock g(mu_);
    for (const auto& [n, f] : in_flight_) {
      // No (next) part in time, or a recovery that goes on too long, however many parts it sends.
      if (now >= f.deadline || now - f.started >= options_.max_duration) late.push_back(n);
    }
    // A backoff is remembered for as long again after it ends (so that failing again soon doubles
    // it), then forgotten: the map stays as small as the workers failing lately.
    std::erase_if(backoff_, [&](const auto& b) { return now >= b.second.until + b.second.wait; });
  }
  for (std::uint64_t n : late) Publish(Fail(n, "no reply in time", Failure::kLate));
}

bool RecoveryClient::AwaitIdle(std::chrono::milliseconds timeout) {
  KvMutexLock g(mu_);
  return idle_.wait_for(mu_, timeout, [&] {
    mu_.AssertHeld();
    return in_flight_.empty() && waiting_.empty();
  });
}

RecoveryCounters RecoveryClient::counters() const {
  KvMutexLock g(mu_);
  RecoveryCounters c = counters_;
  c.in_flight = in_flight_.size();
  c.waiting = waiting_.size();
  return c;
}

}  // namespace kvrouter
