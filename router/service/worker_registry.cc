#include "router/service/worker_registry.h"

#include <fmt/format.h>

#include <algorithm>

#include "router/index/flat_table.h"

namespace kvrouter {
namespace {

constexpr const char* kOutOfRange = "dp_rank_out_of_range";
constexpr const char* kTooMany = "too_many_workers";

std::int64_t Ticks(SteadyTime t) { return t.time_since_epoch().count(); }

bool Serves(const WorkerRegistration& reg, std::uint32_t rank) {
  return rank >= reg.dp_start && rank - reg.dp_start < reg.dp_size;
}

}  // namespace

WorkerRegistry::Registered WorkerRegistry::Register(const WorkerRegistration& reg, SteadyTime now) {
  const std::int64_t deadline = Ticks(now + std::chrono::milliseconds(reg.lease_ms));
  if (!reg.leaving) {
    // The common case, a heartbeat repeating what the registry holds: renew under the shared lock.
    KvReaderLock g(mu_);
    auto it = workers_.find(reg.worker_id);
    if (it != workers_.end() && it->second.has_lease && it->second.reg == reg) {
      it->second.lease_deadline.store(deadline);
      return {.outcome = Outcome::kRenewed};
    }
  }
  KvWriterLock g(mu_);
  if (reg.leaving) {
    if (auto it = workers_.find(reg.worker_id); it != workers_.end()) EraseLocked(it, now);
    return {.outcome = Outcome::kLeaving};
  }
  Registered out;
  if (const char* reason = RefusalLocked(reg, out.detail)) {
    CountRefusalLocked(reason);
    out.reason = reason;
    return out;
  }
  left_.erase(reg.worker_id);  // it says it is back
  auto [it, inserted] = workers_.try_emplace(reg.worker_id);
  Worker& w = it->second;
  ranks_total_ = ranks_total_ - (inserted ? 0 : w.reg.dp_size) + reg.dp_size;
  out.outcome = w.has_lease ? Outcome::kUpdated : Outcome::kNew;
  out.device_changed = w.has_lease && w.reg.device != reg.device;
  if (!inserted) Revoke();  // its ranks may be fewer now
  ++changes_;
  if (!inserted && w.reg.role == WorkerRole::kPrefill) prefill_workers_.fetch_sub(1);
  if (reg.role == WorkerRole::kPrefill) prefill_workers_.fetch_add(1);
  w.reg = reg;
  if (!w.has_lease) w.registered_at = now;
  w.has_lease = true;
  w.lease_deadline.store(deadline);
  return out;
}

const char* WorkerRegistry::RefusalLocked(const WorkerRegistration& reg, std::string& detail) const {
  if (reg.block_size && *reg.block_size != limits_.block_size) {
    detail = fmt::format("worker {}: block size {} differs from the router's {}", reg.worker_id, *reg.block_size,
                         limits_.block_size);
    return "block_size";
  }
  if (reg.dp_size > limits_.max_dp_size) {
    detail = fmt::format("worker {}: dp_size {} is above --router-max-dp-size {}", reg.worker_id, reg.dp_size,
                         limits_.max_dp_size);
    return "dp_size";
  }
  if (std::uint64_t{reg.dp_start} + reg.dp_size > kMaxDpRanks) {  // the index's tier ranks lie above
    detail = fmt::format("worker {}: dp ranks [{}, {}) go past {}", reg.worker_id, reg.dp_start,
                         std::uint64_t{reg.dp_start} + reg.dp_size, kMaxDpRanks);
    return "dp_size";
  }
  auto it = workers_.find(reg.worker_id);
  const std::uint64_t before = it == workers_.end() ? 0 : it->second.reg.dp_size;
  if (ranks_total_ - before + reg.dp_size > limits_.max_worker_ranks) {
    detail = fmt::format("worker {}: {} more dp ranks would pass --router-max-worker-ranks {}", reg.worker_id,
                         reg.dp_size, limits_.max_worker_ranks);
    return kTooMany;
  }
  return nullptr;
}

void WorkerRegistry::CountRefusalLocked(std::string_view reason) {
  ++refused_total_;
  ++refused_[std::string(reason)];
}

void WorkerRegistry::CountInvalid() {
  KvWriterLock g(mu_);
  CountRefusalLocked("invalid");
}

namespace {
// A set of ranks, open-addressed (one cache line per lookup on the event path).
struct RankSetTraits {
  using Key = WorkerKey;
  struct Entry {
    WorkerKey key;
    std::uint32_t value;  // kFlatEmpty: a free slot
  };
  static Key KeyOf(const Entry& e) { return e.key; }
  static void Set(Entry& e, const Key& k, std::uint32_t v) { e = {k, v}; }
  static std::uint64_t Hash(const Key& k) { return Mix64(k.worker_id ^ (std::uint64_t{k.dp_rank} << 48)); }
};
// The ranks this thread admitted since the last revocation: admitted again without the lock.
struct Admitted {
  std::uint64_t registry = 0;
  std::uint64_t revision = 0;
  FlatTable<RankSetTraits> ranks;
};
thread_local Admitted admitted;
}  // namespace

bool WorkerRegistry::AdmittedHere(WorkerKey key) const {
  const std::uint64_t revision = revision_.load(std::memory_order_acquire);
  if (admitted.registry != id_ || admitted.revision != revision) {
    admitted.ranks.Clear();
    admitted.registry = id_;
    admitted.revision = revision;
    return false;
  }
  return admitted.ranks.Find(key) != kFlatEmpty;
}

const char* WorkerRegistry::AdmitAndRemember(std::uint64_t worker_id, std::uint32_t dp_rank, SteadyTime now) {
  const char* refused = AdmitEventUncached(worker_id, dp_rank, now);
  if (refused == nullptr && admitted.ranks.size() < kMaxAdmittedCached)
    (void)admitted.ranks.Insert({worker_id, dp_rank}, 1);
  return refused;
}

void WorkerRegistry::Revoke() { revision_.fetch_add(1, std::memory_order_release); }

std::uint64_t WorkerRegistry::NextId() {
  static std::atomic<std::uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

const char* WorkerRegistry::AdmitEventUncached(std::uint64_t worker_id, std::uint32_t dp_rank, SteadyTime now) {
  {
    KvReaderLock g(mu_);
    auto it = workers_.find(worker_id);
    if (it != workers_.end() && Serves(it->second.reg, dp_rank)) {
      it->second.heard_events.store(true, std::memory_order_relaxed);
      return nullptr;
    }
  }
  KvWriterLock g(mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) {
    if (auto l = left_.find(worker_id); l != left_.end()) {
      if (now < l->second) return "worker_left";
      left_.erase(l);
    }
    // A new event-only worker serves ranks [0, dp_rank].
    if (dp_rank >= limits_.max_dp_size) return kOutOfRange;
    if (ranks_total_ + dp_rank + 1 > limits_.max_worker_ranks) return kTooMany;
    // Registrations are bounded by ranks alone (a fleet of 100,000 registered workers is real);
    // ids that only ever send events are bounded by the workers known.
    if (workers_.size() >= limits_.max_workers) return kTooMany;
    WorkerRegistration& reg = workers_[worker_id].reg;
    ++changes_;
    reg.worker_id = worker_id;
    reg.block_size = limits_.block_size;
    reg.dp_size = dp_rank + 1;
    ranks_total_ += reg.dp_size;
    workers_[worker_id].heard_events.store(true, std::memory_order_relaxed);
    return nullptr;
  }
  WorkerRegistration& reg = it->second.reg;
  if (Serves(reg, dp_rank)) return nullptr;  // grown meanwhile
  // A registered worker's ranks are what it registered; an event-only worker's are what it uses.
  if (it->second.has_lease || dp_rank < reg.dp_start) return kOutOfRange;
  const std::uint64_t size = std::uint64_t{dp_rank} - reg.dp_start + 1;
  if (size > limits_.max_dp_size) return kOutOfRange;
  if (ranks_total_ - reg.dp_size + size > limits_.max_worker_ranks) return kTooMany;
  ranks_total_ = ranks_total_ - reg.dp_size + size;
  reg.dp_size = static_cast<std::uint32_t>(size);
  ++changes_;
  return nullptr;
}

void WorkerRegistry::EraseLocked(std::map<std::uint64_t, Worker>::iterator it, SteadyTime now) {
  Revoke();
  ++changes_;
  if (left_.size() < kMaxLeftRemembered) left_[it->first] = now + kLeftMemory;
  ranks_total_ -= it->second.reg.dp_size;
  if (it->second.reg.role == WorkerRole::kPrefill) prefill_workers_.fetch_sub(1);
  if (it->second.silent) silent_workers_.fetch_sub(1);
  workers_.erase(it);
}

bool WorkerRegistry::Forget(std::uint64_t worker_id, SteadyTime now) {
  KvWriterLock g(mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) return false;
  EraseLocked(it, now);
  return true;
}

void WorkerRegistry::PauseLeases() { paused_.store(true); }

void WorkerRegistry::ResumeLeases(SteadyTime now) {
  KvWriterLock g(mu_);  // no heartbeat renews a deadline while they are all reset
  for (auto& [id, w] : workers_) {
    if (w.has_lease) w.lease_deadline.store(Ticks(now + std::chrono::milliseconds(w.reg.lease_ms)));
  }
  paused_.store(false);
}

std::vector<std::uint64_t> WorkerRegistry::ExpireLeases(SteadyTime now) {
  if (paused_.load()) return {};
  const std::int64_t t = Ticks(now);
  auto expired = [t](const Worker& w) { return w.has_lease && t > w.lease_deadline.load(); };
  std::vector<std::uint64_t> ids;
  {
    KvReaderLock g(mu_);  // a scan that usually finds nothing takes no write lock
    for (const auto& [id, w] : workers_) {
      if (expired(w)) ids.push_back(id);
    }
  }
  if (ids.empty()) return ids;
  KvWriterLock g(mu_);
  std::erase_if(left_, [&](const auto& l) { return now >= l.second; });  // also erased when met
  std::erase_if(ids, [&](std::uint64_t id) {
    mu_.AssertHeld();
    auto it = workers_.find(id);
    if (it == workers_.end() || !expired(it->second)) return true;  // renewed or gone meanwhile
    EraseLocked(it, now);
    return false;
  });
  leases_expired_ += ids.size();
  return ids;
}

namespace {
RankInfo InfoOf(const WorkerRegistration& reg) {
  return {.worker = {reg.worker_id, 0},
          .is_cpu = reg.device == "cpu",
          .max_num_seqs = reg.max_num_seqs,
          .max_num_batched_tokens = reg.max_num_batched_tokens,
          .total_kv_blocks = reg.total_kv_blocks};
}
}  // namespace

std::shared_ptr<const std::vector<RankInfo>> WorkerRegistry::AllRanks() const {
  KvReaderLock g(mu_);
  {
    std::lock_guard s(snapshot_mu_);
    if (snapshot_ && snapshot_changes_ == changes_) return snapshot_;
  }
  auto all = std::make_shared<std::vector<RankInfo>>();
  all->reserve(ranks_total_);
  for (const auto& [id, w] : workers_) {
    if (w.reg.role == WorkerRole::kPrefill) continue;  // never a request's worker
    RankInfo r = InfoOf(w.reg);
    for (std::uint64_t rank = w.reg.dp_start; rank < std::uint64_t{w.reg.dp_start} + w.reg.dp_size; ++rank) {
      r.worker.dp_rank = static_cast<std::uint32_t>(rank);
      all->push_back(r);
    }
  }
  std::lock_guard s(snapshot_mu_);
  snapshot_ = std::move(all);
  snapshot_changes_ = changes_;
  return snapshot_;
}

Result<std::vector<RankInfo>> WorkerRegistry::Ranks(std::optional<std::uint64_t> pin,
                                                    std::optional<std::uint32_t> dp_rank,
                                                    const std::optional<std::vector<std::uint64_t>>& allowed,
                                                    const std::optional<std::vector<std::uint64_t>>& excluded) const {
  std::vector<RankInfo> out;
  std::vector<std::uint64_t> skip = excluded.value_or(std::vector<std::uint64_t>{});
  std::sort(skip.begin(), skip.end());
  auto add_worker = [&](const Worker& w) {
    if (w.reg.role == WorkerRole::kPrefill) return;  // never a request's worker
    if (std::binary_search(skip.begin(), skip.end(), w.reg.worker_id)) return;
    const std::uint64_t end = std::uint64_t{w.reg.dp_start} + w.reg.dp_size;
    RankInfo r = InfoOf(w.reg);
    if (dp_rank) {
      if (Serves(w.reg, *dp_rank)) {
        r.worker.dp_rank = *dp_rank;
        out.push_back(r);
      }
      return;
    }
    for (std::uint64_t rank = w.reg.dp_start; rank < end; ++rank) {
      r.worker.dp_rank = static_cast<std::uint32_t>(rank);
      out.push_back(r);
    }
  };
  KvReaderLock g(mu_);
  if (!pin)
    out.reserve(allowed ? std::min(allowed->size(), workers_.size()) : workers_.size());  // a rank a worker, mostly
  if (pin) {
    auto pinned = PinnedLocked(*pin, dp_rank);
    if (!pinned.ok()) return pinned.status();
    const auto it = *pinned;
    add_worker(it->second);
  } else if (allowed) {
    // Look the allowed ids up (ascending, each once) rather than test every worker against them.
    std::vector<std::uint64_t> ids = *allowed;
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
    for (std::uint64_t id : ids) {
      if (auto it = workers_.find(id); it != workers_.end()) add_worker(it->second);
    }
  } else {
    for (const auto& [id, w] : workers_) add_worker(w);
  }
  return out;
}

Result<std::map<std::uint64_t, WorkerRegistry::Worker>::const_iterator> WorkerRegistry::PinnedLocked(
    std::uint64_t pin, std::optional<std::uint32_t> dp_rank) const {
  auto it = workers_.find(pin);
  if (it == workers_.end()) return NotFound(fmt::format("worker {} is not registered", pin));
  if (it->second.reg.role == WorkerRole::kPrefill) {
    return InvalidArgument(fmt::format("worker {} serves prefill legs only (role prefill)", pin));
  }
  if (dp_rank && !Serves(it->second.reg, *dp_rank)) {
    return NotFound(fmt::format("worker {} has no dp rank {}", pin, *dp_rank));
  }
  return it;
}

Result<RankPools> WorkerRegistry::Pools(std::optional<std::uint64_t> pin, std::optional<std::uint32_t> dp_rank,
                                        const std::optional<std::vector<std::uint64_t>>& allowed,
                                        const std::optional<std::vector<std::uint64_t>>& excluded) const {
  RankPools out;
  std::vector<std::uint64_t> skip = excluded.value_or(std::vector<std::uint64_t>{});
  std::sort(skip.begin(), skip.end());
  std::vector<std::uint64_t> ids;
  if (allowed) {
    ids = *allowed;
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  }
  // `pinned`: the walk of the pinned worker, which may give only the request's (decode) rank.
  auto add_worker = [&](const Worker& w, bool pinned) {
    const WorkerRole role = w.reg.role;
    if (role == WorkerRole::kPrefill && pinned) return;
    if (std::binary_search(skip.begin(), skip.end(), w.reg.worker_id)) {
      if (role == WorkerRole::kPrefill) out.prefill_excluded = true;
      return;
    }
    std::vector<RankInfo>& to =
        role == WorkerRole::kPrefill ? out.prefill : role == WorkerRole::kDecode ? out.decode : out.whole;
    RankInfo r = InfoOf(w.reg);
    if (dp_rank && role != WorkerRole::kPrefill) {  // dp_rank names the request's rank
      if (Serves(w.reg, *dp_rank)) {
        r.worker.dp_rank = *dp_rank;
        to.push_back(r);
      }
      return;
    }
    for (std::uint64_t rank = w.reg.dp_start; rank < std::uint64_t{w.reg.dp_start} + w.reg.dp_size; ++rank) {
      r.worker.dp_rank = static_cast<std::uint32_t>(rank);
      to.push_back(r);
    }
  };
  KvReaderLock g(mu_);
  bool prefill_only = false;  // beside a pinned decode worker: the prefill pool alone
  if (pin) {
    auto pinned = PinnedLocked(*pin, dp_rank);
    if (!pinned.ok()) return pinned.status();
    const auto it = *pinned;
    add_worker(it->second, true);
    // A pinned decode worker still takes its prefill leg from the pool.
    if (it->second.reg.role != WorkerRole::kDecode) return out;
    prefill_only = true;
  }
  if (allowed) {
    for (std::uint64_t id : ids) {
      auto it = workers_.find(id);
      if (it != workers_.end() && (!prefill_only || it->second.reg.role == WorkerRole::kPrefill)) {
        add_worker(it->second, false);
      }
    }
  } else {
    for (const auto& [id, w] : workers_) {
      if (!prefill_only || w.reg.role == WorkerRole::kPrefill) add_worker(w, false);
    }
  }
  return out;
}

WorkerFace WorkerRegistry::FaceOf(std::uint64_t worker_id) const {
  KvReaderLock g(mu_);
  auto it = workers_.find(worker_id);
  if (it == workers_.end()) return {};
  const WorkerRegistration& r = it->second.reg;
  return {.http_url = r.http_url,
          .kv_connector = r.kv_connector,
          .bootstrap_port = r.bootstrap_port,
          .dp_start = r.dp_start,
          .dp_size = r.dp_size};
}

std::string WorkerRegistry::HttpUrl(std::uint64_t worker_id) const {
  KvReaderLock g(mu_);
  auto it = workers_.find(worker_id);
  return it == workers_.end() ? std::string() : it->second.reg.http_url;
}

bool WorkerRegistry::HasRank(WorkerKey worker) const {
  KvReaderLock g(mu_);
  auto it = workers_.find(worker.worker_id);
  return it != workers_.end() && Serves(it->second.reg, worker.dp_rank);
}

std::vector<RankEntry> WorkerRegistry::Page(std::uint64_t offset, std::uint32_t limit, std::uint64_t* total) const {
  std::vector<RankEntry> out;
  KvReaderLock g(mu_);
  *total = ranks_total_;
  std::uint64_t skip = offset;
  for (auto it = workers_.begin(); it != workers_.end() && out.size() < limit; ++it) {
    const WorkerRegistration& reg = it->second.reg;
    if (skip >= reg.dp_size) {
      skip -= reg.dp_size;
      continue;
    }
    const std::uint64_t end = std::uint64_t{reg.dp_start} + reg.dp_size;
    for (std::uint64_t rank = reg.dp_start + skip; rank < end && out.size() < limit; ++rank) {
      out.push_back({.worker = {it->first, static_cast<std::uint32_t>(rank)},
                     .device = reg.device,
                     .role = reg.role,
                     .without_events = it->second.silent});
    }
    skip = 0;
  }
  return out;
}

std::vector<std::uint64_t> WorkerRegistry::Unheard(SteadyTime now, std::chrono::milliseconds quiet) const {
  std::vector<std::uint64_t> out;
  KvReaderLock g(mu_);
  for (const auto& [id, w] : workers_) {
    if (w.has_lease && !w.heard_events.load(std::memory_order_relaxed) && now - w.registered_at >= quiet) {
      out.push_back(id);
    }
  }
  return out;
}

std::vector<std::uint64_t> WorkerRegistry::SetSilent(const std::vector<std::uint64_t>& silent) {
  std::vector<std::uint64_t> newly;
  std::uint64_t marked = 0;
  KvWriterLock g(mu_);
  for (auto& [id, w] : workers_) {
    const bool was = w.silent;
    // An event admitted since Unheard was read ends the silence.
    w.silent = std::binary_search(silent.begin(), silent.end(), id) && !w.heard_events.load(std::memory_order_relaxed);
    marked += w.silent;
    if (w.silent && !was) newly.push_back(id);
  }
  silent_workers_.store(marked, std::memory_order_relaxed);
  return newly;
}

std::uint64_t WorkerRegistry::ranks_total() const {
  KvReaderLock g(mu_);
  return ranks_total_;
}

std::uint64_t WorkerRegistry::refused_total() const {
  KvReaderLock g(mu_);
  return refused_total_;
}

std::map<std::string, std::uint64_t> WorkerRegistry::refused() const {
  KvReaderLock g(mu_);
  return refused_;
}

}  // namespace kvrouter
