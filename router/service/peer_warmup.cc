#include "router/service/peer_warmup.h"

#include <algorithm>
#include <charconv>

#include "events/msgpack_reader.h"
#include "events/subjects.h"

namespace kvrouter {

namespace {
PeerWarmup::Options Clamped(PeerWarmup::Options o) {
  // Asks of one part page inside ranks; more than kMaxDumpParts are read as that many.
  o.window = std::clamp<std::uint32_t>(o.window, 2, kMaxDumpParts);
  return o;
}
}  // namespace

PeerWarmup::PeerWarmup(Options options, MessageBus& bus, ShardedIndex& index, Clock clock, Admit admit,
                       std::function<void()> on_done, RateLimitedLog& log)
    : options_(Clamped(std::move(options))),
      bus_(bus),
      index_(index),
      clock_(std::move(clock)),
      admit_(std::move(admit)),
      on_done_(std::move(on_done)),
      log_(log) {}

void PeerWarmup::Start() {
  {
    KvMutexLock g(mu_);
    started_ = clock_();
    deadline_ = started_ + options_.first_timeout;
    // The first ask is heard by every replica: two parts from each (the answers past the first
    // replica's are ignored), then the chosen peer's own subject gets window-sized asks.
    to_send_ = DumpRequest{.router_id = options_.router_id, .max_parts = 2};
    parts_asked_ = 2;
  }
  Pump();
}

void PeerWarmup::Pump() {
  {
    KvMutexLock g(mu_);
    if (pumping_) return;  // the caller up the stack publishes it
    pumping_ = true;
  }
  for (;;) {
    DumpRequest req;
    std::string subject, reply;
    {
      KvMutexLock g(mu_);
      if (!to_send_ || finished_) {
        pumping_ = false;
        return;
      }
      req = *to_send_;
      to_send_.reset();
      subject =
          counters_.peer == 0 ? options_.dump_subject : ReplicaEndpointSubject(options_.dump_subject, counters_.peer);
      reply = options_.reply_prefix + std::to_string(ask_);
    }
    const msgpack::sbuffer body = EncodeDumpRequest(req);
    if (Status s = bus_.PublishRequest(subject, reply, AsBytes(body)); !s.ok()) {
      log_.Log(LogLevel::kWarning, "peer dump", "cannot ask {} for a dump: {}", subject, s.message());
      {
        KvMutexLock g(mu_);
        pumping_ = false;
      }
      Finish(false);
      return;
    }
  }
}

void PeerWarmup::OnReply(const BusMessage& m) {
  std::uint64_t ask = 0;
  const std::string_view tail = m.subject.substr(std::min(m.subject.size(), options_.reply_prefix.size()));
  if (std::from_chars(tail.data(), tail.data() + tail.size(), ask).ec != std::errc()) return;
  const auto status = m.Header("Status");
  if (m.data.empty() && status && status->starts_with("503")) {  // NATS "no responders"
    {
      KvMutexLock g(mu_);
      if (finished_ || ask != ask_) return;
    }
    log_.Log(LogLevel::kInfo, "peer dump", "no replica serves {}: the workers are asked", options_.dump_subject);
    Finish(false);
    return;
  }
  auto reply = DecodeDumpReply(m.data);
  bool broken = false;
  {
    KvMutexLock g(mu_);
    if (finished_ || ask != ask_) return;  // late, or an answer to an ask given up
    const bool from_peer = reply.ok() && reply->router_id != 0 && reply->router_id != options_.router_id &&
                           (counters_.peer == 0 || reply->router_id == counters_.peer);
    if (!from_peer && (counters_.peer == 0 || reply.ok())) {
      // Another replica's answer to the first ask (every replica hears it): the first good one
      // chooses the peer.
      log_.Log(LogLevel::kWarning, "peer dump", "ignored a dump answer: {}",
               reply.ok() ? "not from the chosen peer" : reply.status().message());
      return;
    }
    if (!from_peer) {
      broken = true;  // the chosen peer's page cannot be read: a rank in it may be cut short
    } else {
      counters_.peer = reply->router_id;
      ++counters_.pages;
      counters_.bytes += m.data.size();
      deadline_ = clock_() + options_.page_timeout;
      // The answering replica ends an ask after max_parts parts at a rank's end (DumpRequest): the
      // asker knows the last part of each ask without a marker.
      ++pages_of_ask_;
      if (reply->more && pages_of_ask_ >= parts_asked_ && reply->next_chain == 0) {
        ++ask_;
        pages_of_ask_ = 0;
        parts_asked_ = options_.window;
        to_send_ =
            DumpRequest{.router_id = options_.router_id, .offset = reply->next_offset, .max_parts = options_.window};
      }
    }
  }
  if (broken) {
    log_.Log(LogLevel::kWarning, "peer dump", "replica {}'s dump page cannot be read ({}): the workers are asked",
             counters().peer, reply.status().message());
    Finish(false);
    return;
  }
  // Each rank to the index, in order (a rank split across pages: its parts in turn, each with
  // the first part's last_event_id, the oldest state any of them shows: the live events after
  // it, held meanwhile, are applied again on top).
  PeerWarmupCounters handed;
  std::optional<WorkerKey> open;
  std::uint64_t open_last = 0;
  {
    KvMutexLock g(mu_);
    open = open_rank_;
    open_last = open_last_event_id_;
  }
  for (DumpedRank& d : reply->workers) {
    const WorkerKey key{d.worker_id, d.dp_rank};
    if (open && *open == key) {
      d.last_event_id = open_last;
    } else if (open) {  // the rank's next part never came: its worker is asked instead
      index_.Recovered({.worker = *open, .kind = RecoveryPart::Kind::kFailed, .from_peer = true});
    }
    open.reset();
    if (!admit_(key)) {
      ++handed.refused;
      continue;
    }
    RecoveryPart part{.worker = key,
                      .numbering = d.numbering,
                      .kind = RecoveryPart::Kind::kDump,
                      .last_event_id = d.last_event_id,
                      .final = !d.partial,
                      .from_peer = true};
    part.events.reserve(d.chains.size());
    for (DumpedChain& c : d.chains) {
      handed.blocks += c.stored.blocks.size();
      KvEventBatch& b = part.events.emplace_back(KvEventBatch{.worker_id = key.worker_id, .dp_rank = key.dp_rank});
      b.ops.push_back({c.tier, std::move(c.stored)});
    }
    handed.chains += d.chains.size();
    ++handed.ranks;
    if (d.partial) {
      open = key;
      open_last = d.last_event_id;
    }
    index_.Recovered(std::move(part));
  }
  bool late = false;
  {
    KvMutexLock g(mu_);
    // Finish (a timeout) may have run while this page was handed over: the rank it leaves open is
    // then this one's to close.
    late = finished_;
    open_rank_ = late ? std::nullopt : open;
    open_last_event_id_ = open_last;
    counters_.ranks += handed.ranks;
    counters_.refused += handed.refused;
    counters_.chains += handed.chains;
    counters_.blocks += handed.blocks;
  }
  if (late) {
    if (open) index_.Recovered({.worker = *open, .kind = RecoveryPart::Kind::kFailed, .from_peer = true});
  } else if (reply->more) {
    Pump();  // when this was the last page of its ask
  } else {
    Finish(true);
  }
}

void PeerWarmup::Tick() {
  std::uint64_t peer = 0;
  std::optional<WorkerKey> open;
  {
    // Judged and ended in one step: a page taken meanwhile has moved the deadline.
    KvMutexLock g(mu_);
    if (finished_ || !deadline_ || clock_() < *deadline_) return;
    peer = counters_.peer;
    open = EndLocked(false);
  }
  if (peer == 0) {
    log_.Log(LogLevel::kInfo, "peer dump", "no replica answered {} in time: the workers are asked",
             options_.dump_subject);
  } else {
    log_.Log(LogLevel::kWarning, "peer dump",
             "replica {} stopped answering its dump: the workers are asked for the rest", peer);
  }
  Finished(open);
}

std::optional<WorkerKey> PeerWarmup::EndLocked(bool complete) {
  finished_ = true;
  to_send_.reset();
  counters_.done = true;
  counters_.complete = complete;
  counters_.ms = std::chrono::duration<double, std::milli>(clock_() - started_).count();
  return std::exchange(open_rank_, std::nullopt);
}

void PeerWarmup::Finished(std::optional<WorkerKey> open) {
  if (open) index_.Recovered({.worker = *open, .kind = RecoveryPart::Kind::kFailed, .from_peer = true});
  on_done_();
}

void PeerWarmup::Finish(bool complete) {
  std::optional<WorkerKey> open;
  {
    KvMutexLock g(mu_);
    if (finished_) return;
    open = EndLocked(complete);
  }
  Finished(open);
}

bool PeerWarmup::done() const {
  KvMutexLock g(mu_);
  return counters_.done;
}

PeerWarmupCounters PeerWarmup::counters() const {
  KvMutexLock g(mu_);
  return counters_;
}

}  // namespace kvrouter
