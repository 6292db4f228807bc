// ReplicaPeers: which other router replicas are alive, and which bookings each of them made
// (--router-replica-sync). A replica that dies (kill -9, a lost machine) never frees the bookings
// it synced to the others; without this they would weigh on their workers for the 300 s sweep.
//
// Every replica publishes a heartbeat ({router_id, interval_ms}, kvrouter's extension of
// docs/protocol.md section 8, on RouterHeartbeatsSubject of events/subjects.h) once a second. A peer that has
// been heard once and then stays silent for kSilence is dead: its bookings are released. Peers
// that never send heartbeats (other implementations) are never judged. While this router's own
// connection is down, nobody can be heard: Pause stops the judging, Resume gives every peer a
// fresh kSilence.
//
// Heartbeats and sync messages also carry the sender's epoch, which goes up each time its own
// connection comes back: the `free`s it sent around that outage may be lost. Advance hands back
// its bookings to release; it sends its live ones again at the new epoch. Whichever message
// (heartbeat or sync, two subscriptions) shows the new epoch first advances it, before a
// booking of that epoch is recorded.
//
// Thread contract: none; Routing owns it under its mutex. Memory: one entry per known peer
// (at most kMaxPeers) and per live booking of a peer (bounded by the booking bounds; Prune
// drops swept ones).
//
//   peers.Heard(7, now);  peers.Booked(7, "req-1", now);  ...  for (auto& id : peers.TakeSilent(now)) free(id);
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "events/base/clock.h"

namespace kvrouter {

class ReplicaPeers {
 public:
  using Time = SteadyTime;
  static constexpr std::chrono::milliseconds kInterval{1000};  // a replica's heartbeat period
  static constexpr std::chrono::milliseconds kSilence{5000};   // silent this long: dead
  static constexpr std::size_t kMaxPeers = 4096;               // more are not tracked
  static constexpr std::chrono::seconds kForgetEpoch{600};     // twice the booking sweep's age

  // A heartbeat of `router_id`.
  void Heard(std::uint64_t router_id, Time now);
  // `router_id` speaks at `epoch` (a heartbeat or a sync message says so). When that is later
  // than its epoch known here, returns its bookings (forgotten here; the caller releases them,
  // and sends its own again for that peer); else nullopt. A peer not known here (first heard,
  // or forgotten as dead during its outage) is at a later epoch when its epoch is not 0: it may
  // be back from an outage, having dropped what was synced to it.
  // A peer not known here while kMaxPeers are tracked is not judged (nullopt).
  std::optional<std::vector<std::string>> Advance(std::uint64_t router_id, std::uint32_t epoch, Time now);
  // A message of an epoch older than the peer's known one: sent before its outage and handled
  // late. Its `add` is dropped (the peer sent its live bookings again at the new epoch; the
  // rest may have been freed by a `free` that was lost). Its other messages still apply.
  bool IsStale(std::uint64_t router_id, std::uint32_t epoch) const {
    auto it = epoch_.find(router_id);
    return it != epoch_.end() && epoch < it->second.epoch;
  }
  // A booking `request_id` synced by `router_id` (also a sign of life of a known peer).
  void Booked(std::uint64_t router_id, const std::string& request_id, Time now);
  // Any other sync message of `router_id`: a sign of life, if it is a known peer.
  void Seen(std::uint64_t router_id, Time now);
  // The booking is gone (freed by its replica, or here).
  void Released(const std::string& request_id) { origin_.erase(request_id); }
  // Whether a peer made the booking (else it is this router's own, or unknown).
  bool IsPeerBooking(const std::string& request_id) const { return origin_.contains(request_id); }
  // Forgets the peers silent for kSilence or more and returns their bookings' request ids. The
  // epoch of a peer that sends no heartbeats is forgotten once it has said nothing for
  // kForgetEpoch (its bookings are swept by then), so such peers never fill the table for good.
  std::vector<std::string> TakeSilent(Time now);
  // Drops the bookings `gone` says no longer exist (after a sweep).
  void Prune(const std::function<bool(const std::string&)>& gone);

  void Pause() { paused_ = true; }
  // Judging starts again, each peer with a fresh kSilence. Returns every peer booking: their
  // `free`s sent while this router was away are lost, so none of them can be trusted.
  std::vector<std::string> Resume(Time now);

  std::size_t peers() const { return last_heard_.size(); }
  std::size_t epochs_tracked() const { return epoch_.size(); }
  std::uint64_t dead() const { return dead_; }

 private:
  // Takes out of origin_ the bookings of the peers for which `take` is true.
  std::vector<std::string> TakeBookings(const std::function<bool(std::uint64_t router_id)>& take);

  std::unordered_map<std::uint64_t, Time> last_heard_;  // peers that send heartbeats
  struct Epoch {
    std::uint32_t epoch = 0;  // the latest of the peer
    Time last_seen{};         // its last message of any kind
  };
  std::unordered_map<std::uint64_t, Epoch> epoch_;
  std::unordered_map<std::string, std::uint64_t> origin_;  // booking -> the peer that made it
  bool paused_ = false;
  std::uint64_t dead_ = 0;  // peers found dead so far
};

}  // namespace kvrouter
