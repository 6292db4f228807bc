#include "router/scheduling/replica_sync.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <utility>

namespace kvrouter {

ReplicaSync::ReplicaSync(Mode mode, std::uint64_t router_id) : mode_(mode), router_id_(router_id) {}

std::uint32_t ReplicaSync::StartEpoch() {
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  return static_cast<std::uint32_t>(std::chrono::duration_cast<std::chrono::seconds>(now).count());
}

void ReplicaSync::Send(ActiveSequenceEvent::Kind kind, const std::string& request_id, WorkerKey worker,
                       std::span<const SequenceHash> seq, std::uint32_t isl, std::uint32_t overlap,
                       std::string_view session_id) {
  if (!on()) return;
  const ActiveSequenceEvent e{.router_id = router_id_,
                              .request_id = request_id,
                              .worker_id = worker.worker_id,
                              .dp_rank = worker.dp_rank,
                              .kind = kind,
                              .seq_hashes = {seq.begin(), seq.end()},
                              .isl = isl,
                              .overlap_blocks = overlap,
                              .epoch = epoch_,
                              .session_id = std::string(session_id)};
  pending_.push_back(EncodeActiveSequenceEvent(e));
}

void ReplicaSync::SendOwnBookings(const ActiveLoad& load) {
  if (!on()) return;
  load.ForEach(
      [&](const std::string& id, WorkerKey worker, std::span<const SequenceHash> seq, std::uint64_t prefill_tokens) {
        if (peers_.IsPeerBooking(id)) return;
        Send(ActiveSequenceEvent::Kind::kAdd, id, worker, seq,
             static_cast<std::uint32_t>(std::min<std::uint64_t>(prefill_tokens, UINT32_MAX)), 0);
      });
  // After every request's own rank: an add naming another rank of a booked request is its
  // prefill part (section 13).
  load.ForEachPrefillPart([&](const std::string& id, WorkerKey worker, std::uint64_t prefill_tokens) {
    if (peers_.IsPeerBooking(id)) return;
    Send(ActiveSequenceEvent::Kind::kAdd, id, worker, {},
         static_cast<std::uint32_t>(std::min<std::uint64_t>(prefill_tokens, UINT32_MAX)), 0);
  });
}

void ReplicaSync::NextEpoch(const ActiveLoad& load) {
  ++epoch_;
  SendOwnBookings(load);
}

void ReplicaSync::Release(const std::vector<std::string>& request_ids, ActiveLoad& load,
                          std::vector<WorkerKey>& changed) {
  for (const std::string& id : request_ids) {
    const WorkerKey* w = load.WorkerOf(id);
    if (!w) continue;
    changed.push_back(*w);
    if (const WorkerKey* prefill = load.PrefillWorkerOf(id)) changed.push_back(*prefill);
    load.Free(id);
    ++released_;
  }
}

std::vector<msgpack::sbuffer> ReplicaSync::TakeMessages() { return std::exchange(pending_, {}); }

}  // namespace kvrouter
