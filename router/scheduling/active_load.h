// ActiveLoad: the load the router itself has put on each (worker, dp_rank), from its own
// bookings (docs/design.md "Selection"): refcounted active blocks by sequence hash (shared prefixes
// count once), active prefill tokens, active requests. mark_prefill removes a request's prefill
// tokens, free removes everything it booked; both are idempotent. Requests older than the
// sweep age (300 s) are released by Sweep().
// RemoveWorker costs time proportional to that worker's bookings, not to all of them.
// Not thread-safe: the service guards it with one mutex (bookings are short).
//
//   load.Book("r1", {7, 0}, seq_hashes, prompt_tokens - cached_tokens, now);
//   load.MarkPrefill("r1");  load.Free("r1");
// A disaggregated request (protocol.md section 13) has a second part on its prefill rank
// (BookPrefill): one active request and its uncached prompt tokens there, no blocks. It goes at
// ReleasePrefill (prefill_done), MarkPrefill or Free, and with its prefill worker (RemoveWorker).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "events/block_hash.h"
#include "events/base/clock.h"
#include "router/index/worker_key.h"
#include "router/scheduling/worker_rates.h"

namespace kvrouter {

struct WorkerLoad {
  std::uint64_t active_blocks = 0;          // distinct sequence hashes of active requests
  std::uint64_t active_prefill_tokens = 0;  // prompt tokens still to prefill
  // Sum over those requests of (their prefill tokens)^2, each capped at 2^24 tokens: prefill
  // time grows with the square of a prompt, so one 80k-token prefill is not eight 10k ones.
  std::uint64_t active_prefill_squares = 0;
  // Requests booked here lately, scaled: times RecentScale(now) it is their count with each
  // halving every kRecentHalfLife (one multiplication per worker instead of an exp2).
  double recent_scaled = 0;
  std::uint32_t active_requests = 0;
};

class ActiveLoad {
 public:
  // Books a request; false (nothing changes) when request_id is already booked.
  bool Book(const std::string& request_id, WorkerKey worker, std::span<const SequenceHash> seq,
            std::uint64_t prefill_tokens, SteadyTime now);
  // Also releases the prefill part (the decode leg's first byte comes after the prefill leg).
  bool MarkPrefill(const std::string& request_id);  // false when unknown or already marked
  bool Free(const std::string& request_id);         // false when unknown
  // The prefill part of booked request `request_id` on `worker` (another rank than its own); the
  // request's own rank then prefills nothing. A booking gets one prefill part in its life: false
  // when the request is not booked or has had one (a replica's late or repeated add).
  bool BookPrefill(const std::string& request_id, WorkerKey worker, std::uint64_t prefill_tokens, SteadyTime now);
  // Releases only the prefill part; false when there is none.
  bool ReleasePrefill(const std::string& request_id);
  // The rank of the request's prefill part, if it has one.
  const WorkerKey* PrefillWorkerOf(const std::string& request_id) const;
  // Releases requests booked before now - max_age; returns how many.
  std::size_t Sweep(SteadyTime now, std::chrono::seconds max_age = std::chrono::seconds(300));
  // Releases every request booked on worker_id (any dp rank), and the prefill parts booked there
  // (their requests stay booked); returns how many of both.
  std::size_t RemoveWorker(std::uint64_t worker_id);

  WorkerLoad Load(WorkerKey worker) const;
  // How many of the request's leading sequence hashes are already active on the worker.
  std::uint32_t ActivePrefix(WorkerKey worker, std::span<const SequenceHash> seq) const;
  // Requests booked on the worker lately: each counts 1, halving every kRecentHalfLife. A
  // worker's share of them predicts its share of the traffic that is coming back (sessions).
  // = Load(worker).recent_scaled * RecentScale(now).
  double RecentRequests(WorkerKey worker, SteadyTime now) const;
  double RecentScale(SteadyTime now) const;
  static constexpr std::chrono::seconds kRecentHalfLife{60};
  // Where a booked request went, if it is booked.
  const WorkerKey* WorkerOf(const std::string& request_id) const;
  // What the prior predicted for a booked request where it went (kept until it is released;
  // WorkerRates learns from it at its free). PriorOf is null for unknown ids and bookings
  // without one (another replica's).
  void SetPrior(const std::string& request_id, const PriorTtft& prior);
  const PriorTtft* PriorOf(const std::string& request_id) const;
  // Forgets the priors of the worker's bookings (they stay booked): what they observe when they
  // end teaches nothing (the worker is other hardware now).
  void DropPriors(std::uint64_t worker_id);
  // Calls f(request_id, worker, seq_hashes, prefill_tokens still booked) for every booking.
  void ForEach(
      const std::function<void(const std::string&, WorkerKey, std::span<const SequenceHash>, std::uint64_t)>& f) const;
  // Calls f(request_id, prefill rank, its prefill tokens) for every prefill part.
  void ForEachPrefillPart(const std::function<void(const std::string&, WorkerKey, std::uint64_t)>& f) const;
  std::size_t prefill_parts() const { return prefill_parts_; }
  std::size_t requests() const { return requests_.size(); }
  // Ranks with an entry (booked at some time, until RemoveWorker): 0 means every Load is zero.
  std::size_t workers() const { return workers_.size(); }
  // Ranks with a request booked now (a subset of workers()).
  std::size_t active_workers() const { return active_workers_; }
  // Calls f(rank, its load) for every rank with an entry: those whose Load may be other than zero.
  template <typename F>
  void ForEachWorker(F&& f) const {
    for (const auto& [rank, w] : workers_) f(rank, w.load);
  }
  // Sequence hashes held by all bookings together (a shared prefix counts once per booking).
  std::uint64_t booked_blocks() const { return booked_blocks_; }

 private:
  struct Booking {
    WorkerKey worker;
    std::vector<SequenceHash> seq;
    std::uint64_t prefill_tokens = 0;  // 0 once marked
    SteadyTime booked_at;
    PriorTtft prior;
    bool has_prior = false;
    struct PrefillPart {
      WorkerKey worker;
      std::uint64_t tokens = 0;
    };
    std::optional<PrefillPart> prefill;
    bool had_prefill = false;  // a prefill part was booked (and may be released since)
  };
  struct PerWorker {  // kept while idle (it holds recent_scaled), erased by RemoveWorker
    std::unordered_map<SequenceHash, std::uint32_t> blocks;  // refcounts
    WorkerLoad load;
  };
  void Release(std::unordered_map<std::string, Booking>::iterator it);
  // Takes one request and `tokens` prefill tokens off `worker`'s load (its entry must exist).
  void Unload(PerWorker& w, std::uint64_t tokens);
  void ReleasePrefillPart(std::unordered_map<std::string, Booking>::iterator it);
  // Counts one more request booked on `worker` now in its recent requests.
  void AddRecent(PerWorker& w, SteadyTime now);

  std::unordered_map<std::string, Booking> requests_;
  std::unordered_map<WorkerKey, PerWorker, WorkerKeyHash> workers_;
  // recent_scaled is relative to this moment (moved forward, rescaling every worker, when the
  // scale of a new booking would pass 2^64).
  SteadyTime recent_epoch_{};
  bool has_epoch_ = false;
  // worker_id -> its bookings' ids (keys of requests_, whose nodes do not move).
  std::unordered_map<std::uint64_t, std::unordered_set<const std::string*>> by_worker_;
  std::uint64_t booked_blocks_ = 0;
  std::size_t active_workers_ = 0;
  std::size_t prefill_parts_ = 0;
};

}  // namespace kvrouter
