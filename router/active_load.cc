#include "router/active_load.h"

#include <algorithm>
#include <cmath>

namespace kvrouter {
namespace {

// count decayed from `at` to `now` (never grows when the clock goes back).
double Decayed(double count, SteadyTime at, SteadyTime now) {
  const double s = std::chrono::duration<double>(now - at).count();
  if (s <= 0) return count;
  return count * std::exp2(-s / std::chrono::duration<double>(ActiveLoad::kRecentHalfLife).count());
}

std::uint64_t Square(std::uint64_t tokens) {
  const std::uint64_t t = std::min<std::uint64_t>(tokens, std::uint64_t{1} << 24);
  return t * t;
}

}  // namespace

bool ActiveLoad::Book(const std::string& request_id, WorkerKey worker,
                      std::span<const SequenceHash> seq, std::uint64_t prefill_tokens,
                      SteadyTime now) {
  auto [it, inserted] = requests_.try_emplace(request_id);
  if (!inserted) return false;
  Booking& b = it->second;
  b.worker = worker;
  b.seq.assign(seq.begin(), seq.end());
  b.prefill_tokens = prefill_tokens;
  b.booked_at = now;
  PerWorker& w = workers_[worker];
  for (SequenceHash h : seq) {
    if (w.blocks[h]++ == 0) ++w.load.active_blocks;
  }
  w.load.active_prefill_tokens += prefill_tokens;
  w.load.active_prefill_squares += Square(prefill_tokens);
  ++w.load.active_requests;
  Recent& r = recent_[worker];
  r.count = Decayed(r.count, r.at, now) + 1;
  r.at = std::max(r.at, now);
  booked_blocks_ += seq.size();
  by_worker_[worker.worker_id].insert(&it->first);
  return true;
}

bool ActiveLoad::MarkPrefill(const std::string& request_id) {
  auto it = requests_.find(request_id);
  if (it == requests_.end() || it->second.prefill_tokens == 0) return false;
  WorkerLoad& load = workers_[it->second.worker].load;
  load.active_prefill_tokens -= it->second.prefill_tokens;
  load.active_prefill_squares -= Square(it->second.prefill_tokens);
  it->second.prefill_tokens = 0;
  return true;
}

void ActiveLoad::Release(std::unordered_map<std::string, Booking>::iterator it) {
  const Booking& b = it->second;
  auto wit = workers_.find(b.worker);
  if (wit != workers_.end()) {
    PerWorker& w = wit->second;
    for (SequenceHash h : b.seq) {
      auto bit = w.blocks.find(h);
      if (bit != w.blocks.end() && --bit->second == 0) {
        w.blocks.erase(bit);
        --w.load.active_blocks;
      }
    }
    w.load.active_prefill_tokens -= b.prefill_tokens;
    w.load.active_prefill_squares -= Square(b.prefill_tokens);
    --w.load.active_requests;
    if (w.load.active_requests == 0) workers_.erase(wit);
  }
  booked_blocks_ -= b.seq.size();
  if (auto bw = by_worker_.find(b.worker.worker_id); bw != by_worker_.end()) {
    bw->second.erase(&it->first);
    if (bw->second.empty()) by_worker_.erase(bw);
  }
  requests_.erase(it);
}

bool ActiveLoad::Free(const std::string& request_id) {
  auto it = requests_.find(request_id);
  if (it == requests_.end()) return false;
  Release(it);
  return true;
}

std::size_t ActiveLoad::Sweep(SteadyTime now, std::chrono::seconds max_age) {
  std::size_t n = 0;
  for (auto it = requests_.begin(); it != requests_.end();) {
    auto next = std::next(it);
    if (now - it->second.booked_at > max_age) {
      Release(it);
      ++n;
    }
    it = next;
  }
  return n;
}

double ActiveLoad::RecentRequests(WorkerKey worker, SteadyTime now) const {
  auto it = recent_.find(worker);
  return it == recent_.end() ? 0 : Decayed(it->second.count, it->second.at, now);
}

std::size_t ActiveLoad::RemoveWorker(std::uint64_t worker_id) {
  std::erase_if(recent_, [&](const auto& r) { return r.first.worker_id == worker_id; });
  auto bw = by_worker_.find(worker_id);
  if (bw == by_worker_.end()) return 0;
  std::vector<std::string> ids;
  ids.reserve(bw->second.size());
  for (const std::string* id : bw->second) ids.push_back(*id);
  for (const std::string& id : ids) Release(requests_.find(id));
  return ids.size();
}

WorkerLoad ActiveLoad::Load(WorkerKey worker) const {
  auto it = workers_.find(worker);
  return it == workers_.end() ? WorkerLoad{} : it->second.load;
}

std::uint32_t ActiveLoad::ActivePrefix(WorkerKey worker, std::span<const SequenceHash> seq) const {
  auto it = workers_.find(worker);
  if (it == workers_.end()) return 0;
  std::uint32_t n = 0;
  for (SequenceHash h : seq) {
    if (!it->second.blocks.count(h)) break;
    ++n;
  }
  return n;
}

const WorkerKey* ActiveLoad::WorkerOf(const std::string& request_id) const {
  auto it = requests_.find(request_id);
  return it == requests_.end() ? nullptr : &it->second.worker;
}

}  // namespace kvrouter
