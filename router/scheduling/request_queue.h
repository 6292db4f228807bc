// RequestQueue: route requests held back while every eligible worker rank is full
// (docs/design.md "Queue"), kept in the order of the configured policy:
//   fcfs  highest priority first, then earliest arrival (best tail TTFT);
//   wspt  highest (1 + priority) / max(1, isl - best_overlap_tokens) first, then earliest
//         (Smith's rule: best mean TTFT);
//   lcfs  latest arrival first (for comparison only).
// Bounded: Push refuses beyond `max_size` entries or `max_weight` summed weights (the caller's
// measure of what an entry holds, e.g. its prompt blocks). Not thread-safe: the service guards it with its
// routing mutex. Payload T is the caller's (the decoded request and where to reply).
//
//   RequestQueue<Pending> q(QueuePolicy::kFcfs, 10000);
//   q.Push({.priority = 1, .isl = 512}, now, deadline, std::move(pending));
//   q.Scan([&](auto& e) { return CanAdmit(e) ? ScanStep::kTake : ScanStep::kKeep; });
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "events/base/clock.h"
#include "router/scheduling/policy.h"

namespace kvrouter {

// What ordering needs to know of a request.
struct QueueKey {
  std::int64_t priority = 0;
  std::uint32_t isl = 0;                  // prompt tokens
  std::uint64_t best_overlap_tokens = 0;  // cached tokens on its best worker when queued
};

enum class ScanStep { kKeep, kTake, kStop };

template <typename T>
class RequestQueue {
 public:
  using Time = SteadyTime;
  struct Entry {
    QueueKey key;
    std::uint64_t arrival = 0;  // monotonic arrival number
    Time enqueued{};
    std::optional<Time> deadline;
    std::uint64_t weight = 0;
    T payload;
  };

  RequestQueue(QueuePolicy policy, std::size_t max_size,
               std::uint64_t max_weight = std::numeric_limits<std::uint64_t>::max())
      : policy_(policy), max_size_(max_size), max_weight_(max_weight), order_(Less{this}) {}
  // The ordering holds `this`: the queue stays where it was made.
  RequestQueue(const RequestQueue&) = delete;
  RequestQueue& operator=(const RequestQueue&) = delete;

  std::size_t size() const { return order_.size(); }
  bool empty() const { return order_.empty(); }
  std::uint64_t weight() const { return weight_; }

  // False (payload untouched) when the queue is at either bound.
  bool Push(QueueKey key, Time now, std::optional<Time> deadline, T&& payload, std::uint64_t weight = 0) {
    if (order_.size() >= max_size_ || weight > max_weight_ - weight_) return false;
    order_.insert(std::make_unique<Entry>(Entry{key, next_arrival_++, now, deadline, weight, std::move(payload)}));
    weight_ += weight;
    return true;
  }

  // Visits entries in policy order. f returns kTake (remove it; the entry is handed to
  // `taken`), kKeep, or kStop (end the scan).
  template <typename F, typename G>
  void Scan(F&& f, G&& taken) {
    for (auto it = order_.begin(); it != order_.end();) {
      const ScanStep step = f(**it);
      if (step == ScanStep::kStop) return;
      if (step == ScanStep::kTake) {
        it = Take(it, taken);
      } else {
        ++it;
      }
    }
  }

  // Removes every entry whose deadline is before `now`, handing each to `expired`.
  template <typename G>
  void Expire(Time now, G&& expired) {
    for (auto it = order_.begin(); it != order_.end();) {
      if ((*it)->deadline && *(*it)->deadline < now) {
        it = Take(it, expired);
      } else {
        ++it;
      }
    }
  }

  // Removes every entry, in policy order.
  template <typename G>
  void Clear(G&& removed) {
    Scan([](const Entry&) { return ScanStep::kTake; }, removed);
  }

 private:
  struct Less {
    const RequestQueue* q;
    bool operator()(const std::unique_ptr<Entry>& a, const std::unique_ptr<Entry>& b) const {
      return q->Before(*a, *b);
    }
  };
  using Order = std::set<std::unique_ptr<Entry>, Less>;

  static double WsptScore(const QueueKey& k) {
    const double work = k.isl > k.best_overlap_tokens ? double(k.isl - k.best_overlap_tokens) : 0.0;
    return (1.0 + double(k.priority)) / std::max(1.0, work);
  }

  bool Before(const Entry& a, const Entry& b) const {
    switch (policy_) {
      case QueuePolicy::kFcfs:
        if (a.key.priority != b.key.priority) return a.key.priority > b.key.priority;
        return a.arrival < b.arrival;
      case QueuePolicy::kWspt: {
        const double sa = WsptScore(a.key), sb = WsptScore(b.key);
        if (sa != sb) return sa > sb;
        return a.arrival < b.arrival;
      }
      case QueuePolicy::kLcfs: return a.arrival > b.arrival;
    }
    return a.arrival < b.arrival;
  }

  // Unlinks the entry at `it`, hands it to `sink` and returns the next position.
  template <typename G>
  typename Order::iterator Take(typename Order::iterator it, G& sink) {
    auto next = std::next(it);
    auto node = order_.extract(it);
    weight_ -= node.value()->weight;
    sink(std::move(*node.value()));
    return next;
  }

  QueuePolicy policy_;
  std::size_t max_size_;
  std::uint64_t max_weight_;
  std::uint64_t weight_ = 0;
  std::uint64_t next_arrival_ = 0;
  Order order_;  // owns the entries
};

}  // namespace kvrouter
