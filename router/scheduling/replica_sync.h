// ReplicaSync: this router's side of sharing bookings between replicas (--router-replica-sync,
// docs/protocol.md section 8): the sync messages it publishes about its own bookings, its epoch
// (up by one each time its connection comes back, so peers drop what may have been lost), the
// peers it hears (ReplicaPeers), and what it refused or released of theirs. It publishes
// nothing itself: messages wait in TakeMessages for the caller to send after its lock.
// Thread contract: none; Routing holds its routing mutex around every call.
//
//   sync.Send(ActiveSequenceEvent::Kind::kAdd, "req-1", worker, seq, isl, overlap);
//   for (auto& m : sync.TakeMessages()) publish(m);
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <msgpack.hpp>

#include "events/block_hash.h"
#include "events/replica_sync_codec.h"
#include "router/index/worker_key.h"
#include "router/scheduling/active_load.h"
#include "router/scheduling/replica_peers.h"

namespace kvrouter {

class ReplicaSync {
 public:
  enum class Mode { kOff, kOn };  // kOff: nothing is sent; peers' messages still apply

  ReplicaSync(Mode mode, std::uint64_t router_id);

  bool on() const { return mode_ == Mode::kOn; }
  std::uint64_t router_id() const { return router_id_; }
  // RouterHeartbeat::epoch. It starts from the wall clock's seconds, so a restarted replica
  // that keeps its --router-id is at a later epoch than before.
  std::uint32_t epoch() const { return epoch_; }
  ReplicaPeers& peers() { return peers_; }
  const ReplicaPeers& peers() const { return peers_; }

  // Queues a message about one of this router's booking changes (when on), at the current epoch.
  void Send(ActiveSequenceEvent::Kind kind, const std::string& request_id, WorkerKey worker,
            std::span<const SequenceHash> seq = {}, std::uint32_t isl = 0, std::uint32_t overlap = 0,
            std::string_view session_id = {});
  // Queues an `add` for each of this router's own bookings in `load` (not the peers'), at what
  // is left to prefill as a prompt with nothing cached (when on).
  void SendOwnBookings(const ActiveLoad& load);
  // Messages around an outage may be lost: the next epoch, and the live bookings sent again.
  void NextEpoch(const ActiveLoad& load);
  // Frees in `load` these bookings of peers (dead, or not to be trusted after an outage) and
  // appends the workers whose load changed to `changed`.
  void Release(const std::vector<std::string>& request_ids, ActiveLoad& load, std::vector<WorkerKey>& changed);
  // A peer's `add` this router would not take, by reason ("unknown_worker", "too_long", ...).
  void Refused(std::string_view reason) { ++refused_[std::string(reason)]; }

  // The queued messages, in the order they were made (replicas see bookings in this order).
  std::vector<msgpack::sbuffer> TakeMessages();

  const std::map<std::string, std::uint64_t>& refused() const { return refused_; }
  std::uint64_t released() const { return released_; }

 private:
  static std::uint32_t StartEpoch();  // the wall clock's seconds

  const Mode mode_;
  const std::uint64_t router_id_;
  ReplicaPeers peers_;
  std::uint32_t epoch_ = StartEpoch();
  std::vector<msgpack::sbuffer> pending_;
  std::map<std::string, std::uint64_t> refused_;  // reason -> count
  std::uint64_t released_ = 0;                    // peers' bookings released here
};

}  // namespace kvrouter
