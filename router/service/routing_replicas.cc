// Routing's replica sync (--router-replica-sync, docs/protocol.md section 8): this router's bookings
// published to its peers, theirs applied here, peer heartbeats, and what an outage of this
// router or of a peer releases. Same class and mutex as router/service/routing.cc.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>

#include "router/service/routing.h"

namespace kvrouter {

void Routing::SyncLocked(ActiveSequenceEvent::Kind kind, const std::string& request_id, WorkerKey worker,
                         std::span<const SequenceHash> seq, std::uint32_t isl, std::uint32_t overlap) {
  const ActiveSequenceEvent e{.router_id = router_id_,
                              .request_id = request_id,
                              .worker_id = worker.worker_id,
                              .dp_rank = worker.dp_rank,
                              .kind = kind,
                              .seq_hashes = {seq.begin(), seq.end()},
                              .isl = isl,
                              .overlap_blocks = overlap,
                              .epoch = epoch_};
  pending_syncs_.push_back(EncodeActiveSequenceEvent(e));
}

void Routing::ApplyReplica(const ActiveSequenceEvent& e, Outbox& out) {
  KvMutexLock g(mu_);
  PeerEpochLocked(e.router_id, e.epoch, out);
  switch (e.kind) {
    case ActiveSequenceEvent::Kind::kAdd: {
      if (peers_.IsStale(e.router_id, e.epoch)) {
        ++replica_refused_["stale_epoch"];
        return;
      }
      // Another replica's booking obeys this router's bounds, and names a rank it knows.
      const char* refused = nullptr;
      std::string detail;
      const std::uint64_t max_blocks =
          (std::uint64_t{config_.max_prompt_tokens} + config_.block_size - 1) / config_.block_size;
      if (!registry_.HasRank({e.worker_id, e.dp_rank})) {
        refused = "unknown_worker";
        detail = fmt::format("worker {} rank {} is not known here", e.worker_id, e.dp_rank);
      } else if (e.isl > config_.max_prompt_tokens || e.seq_hashes.size() > max_blocks) {
        refused = "too_long";
        detail = fmt::format("{} tokens / {} blocks exceed --router-max-prompt-tokens {}", e.isl, e.seq_hashes.size(),
                             config_.max_prompt_tokens);
      } else if (Status room = BookingRoomLocked(e.seq_hashes.size()); !room.ok()) {
        refused = "overloaded";
        detail = room.message();
      }
      if (refused) {
        ++replica_refused_[refused];
        log_.Log(LogLevel::kWarning, "replica sync refused", "refused a replica booking ({}): {}", refused, detail);
        return;
      }
      const std::uint64_t cached = std::uint64_t{e.overlap_blocks} * config_.block_size;
      if (load_.Book(e.request_id, {e.worker_id, e.dp_rank}, e.seq_hashes, e.isl > cached ? e.isl - cached : 0,
                     clock_())) {
        peers_.Booked(e.router_id, e.request_id, clock_());
      }
      return;
    }
    case ActiveSequenceEvent::Kind::kPrefillDone:
      peers_.Seen(e.router_id, clock_());
      if (load_.MarkPrefill(e.request_id)) DrainLocked(out);
      return;
    case ActiveSequenceEvent::Kind::kFree:
      peers_.Seen(e.router_id, clock_());
      peers_.Released(e.request_id);
      if (load_.Free(e.request_id)) DrainLocked(out);
      return;
  }
}

void Routing::ReplicaHeartbeat(std::uint64_t router_id, std::uint32_t epoch, Outbox& out) {
  KvMutexLock g(mu_);
  peers_.Heard(router_id, clock_());
  PeerEpochLocked(router_id, epoch, out);
}

void Routing::PeerEpochLocked(std::uint64_t router_id, std::uint32_t epoch, Outbox& out) {
  const auto stale = peers_.Advance(router_id, epoch);
  if (!stale) return;
  // The peer came back from an outage: its frees around it may be lost (its live bookings come
  // again at the new epoch), and it dropped every booking synced to it meanwhile (ours too).
  ReleasePeerBookingsLocked(*stale);
  SyncOwnBookingsLocked();
  DrainLocked(out);
  TakeDeferredLocked(out);  // the gauges of the released workers, and our adds
}

void Routing::SyncOwnBookingsLocked() {
  if (!config_.replica_sync) return;
  load_.ForEach([&](const std::string& id, WorkerKey worker, std::span<const SequenceHash> seq,
                    std::uint64_t prefill_tokens) {
    mu_.AssertHeld();  // called right here, under our lock
    if (peers_.IsPeerBooking(id)) return;
    // What is left to prefill, as a prompt with nothing cached.
    SyncLocked(ActiveSequenceEvent::Kind::kAdd, id, worker, seq,
               static_cast<std::uint32_t>(std::min<std::uint64_t>(prefill_tokens, UINT32_MAX)), 0);
  });
}

std::uint32_t Routing::StartEpoch() {
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  return static_cast<std::uint32_t>(std::chrono::duration_cast<std::chrono::seconds>(now).count());
}

std::uint32_t Routing::epoch() const {
  KvMutexLock g(mu_);
  return epoch_;
}

void Routing::PauseReplicas() {
  KvMutexLock g(mu_);
  peers_.Pause();
}

void Routing::ResumeReplicas(Outbox& out) {
  KvMutexLock g(mu_);
  ReleasePeerBookingsLocked(peers_.Resume(clock_()));
  NextEpochLocked();
  DrainLocked(out);  // load dropped: queued requests may fit now
  TakeDeferredLocked(out);
}

void Routing::NextEpoch(Outbox& out) {
  KvMutexLock g(mu_);
  NextEpochLocked();
  TakeDeferredLocked(out);
}

void Routing::NextEpochLocked() {
  ++epoch_;
  SyncOwnBookingsLocked();
}

void Routing::ReleasePeerBookingsLocked(const std::vector<std::string>& request_ids) {
  for (const std::string& id : request_ids) {
    const WorkerKey* w = load_.WorkerOf(id);
    if (!w) continue;
    metrics_dirty_.push_back(*w);
    load_.Free(id);
    ++replica_released_;
  }
}

}  // namespace kvrouter
