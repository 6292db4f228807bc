#include "router/scheduling/admission_queue.h"

#include <fmt/format.h>

#include <algorithm>

namespace kvrouter {

AdmissionQueue::AdmissionQueue(QueuePolicy policy, std::size_t max_requests, std::uint64_t max_blocks,
                               std::uint32_t block_size)
    : block_size_(block_size), queue_(policy, max_requests, max_blocks) {}

Status AdmissionQueue::Push(RouteRequest req, PreparedRequest prepared, std::uint64_t best_overlap_blocks,
                            std::string reply, RouteKind kind, SteadyTime now) {
  const auto wait = req.timeout_ms ? std::chrono::milliseconds(*req.timeout_ms) : kDefaultWait;
  const QueueKey key{
      .priority = req.priority, .isl = prepared.sel.isl, .best_overlap_tokens = best_overlap_blocks * block_size_};
  const std::string id = req.request_id;
  // What a queued request holds grows with its prompt: the queue is bounded in blocks too.
  const std::uint64_t blocks = std::max<std::uint64_t>(1, prepared.sel.request_blocks);
  if (kind != RouteKind::kGenerate) {
    req.token_ids.clear();  // hashed already; only a forward needs the tokens
    req.token_ids.shrink_to_fit();
  }
  if (!queue_.Push(key, now, now + wait, QueuedRoute{std::move(req), std::move(prepared), std::move(reply), kind},
                   blocks)) {
    ++refused_;
    return Status(StatusCode::kOverloaded,
                  fmt::format("every worker is busy and {} requests ({} blocks) are already queued", queue_.size(),
                              queue_.weight()));
  }
  if (!id.empty()) ++queued_ids_[id];
  return Status::Ok();
}

void AdmissionQueue::Forget(const std::string& request_id) {
  if (auto it = queued_ids_.find(request_id); it != queued_ids_.end() && --it->second == 0) queued_ids_.erase(it);
}

void AdmissionQueue::Drain(const TryAdmit& try_admit, const Sink& taken) {
  queue_.Scan(
      [&](Queue::Entry& e) {
        switch (try_admit(e.payload, e.enqueued)) {
          case Admission::kAdmitted: ++admitted_; return ScanStep::kTake;
          case Admission::kFailed: return ScanStep::kTake;
          case Admission::kNoRoom: break;
        }
        // An unrestricted request sees every rank: if it cannot go, nothing else can.
        const RouteRequest& r = e.payload.req;
        const bool restricted = r.worker_id || r.dp_rank || r.allowed_worker_ids;
        return restricted ? ScanStep::kKeep : ScanStep::kStop;
      },
      [&](Queue::Entry&& e) {
        Forget(e.payload.req.request_id);
        taken(std::move(e.payload));
      });
}

void AdmissionQueue::Expire(SteadyTime now, const Sink& expired) {
  queue_.Expire(now, [&](Queue::Entry&& e) {
    Forget(e.payload.req.request_id);
    ++timed_out_;
    expired(std::move(e.payload));
  });
}

void AdmissionQueue::FailPinned(std::span<const std::uint64_t> worker_ids, const Sink& failed) {
  if (queue_.empty() || worker_ids.empty()) return;
  auto gone = [&](const Queue::Entry& e) {
    return e.payload.req.worker_id &&
           std::binary_search(worker_ids.begin(), worker_ids.end(), *e.payload.req.worker_id);
  };
  queue_.Scan([&](const Queue::Entry& e) { return gone(e) ? ScanStep::kTake : ScanStep::kKeep; },
              [&](Queue::Entry&& e) {
                Forget(e.payload.req.request_id);
                failed(std::move(e.payload));
              });
}

bool AdmissionQueue::Cancel(const std::string& request_id, const Sink& cancelled) {
  if (request_id.empty() || !queued_ids_.count(request_id)) return false;
  bool found = false;
  queue_.Scan(
      [&](const Queue::Entry& e) {
        if (found || e.payload.req.request_id != request_id) return ScanStep::kKeep;
        found = true;
        return ScanStep::kTake;
      },
      [&](Queue::Entry&& e) { cancelled(std::move(e.payload)); });
  Forget(request_id);
  return found;
}

}  // namespace kvrouter
