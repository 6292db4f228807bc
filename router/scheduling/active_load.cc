#include "router/scheduling/active_load.h"

#include <algorithm>
#include <cmath>

namespace kvrouter {
namespace {

// Half-lives from `from` to `to`.
double HalfLives(SteadyTime from, SteadyTime to) {
  return std::chrono::duration<double>(to - from).count() /
         std::chrono::duration<double>(ActiveLoad::kRecentHalfLife).count();
}

std::uint64_t Square(std::uint64_t tokens) {
  const std::uint64_t t = std::min<std::uint64_t>(tokens, std::uint64_t{1} << 24);
  return t * t;
}

}  // namespace

bool ActiveLoad::Book(const std::string& request_id, WorkerKey worker, std::span<const SequenceHash> seq,
                      std::uint64_t prefill_tokens, SteadyTime now) {
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
  if (w.load.active_requests++ == 0) ++active_workers_;
  AddRecent(w, now);
  booked_blocks_ += seq.size();
  by_worker_[worker.worker_id].insert(&it->first);
  return true;
}

void ActiveLoad::AddRecent(PerWorker& w, SteadyTime now) {
  if (!has_epoch_ || HalfLives(recent_epoch_, now) > 64) {
    const double rescale = has_epoch_ ? std::exp2(-HalfLives(recent_epoch_, now)) : 1.0;
    for (auto& [key, other] : workers_) other.load.recent_scaled *= rescale;
    recent_epoch_ = now;
    has_epoch_ = true;
  }
  w.load.recent_scaled += std::exp2(HalfLives(recent_epoch_, now));
}

bool ActiveLoad::BookPrefill(const std::string& request_id, WorkerKey worker, std::uint64_t prefill_tokens,
                             SteadyTime now) {
  auto it = requests_.find(request_id);
  if (it == requests_.end() || it->second.had_prefill || it->second.worker == worker) return false;
  Booking& b = it->second;
  if (b.prefill_tokens > 0) {  // the prompt is prefilled there, not on the request's own rank
    WorkerLoad& own = workers_[b.worker].load;
    own.active_prefill_tokens -= b.prefill_tokens;
    own.active_prefill_squares -= Square(b.prefill_tokens);
    b.prefill_tokens = 0;
  }
  b.prefill = Booking::PrefillPart{worker, prefill_tokens};
  b.had_prefill = true;
  PerWorker& w = workers_[worker];
  w.load.active_prefill_tokens += prefill_tokens;
  w.load.active_prefill_squares += Square(prefill_tokens);
  if (w.load.active_requests++ == 0) ++active_workers_;
  AddRecent(w, now);
  by_worker_[worker.worker_id].insert(&it->first);
  ++prefill_parts_;
  return true;
}

void ActiveLoad::Unload(PerWorker& w, std::uint64_t tokens) {
  w.load.active_prefill_tokens -= tokens;
  w.load.active_prefill_squares -= Square(tokens);
  if (--w.load.active_requests == 0) --active_workers_;
}

void ActiveLoad::ReleasePrefillPart(std::unordered_map<std::string, Booking>::iterator it) {
  Booking& b = it->second;
  const Booking::PrefillPart part = *b.prefill;
  b.prefill.reset();
  --prefill_parts_;
  if (auto wit = workers_.find(part.worker); wit != workers_.end()) Unload(wit->second, part.tokens);
  if (part.worker.worker_id == b.worker.worker_id) return;  // the decode part keeps the entry
  if (auto bw = by_worker_.find(part.worker.worker_id); bw != by_worker_.end()) {
    bw->second.erase(&it->first);
    if (bw->second.empty()) by_worker_.erase(bw);
  }
}

bool ActiveLoad::ReleasePrefill(const std::string& request_id) {
  auto it = requests_.find(request_id);
  if (it == requests_.end() || !it->second.prefill) return false;
  ReleasePrefillPart(it);
  return true;
}

const WorkerKey* ActiveLoad::PrefillWorkerOf(const std::string& request_id) const {
  auto it = requests_.find(request_id);
  return it == requests_.end() || !it->second.prefill ? nullptr : &it->second.prefill->worker;
}

bool ActiveLoad::MarkPrefill(const std::string& request_id) {
  auto it = requests_.find(request_id);
  if (it == requests_.end()) return false;
  const bool part = it->second.prefill.has_value();
  if (part) ReleasePrefillPart(it);
  if (it->second.prefill_tokens == 0) return part;
  WorkerLoad& load = workers_[it->second.worker].load;
  load.active_prefill_tokens -= it->second.prefill_tokens;
  load.active_prefill_squares -= Square(it->second.prefill_tokens);
  it->second.prefill_tokens = 0;
  return true;
}

void ActiveLoad::Release(std::unordered_map<std::string, Booking>::iterator it) {
  if (it->second.prefill) ReleasePrefillPart(it);
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
    Unload(w, b.prefill_tokens);
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

double ActiveLoad::RecentScale(SteadyTime now) const {
  return has_epoch_ ? std::exp2(-HalfLives(recent_epoch_, now)) : 0.0;
}

double ActiveLoad::RecentRequests(WorkerKey worker, SteadyTime now) const {
  return Load(worker).recent_scaled * RecentScale(now);
}

std::size_t ActiveLoad::RemoveWorker(std::uint64_t worker_id) {
  std::vector<std::string> ids;
  if (auto bw = by_worker_.find(worker_id); bw != by_worker_.end()) {
    ids.reserve(bw->second.size());
    for (const std::string* id : bw->second) ids.push_back(*id);
    for (const std::string& id : ids) {
      auto it = requests_.find(id);
      // A disaggregated request whose prefill rank leaves keeps its decode part.
      if (it->second.worker.worker_id == worker_id) {
        Release(it);
      } else {
        ReleasePrefillPart(it);
      }
    }
  }
  std::erase_if(workers_, [&](const auto& w) { return w.first.worker_id == worker_id; });
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

void ActiveLoad::SetPrior(const std::string& request_id, const PriorTtft& prior) {
  auto it = requests_.find(request_id);
  if (it == requests_.end()) return;
  it->second.prior = prior;
  it->second.has_prior = true;
}

void ActiveLoad::DropPriors(std::uint64_t worker_id) {
  auto bw = by_worker_.find(worker_id);
  if (bw == by_worker_.end()) return;
  for (const std::string* id : bw->second) requests_.find(*id)->second.has_prior = false;
}

const PriorTtft* ActiveLoad::PriorOf(const std::string& request_id) const {
  auto it = requests_.find(request_id);
  return it != requests_.end() && it->second.has_prior ? &it->second.prior : nullptr;
}

const WorkerKey* ActiveLoad::WorkerOf(const std::string& request_id) const {
  auto it = requests_.find(request_id);
  return it == requests_.end() ? nullptr : &it->second.worker;
}

void ActiveLoad::ForEachPrefillPart(
    const std::function<void(const std::string&, WorkerKey, std::uint64_t)>& f) const {
  if (prefill_parts_ == 0) return;
  for (const auto& [id, b] : requests_) {
    if (b.prefill) f(id, b.prefill->worker, b.prefill->tokens);
  }
}

void ActiveLoad::ForEach(
    const std::function<void(const std::string&, WorkerKey, std::span<const SequenceHash>, std::uint64_t)>& f) const {
  for (const auto& [id, b] : requests_) f(id, b.worker, b.seq, b.prefill_tokens);
}

}  // namespace kvrouter
