// Routing's replica side (--router-replica-sync, docs/protocol.md section 8): peers' booking
// changes and heartbeats applied here, and what an outage of this router or of a peer releases.
// The state lives in ReplicaSync; this wires it to the bookings and the queue under the
// routing mutex (see routing.h).
#include <fmt/format.h>

#include <cstdint>

#include "router/service/routing.h"

namespace kvrouter {

const char* Routing::RefusalLocked(const ActiveSequenceEvent& e, std::string& detail) const {
  const std::uint64_t max_blocks =
      (std::uint64_t{config_.max_prompt_tokens} + config_.block_size - 1) / config_.block_size;
  if (!registry_.HasRank({e.worker_id, e.dp_rank})) {
    detail = fmt::format("worker {} rank {} is not known here", e.worker_id, e.dp_rank);
    return "unknown_worker";
  }
  if (e.isl > config_.max_prompt_tokens || e.seq_hashes.size() > max_blocks) {
    detail = fmt::format("{} tokens / {} blocks exceed --router-max-prompt-tokens {}", e.isl, e.seq_hashes.size(),
                         config_.max_prompt_tokens);
    return "too_long";
  }
  if (Status room = scheduler_.BookingRoom(e.seq_hashes.size()); !room.ok()) {
    detail = room.message();
    return "overloaded";
  }
  return nullptr;
}

void Routing::ApplyReplica(const ActiveSequenceEvent& e, Outbox& out) {
  KvMutexLock g(mu_);
  PeerEpochLocked(e.router_id, e.epoch, out);
  ReplicaPeers& peers = sync_.peers();
  ActiveLoad& load = scheduler_.load();
  switch (e.kind) {
    case ActiveSequenceEvent::Kind::kAdd: {
      if (peers.IsStale(e.router_id, e.epoch)) {
        sync_.Refused("stale_epoch");
        return;
      }
      const std::uint64_t cached = std::uint64_t{e.overlap_blocks} * config_.block_size;
      const WorkerKey rank{e.worker_id, e.dp_rank};
      const WorkerKey* booked = load.WorkerOf(e.request_id);
      // Another rank of a request a peer booked here: its prefill part (section 13), which adds
      // no request to the bounds. A booking takes one prefill part: a repeated or late add
      // (after its prefill_done) changes nothing.
      const bool part = booked && *booked != rank && peers.IsPeerBooking(e.request_id);
      // Another replica's booking obeys this router's bounds, and names a rank it knows.
      std::string detail;
      const char* refused = part ? nullptr : RefusalLocked(e, detail);
      if (part && !registry_.HasRank(rank)) {
        refused = "unknown_worker";
        detail = fmt::format("prefill worker {} rank {} is not known here", e.worker_id, e.dp_rank);
      }
      if (refused) {
        sync_.Refused(refused);
        log_.Log(LogLevel::kWarning, "replica sync refused", "refused a replica booking ({}): {}", refused, detail);
        return;
      }
      if (part) {
        if (load.BookPrefill(e.request_id, rank, e.isl > cached ? e.isl - cached : 0, clock_())) {
          metrics_dirty_.push_back(rank);
          metrics_dirty_.push_back(*load.WorkerOf(e.request_id));
        }
        return;
      }
      if (load.Book(e.request_id, {e.worker_id, e.dp_rank}, e.seq_hashes, e.isl > cached ? e.isl - cached : 0,
                    clock_())) {
        peers.Booked(e.router_id, e.request_id, clock_());
      }
      // The peer bound the session: so does this replica, whichever one its next request reaches.
      if (!e.session_id.empty()) affinity_.Bind(e.session_id, {e.worker_id, e.dp_rank}, clock_());
      return;
    }
    case ActiveSequenceEvent::Kind::kPrefillDone: {
      peers.Seen(e.router_id, clock_());
      // Naming the request's prefill rank: that part only (section 13 prefill_done); else
      // mark_prefill.
      const WorkerKey* prefill = load.PrefillWorkerOf(e.request_id);
      const bool part = prefill && *prefill == WorkerKey{e.worker_id, e.dp_rank};
      if (part ? load.ReleasePrefill(e.request_id) : load.MarkPrefill(e.request_id)) DrainLocked(out);
      return;
    }
    case ActiveSequenceEvent::Kind::kFree:
      peers.Seen(e.router_id, clock_());
      peers.Released(e.request_id);
      if (load.Free(e.request_id)) DrainLocked(out);
      return;
  }
}

void Routing::ReplicaHeartbeat(std::uint64_t router_id, std::uint32_t epoch, Outbox& out) {
  KvMutexLock g(mu_);
  sync_.peers().Heard(router_id, clock_());
  PeerEpochLocked(router_id, epoch, out);
}

void Routing::PeerEpochLocked(std::uint64_t router_id, std::uint32_t epoch, Outbox& out) {
  const auto stale = sync_.peers().Advance(router_id, epoch, clock_());
  if (!stale) return;
  // The peer came back from an outage: its frees around it may be lost (its live bookings come
  // again at the new epoch), and it dropped every booking synced to it meanwhile (ours too).
  sync_.Release(*stale, scheduler_.load(), metrics_dirty_);
  sync_.SendOwnBookings(scheduler_.load());
  DrainLocked(out);
  TakeDeferredLocked(out);  // the gauges of the released workers, and our adds
}

std::uint32_t Routing::epoch() const {
  KvMutexLock g(mu_);
  return sync_.epoch();
}

void Routing::PauseReplicas() {
  KvMutexLock g(mu_);
  resume_marker_ = 0;
  sync_.peers().Pause();
}

void Routing::ResumeReplicas(Outbox& out) {
  KvMutexLock g(mu_);
  resume_marker_ = 0;
  ResumeReplicasLocked(out);
}

void Routing::AwaitResume(std::uint64_t n, SteadyTime deadline) {
  KvMutexLock g(mu_);
  resume_marker_ = n;
  resume_deadline_ = deadline;
}

bool Routing::ResumeOnMarker(std::uint64_t n, Outbox& out) {
  KvMutexLock g(mu_);
  if (n == 0 || n != resume_marker_) return false;
  resume_marker_ = 0;
  ResumeReplicasLocked(out);
  return true;
}

bool Routing::ResumeIfOverdue(Outbox& out) {
  KvMutexLock g(mu_);
  if (resume_marker_ == 0 || clock_() < resume_deadline_) return false;
  resume_marker_ = 0;
  ResumeReplicasLocked(out);
  return true;
}

void Routing::ResumeReplicasLocked(Outbox& out) {
  sync_.Release(sync_.peers().Resume(clock_()), scheduler_.load(), metrics_dirty_);
  sync_.NextEpoch(scheduler_.load());
  DrainLocked(out);  // load dropped: queued requests may fit now
  TakeDeferredLocked(out);
}

void Routing::NextEpoch(Outbox& out) {
  KvMutexLock g(mu_);
  sync_.NextEpoch(scheduler_.load());
  TakeDeferredLocked(out);
}

}  // namespace kvrouter
