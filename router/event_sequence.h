// Ordering checks for one (worker_id, dp_rank)'s event stream (DESIGN.md "Recovery").
// Dynamo event ids start at 1, vLLM Kv-Seq batch numbers at 0; each is tracked on its own.
// Pure value type, owned by the shard thread that applies the worker's events.
#pragma once

#include <cstdint>

namespace kvrouter {

enum class SequenceVerdict {
  kInOrder,    // the next expected id (or the first one seen): apply
  kGap,        // ids were skipped: apply, count, recover the missing range
  kDuplicate,  // already applied: drop
  kRestart,    // back to the first id after later ones: the publisher restarted
};

class SequenceTracker {
 public:
  explicit SequenceTracker(std::uint64_t first_id) : first_(first_id) {}

  // Judges `id` and, unless it is a duplicate, records it as the last applied id.
  SequenceVerdict Observe(std::uint64_t id) {
    if (!seen_) {
      seen_ = true;
      last_ = id;
      return SequenceVerdict::kInOrder;
    }
    if (id == last_ + 1) {
      last_ = id;
      return SequenceVerdict::kInOrder;
    }
    if (id > last_) {
      last_ = id;
      return SequenceVerdict::kGap;
    }
    if (id == first_ && last_ > first_) {
      last_ = id;
      return SequenceVerdict::kRestart;
    }
    return SequenceVerdict::kDuplicate;
  }

  bool seen() const { return seen_; }
  std::uint64_t last() const { return last_; }

 private:
  std::uint64_t first_;
  bool seen_ = false;
  std::uint64_t last_ = 0;
};

}  // namespace kvrouter
