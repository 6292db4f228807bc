// WorkerRegistry: the workers the router knows (docs/protocol.md section 4): registrations with
// leases, `leaving`, their dp ranks, block-size refusals, workers seen only through their KV
// events, and the bounds no peer may pass (--router-max-dp-size, --router-max-worker-ranks).
//
// Thread contract: every method may be called from any thread. One reader-writer lock guards
// the map; the hot callers take it shared: an event's admission for a known worker rank (and
// not even that for a rank the thread admitted before, see AdmitEvent), a heartbeat that
// repeats the registration (its lease deadline is an atomic), candidate building and stats
// pages. Only a new or changed worker, a leaving one and lease expiry write. The
// registry never calls out while holding its lock, so callers may hold their own locks around
// it (the routing mutex is taken before this lock, never after).
//
//   WorkerRegistry reg(limits);  auto r = reg.Register(decoded, now);  reg.ExpireLeases(now);
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <unordered_map>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "events/registration_codec.h"
#include "events/base/thread_annotations.h"
#include "events/base/clock.h"
#include "router/index/worker_key.h"
#include "router/scheduling/selector.h"

namespace kvrouter {

struct RegistryLimits {
  std::uint32_t block_size = 64;             // a worker must use the router's
  std::uint32_t max_dp_size = 1024;          // ranks per worker
  std::uint64_t max_worker_ranks = 1 << 18;  // (worker, dp_rank) pairs in all
  std::uint64_t max_workers = 1 << 16;       // workers known before an unknown id's event is refused
};

// One rank of a stats page.
struct RankEntry {
  WorkerKey worker;
  std::string device;
  WorkerRole role = WorkerRole::kBoth;
  bool without_events = false;  // its worker is silent (WorkerRegistry::SetSilent)
};

// A request's ranks by role (section 13): see WorkerRegistry::Pools.
struct RankPools {
  std::vector<RankInfo> whole;    // role both
  std::vector<RankInfo> decode;   // role decode
  std::vector<RankInfo> prefill;  // role prefill, not excluded
  bool prefill_excluded = false;  // an allowed prefill worker was excluded
  // Disaggregated-eligible: decode workers and prefill workers among the candidates.
  bool eligible() const { return !decode.empty() && (!prefill.empty() || prefill_excluded); }
};

// What a reply names of a worker besides its rank (sections 11 and 13).
struct WorkerFace {
  std::string http_url;
  KvConnector kv_connector = KvConnector::kNixl;
  std::uint32_t bootstrap_port = 8998;
  std::uint32_t dp_start = 0;
  std::uint32_t dp_size = 1;
};

class WorkerRegistry {
 public:
  explicit WorkerRegistry(RegistryLimits limits) : limits_(limits) {}

  enum class Outcome {
    kNew,      // a worker not heard from before (or only through events): new capacity
    kRenewed,  // a known worker's heartbeat, unchanged (its lease runs again)
    kUpdated,  // a known worker's heartbeat with a changed registration
    kLeaving,  // status "leaving": forgotten
    kRefused,  // outside the bounds; nothing changed
  };
  struct Registered {
    Outcome outcome = Outcome::kRefused;
    std::string_view reason;  // kRefused: "block_size", "dp_size", "too_many_workers"
    std::string detail;       // kRefused: for the log
    bool device_changed = false;  // kUpdated: registered before as another device
  };
  // Applies a decoded registration at `now`: all of it, or (refused) nothing.
  Registered Register(const WorkerRegistration& reg, SteadyTime now);  // a registration ends "left"
  // Counts a registration that could not be decoded (reason "invalid").
  void CountInvalid();

  // Admission of a KV event of (worker_id, dp_rank) at `now`: nullptr when it may be indexed (a
  // worker seen for the first time is added without a lease; an event-only worker grows to cover
  // the rank, unless --router-max-workers are known), else the drop reason ("dp_rank_out_of_range",
  // "too_many_workers", "worker_left":
  // an event of a worker forgotten less than kLeftMemory ago, late behind its `leaving` or its
  // lease expiry, must not bring it back as an event-only worker that never expires).
  // A thread remembers the ranks it admitted until a worker is forgotten or registers again
  // (at most kMaxAdmittedCached of them): the event thread then admits a known rank's events
  // without the lock, whose cache line every one of them would otherwise write.
  // `now` may be a callable giving the time: it is then called only when the thread's memory
  // does not already admit the rank (the event path reads no clock per event).
  const char* AdmitEvent(std::uint64_t worker_id, std::uint32_t dp_rank, SteadyTime now) {
    return AdmitEvent(worker_id, dp_rank, [now] { return now; });
  }
  template <typename Now>
  requires std::is_invocable_r_v<SteadyTime, Now&>
  const char* AdmitEvent(std::uint64_t worker_id, std::uint32_t dp_rank, Now&& now) {
    if (AdmittedHere({worker_id, dp_rank})) return nullptr;
    return AdmitAndRemember(worker_id, dp_rank, now());
  }
  static constexpr std::size_t kMaxAdmittedCached = 1 << 16;
  static constexpr std::chrono::seconds kLeftMemory{10};
  static constexpr std::size_t kMaxLeftRemembered = 65536;

  // Forgets a worker at once (remembering for kLeftMemory that it left); false when unknown.
  bool Forget(std::uint64_t worker_id, SteadyTime now);
  // Forgets every worker whose lease ended before `now`; returns their ids, ascending. Nothing
  // expires while leases are paused.
  std::vector<std::uint64_t> ExpireLeases(SteadyTime now);
  // The router cannot hear its workers (its NATS connection is down): it must not conclude they
  // died. Resume gives every leased worker one full lease from `now` to be heard again.
  void PauseLeases();
  void ResumeLeases(SteadyTime now);
  bool leases_paused() const { return paused_.load(); }

  // Ranks a request may go to, ascending by (worker_id, dp_rank): a pinned worker (and rank),
  // else the allowed ids (each looked up), else every worker; `dp_rank` filters ranks and
  // `excluded` workers are left out, and so are prefill workers (section 13: never a request's
  // worker). NotFound for an unknown pinned worker or rank, InvalidArgument for a pinned prefill
  // worker; an empty result is not an error here.
  Result<std::vector<RankInfo>> Ranks(std::optional<std::uint64_t> pin, std::optional<std::uint32_t> dp_rank,
                                      const std::optional<std::vector<std::uint64_t>>& allowed,
                                      const std::optional<std::vector<std::uint64_t>>& excluded = std::nullopt) const;
  // A request's ranks by role (section 13), filtered as Ranks filters them, ascending: `dp_rank`
  // and a pin name the request's (decode or whole) rank, while the prefill pool is every allowed
  // prefill worker that is not excluded (beside a pinned decode worker too). Same errors as Ranks.
  Result<RankPools> Pools(std::optional<std::uint64_t> pin, std::optional<std::uint32_t> dp_rank,
                          const std::optional<std::vector<std::uint64_t>>& allowed,
                          const std::optional<std::vector<std::uint64_t>>& excluded = std::nullopt) const;
  // Registered workers of role prefill: none means no request is disaggregated-eligible.
  std::uint64_t prefill_workers() const { return prefill_workers_.load(std::memory_order_relaxed); }
  // Every rank a request may go to, as Ranks gives them without a pin or filter: one list shared until the registry
  // changes (a registration new or changed, a worker gone or grown by its events), so a decision
  // over a large fleet does not copy it.
  std::shared_ptr<const std::vector<RankInfo>> AllRanks() const;
  bool HasRank(WorkerKey worker) const;
  // The worker's announced OpenAI base URL (section 11); empty when unknown or none.
  std::string HttpUrl(std::uint64_t worker_id) const;
  // Its URL, connector and ranks; defaults when unknown.
  WorkerFace FaceOf(std::uint64_t worker_id) const;
  // Ranks [offset, offset + limit) in ascending order, and the number of ranks in all.
  std::vector<RankEntry> Page(std::uint64_t offset, std::uint32_t limit, std::uint64_t* total) const;

  // Silent workers, routed blind (docs/operations.md "Silent workers"): Unheard lists the
  // workers registered at least `quiet` before `now` from which no KV event was ever admitted;
  // SetSilent marks exactly `silent` of them (the caller's judgement) and returns the workers
  // newly marked, ascending, for the caller to name once. Marks show in Page and silent_workers().
  std::vector<std::uint64_t> Unheard(SteadyTime now, std::chrono::milliseconds quiet) const;
  std::vector<std::uint64_t> SetSilent(const std::vector<std::uint64_t>& silent);
  std::uint64_t silent_workers() const { return silent_workers_.load(std::memory_order_relaxed); }

  std::uint64_t ranks_total() const;
  std::uint64_t leases_expired() const { return leases_expired_.load(); }
  std::uint64_t refused_total() const;
  std::map<std::string, std::uint64_t> refused() const;  // reason -> count

 private:
  struct Worker {
    WorkerRegistration reg;
    bool has_lease = false;                       // false until the first heartbeat (event-only workers)
    std::atomic<std::int64_t> lease_deadline{0};  // steady ticks; renewed under the shared lock
    SteadyTime registered_at{};                   // its first registration (has_lease since)
    std::atomic<bool> heard_events{false};        // an event of it was admitted (set under the shared lock)
    bool silent = false;                          // marked by SetSilent
  };
  // mu_ held (exclusive): the reason `reg` must be refused, or nullptr.
  const char* RefusalLocked(const WorkerRegistration& reg, std::string& detail) const KV_REQUIRES(mu_);
  void CountRefusalLocked(std::string_view reason) KV_REQUIRES(mu_);
  void EraseLocked(std::map<std::uint64_t, Worker>::iterator it, SteadyTime now) KV_REQUIRES(mu_);
  // The worker a request pins (at `dp_rank` when given): NotFound when unknown or without that
  // rank, InvalidArgument for a prefill worker (never a request's worker).
  Result<std::map<std::uint64_t, Worker>::const_iterator> PinnedLocked(std::uint64_t pin,
                                                                       std::optional<std::uint32_t> dp_rank) const
      KV_REQUIRES_SHARED(mu_);
  // AdmitEvent's halves: whether this thread admitted `key` since the last revocation, and the
  // admission under the lock, remembered by this thread when granted.
  bool AdmittedHere(WorkerKey key) const;
  const char* AdmitAndRemember(std::uint64_t worker_id, std::uint32_t dp_rank, SteadyTime now);
  // AdmitEvent without the thread's memory of admitted ranks.
  const char* AdmitEventUncached(std::uint64_t worker_id, std::uint32_t dp_rank, SteadyTime now);
  // mu_ held (exclusive): a rank admitted before may no longer be; threads forget what they admitted.
  void Revoke() KV_REQUIRES(mu_);
  static std::uint64_t NextId();

  const std::uint64_t id_ = NextId();       // tells registries apart in a thread's memory
  std::atomic<std::uint64_t> revision_{0};  // Revoke() calls

  const RegistryLimits limits_;
  mutable KvSharedMutex mu_;
  std::map<std::uint64_t, Worker> workers_ KV_GUARDED_BY(mu_);  // ordered: stable candidates, paging
  std::uint64_t ranks_total_ KV_GUARDED_BY(mu_) = 0;            // sum of workers_' dp_size
  std::uint64_t changes_ KV_GUARDED_BY(mu_) = 0;                // of workers_' ranks or their RankInfo
  // AllRanks' list and the changes_ it was made at (taken after mu_, never before it).
  mutable std::mutex snapshot_mu_;
  mutable std::shared_ptr<const std::vector<RankInfo>> snapshot_;
  mutable std::uint64_t snapshot_changes_ = 0;
  std::map<std::string, std::uint64_t> refused_ KV_GUARDED_BY(mu_);
  std::uint64_t refused_total_ KV_GUARDED_BY(mu_) = 0;
  std::unordered_map<std::uint64_t, SteadyTime> left_ KV_GUARDED_BY(mu_);  // forgotten worker -> until
  std::atomic<std::uint64_t> leases_expired_{0};
  std::atomic<std::uint64_t> silent_workers_{0};  // workers marked silent now
  std::atomic<std::uint64_t> prefill_workers_{0};  // changed under mu_ (exclusive)
  std::atomic<bool> paused_{false};
};

}  // namespace kvrouter
