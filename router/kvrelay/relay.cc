#include "router/kvrelay/relay.h"

#include <fmt/format.h>

#include "events/event_codec.h"
#include "events/registration_codec.h"
#include "events/msgpack_reader.h"
#include "events/subjects.h"
#include "events/vllm_codec.h"
#include "events/worker_codec.h"

namespace kvrouter {

KvRelay::KvRelay(RelayOptions options, MessageBus& bus, Replay replay, RateLimitedLog& log)
    : options_(std::move(options)),
      bus_(bus),
      replay_(std::move(replay)),
      log_(log),
      events_subject_(KvEventsSubject(options_.ns, options_.component)),
      instances_subject_(InstancesSubject(options_.ns, options_.component)),
      publisher_(PublisherConfig{.worker_id = options_.worker_id, .dp_rank = options_.dp_rank}),
      state_(options_.register_when == RegisterWhen::kAtStart ? State::kUp : State::kEngineDown) {}

KvRelay::~KvRelay() { Stop(); }

Status KvRelay::Start() {
  auto sub = bus_.Subscribe(RecoverySubject(options_.ns, options_.component, options_.worker_id, options_.dp_rank), "",
                            [this](const BusMessage& m) {
                              if (m.reply.empty()) return;
                              RecoveryReply reply;
                              {
                                KvMutexLock g(mu_);
                                reply = publisher_.Answer(RecoveryQuery::Decode(m.data));
                              }
                              auto parts = EncodeRecoveryReplyParts(reply, bus_.MaxPayload());
                              if (!parts.ok()) {
                                log_.Log(LogLevel::kWarning, "recovery reply", "cannot answer a recovery query: {}",
                                         parts.status().message());
                                return;
                              }
                              for (const auto& part : *parts) (void)bus_.Publish(m.reply, AsBytes(part));
                            });
  if (!sub.ok()) return sub.status();
  recovery_sub_ = std::move(sub).value();
  KvMutexLock g(reg_mu_);
  if (state_.load() != State::kUp) return Status::Ok();  // EngineUp registers
  Register(WorkerStatus::kUp);
  next_heartbeat_ = std::chrono::steady_clock::now() + std::chrono::milliseconds(options_.heartbeat_ms);
  return Status::Ok();
}

void KvRelay::Register(WorkerStatus status) {
  const WorkerRegistration reg{.worker_id = options_.worker_id,
                               .dp_start = options_.dp_rank,
                               .dp_size = 1,
                               .block_size = options_.block_size,
                               .total_kv_blocks = options_.total_kv_blocks,
                               .max_num_seqs = options_.max_num_seqs,
                               .max_num_batched_tokens = options_.max_num_batched_tokens,
                               .device = options_.device,
                               .lease_ms = options_.lease_ms,
                               .leaving = status == WorkerStatus::kLeaving,
                               .http_url = options_.http_url,
                               .models = options_.models,
                               .role = options_.role,
                               .kv_connector = options_.kv_connector,
                               .bootstrap_port = options_.bootstrap_port};
  if (!bus_.Publish(instances_subject_, AsBytes(EncodeWorkerRegistration(reg))).ok()) {
    KvMutexLock g(mu_);
    ++counters_.publish_failures;
  }
}

void KvRelay::Tick(SteadyTime now) {
  KvMutexLock g(reg_mu_);
  if (state_.load() != State::kUp || now < next_heartbeat_) return;
  next_heartbeat_ = now + std::chrono::milliseconds(options_.heartbeat_ms);
  Register(WorkerStatus::kUp);
}

bool KvRelay::EngineUp(SteadyTime now) {
  KvMutexLock g(reg_mu_);
  if (state_.load() != State::kEngineDown) return false;
  state_ = State::kUp;
  Register(WorkerStatus::kUp);
  next_heartbeat_ = now + std::chrono::milliseconds(options_.heartbeat_ms);
  return true;
}

bool KvRelay::EngineDown(std::string_view why) {
  if (state_.load() != State::kUp) return false;  // Stop aside, only this thread changes it
  // `cleared` while the router still knows the worker, so it forgets the cache at once; the
  // publisher's index empties too, so the dump the router asks for at the next registration is
  // empty. Event ids go on.
  PublishCleared(fmt::format("the engine stopped answering ({})", why));
  {
    KvMutexLock g(reg_mu_);
    if (state_.load() != State::kUp) return false;  // Stop came meanwhile and said `leaving`
    state_ = State::kEngineDown;
    Register(WorkerStatus::kLeaving);
  }
  last_.reset();  // the next batch is judged as at first sight
  last_seen_ = -1;
  return true;
}

void KvRelay::Stop() {
  {
    // Under reg_mu_: a heartbeat either went out before `leaving` or sees kStopped and stays home.
    KvMutexLock g(reg_mu_);
    if (state_.load() == State::kStopped) return;
    state_ = State::kStopped;
    Register(WorkerStatus::kLeaving);
  }
  (void)bus_.Flush(std::chrono::seconds(1));
  recovery_sub_.reset();
}

void KvRelay::OnBatch(const ZmqBatch& batch) {
  if (const State state = state_.load(); state != State::kUp) {
    if (state == State::kEngineDown) {
      KvMutexLock g(mu_);
      ++counters_.batches_engine_down;
    }
    return;
  }
  if (last_ && batch.seq <= *last_) {
    {
      KvMutexLock g(mu_);
      ++counters_.restarts;
    }
    PublishCleared(fmt::format("engine restarted (seq {} after {})", batch.seq, *last_));
    last_.reset();
  }
  const std::int64_t expected = last_ ? *last_ + 1 : 0;
  if (batch.seq > expected) {
    Tick(std::chrono::steady_clock::now());  // a replay may take a while: heartbeat first
    Repair(expected, batch.seq);
  }
  Apply(batch);
}

void KvRelay::Repair(std::int64_t from, std::int64_t upto) {
  {
    KvMutexLock g(mu_);
    ++counters_.gaps;
  }
  Result<std::vector<ZmqBatch>> got = replay_ ? replay_(from) : NotFound("no replay endpoint");
  if (stopped()) return;  // Stop came while the replay waited: the worker has left
  const bool whole = got.ok() && !got->empty() && got->front().seq <= from;
  if (!whole) {
    {
      KvMutexLock g(mu_);
      ++counters_.gaps_unrepaired;
    }
    PublishCleared(fmt::format("batches {}..{} are lost: {}", from, upto - 1,
                               got.ok() ? "the engine no longer has them" : got.status().message()));
  }
  if (!got.ok()) return;
  for (const ZmqBatch& b : *got) {
    if (b.seq < from || b.seq >= upto || (last_ && b.seq <= *last_)) continue;
    Apply(b);
    KvMutexLock g(mu_);
    ++counters_.replayed;
  }
}

void KvRelay::Apply(const ZmqBatch& batch) {
  last_ = batch.seq;
  last_seen_ = batch.seq;
  auto decoded = DecodeVllmBatch(
      batch.payload, {.worker_id = options_.worker_id, .dp_rank = options_.dp_rank, .block_size = options_.block_size});
  if (!decoded.ok()) {
    {
      KvMutexLock g(mu_);
      ++counters_.bad_batches;
    }
    log_.Log(LogLevel::kWarning, "bad batch", "dropped undecodable batch seq {}: {}", batch.seq,
             decoded.status().message());
    return;
  }
  if (decoded->block_size_mismatches > 0) {
    {
      KvMutexLock g(mu_);
      counters_.block_size_mismatches += decoded->block_size_mismatches;
    }
    log_.Log(LogLevel::kWarning, "block size",
             "batch seq {}: {} stored event(s) not in blocks of {} tokens (--block-size)", batch.seq,
             decoded->block_size_mismatches, options_.block_size);
  }
  for (KvOp& op : decoded->batch.ops) Publish(std::move(op.data), op.tier);
  KvMutexLock g(mu_);
  ++counters_.batches;
}

void KvRelay::PublishCleared(std::string_view why) {
  log_.Log(LogLevel::kWarning, "cleared", "worker {} rank {}: {}; published `cleared`", options_.worker_id,
           options_.dp_rank, why);
  Publish(KvCleared{}, StorageTier::kDevice);
}

void KvRelay::Publish(KvEventData data, StorageTier tier) {
  if (stopped()) return;  // after `leaving` the router would count the event as worker_left
  msgpack::sbuffer body;
  {
    KvMutexLock g(mu_);
    body = EncodeDynamoEnvelope(publisher_.Publish(std::move(data), tier), {});
    ++counters_.events;
  }
  if (!bus_.Publish(events_subject_, AsBytes(body)).ok()) {
    KvMutexLock g(mu_);
    ++counters_.publish_failures;
  }
}

KvRelay::Counters KvRelay::counters() const {
  KvMutexLock g(mu_);
  return counters_;
}

}  // namespace kvrouter
