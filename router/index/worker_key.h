// WorkerKey: one routable target, a (worker_id, dp_rank) pair. Plain value.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

namespace kvrouter {

// Packed to 12 bytes (4-byte aligned): an overlap score (key + blocks) is then 16 bytes, and
// FindMatches writes one per matching worker, thousands per request in large fleets.
#pragma pack(push, 4)
struct WorkerKey {
  std::uint64_t worker_id = 0;
  std::uint32_t dp_rank = 0;
  bool operator==(const WorkerKey&) const = default;
  auto operator<=>(const WorkerKey&) const = default;
};
#pragma pack(pop)
static_assert(sizeof(WorkerKey) == 12);

struct WorkerKeyHash {
  std::size_t operator()(const WorkerKey& k) const {
    return std::hash<std::uint64_t>{}(k.worker_id * 0x9E3779B97F4A7C15ULL ^ k.dp_rank);
  }
};

}  // namespace kvrouter
