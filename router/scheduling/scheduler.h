// Scheduler: the decision for one route request (docs/design.md "Selection", "Approximate mode";
// its terms, candidate, booking, fleet pick, crowd, in "Glossary").
// Prepare hashes the prompt once and resolves its cost parameters; Candidates turns the ranks
// the request may use into candidates with their overlap and load; OpenRanks drops the full
// ones when the queue is on; Decide picks one and books it. It owns the bookings (ActiveLoad),
// the selector with its random source, approximate mode's predictions, and each rank's learned
// speed (WorkerRates: Learn at a free with the engine's timing, read by Candidates).
// Prepare, IndexOverlaps and IndexRuns are free functions: they read only the options and the
// event index (lock-free), so Routing calls them before it takes its mutex.
// Thread contract: none for Scheduler; Routing holds its routing mutex around every call.
// The pick over the whole fleet (PickFromFleet, its classes and crowds) is in fleet_pick.cc.
// Ownership: borrows the event index, which must outlive it.
//
//   auto p = PrepareRequest(opts, req);  IndexOverlaps(opts, index, *p, overlaps);
//   auto booked = s.Decide(req, *p, s.OpenRanks(s.Candidates(ranks, p->seq, overlaps)));
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "events/base/clock.h"
#include "events/base/status.h"
#include "events/block_hash.h"
#include "events/router_endpoints_codec.h"
#include "router/index/approx_index.h"
#include "router/index/sharded_index.h"
#include "router/scheduling/active_load.h"
#include "router/scheduling/cost_disagg.h"
#include "router/scheduling/policy.h"
#include "router/scheduling/selector.h"
#include "router/scheduling/worker_rates.h"

namespace kvrouter {

struct SchedulerOptions {
  RouterMode mode = RouterMode::kRoundRobin;
  std::uint32_t block_size = 64;
  CostParams cost;            // the defaults a request may override
  bool use_kv_events = true;  // overlaps from the event index
  // Approximate mode: predictions of what a booked decision puts in a worker's cache.
  struct Predictions {
    std::chrono::milliseconds ttl{120'000};
    std::uint64_t max_blocks = 1 << 20;
    double prune_target_ratio = 0.8;
  };
  std::optional<Predictions> predictions;  // nullopt: no approximate mode
  std::optional<double> queue_threshold;   // full: active prefill > threshold x max_num_batched_tokens
  std::uint32_t max_prompt_tokens = 1 << 20;
  std::uint32_t max_active_requests = 65536;  // bookings at most
  std::uint64_t max_active_blocks = 1 << 22;  // booked blocks at most
  DisaggOptions disagg;                       // section 13's decision (cost_disagg.h)
};

// A decoded request made ready for selection: hashed once, its cost parameters resolved.
struct PreparedRequest {
  std::vector<LocalHash> local;
  std::vector<SequenceHash> seq;
  SelectionRequest sel;
  CostParams params;
};

// What Decide chose.
struct Decision {
  WorkerKey worker;
  std::uint32_t overlap_blocks = 0;  // of the request's blocks, cached there (on device)
  TieredOverlap overlap_by_tier;     // the same per tier, cumulative
  bool booked = false;               // the request now weighs on that worker
};

// What DecideDisagg chose: the request's (decode) rank, and its prefill rank when it goes
// through the prefill pool.
struct DisaggDecision {
  Decision decode;
  std::optional<Decision> prefill;
  DisaggChoice choice;
};

// The request hashed and its cost parameters resolved. InvalidArgument for a prompt over
// max_prompt_tokens, block hashes that do not fit isl, or mode direct without a pinned worker.
Result<PreparedRequest> PrepareRequest(const SchedulerOptions& options, const RouteRequest& req);
// Overlap per rank from the event index into `out` (empty outside mode kv, without events, or in
// approximate mode). Callers keep `out` between calls: at thousands of matching workers a fresh
// vector would be allocated per route.
void IndexOverlaps(const SchedulerOptions& options, const ShardedIndex& index, const PreparedRequest& p,
                   OverlapScores& out);
// The same read as the index's runs of holder slots, not yet translated to ranks (for
// Scheduler::PickFromFleet), the runs of `known` stamps elided (Scheduler::CrowdStamps). False,
// leaving `out` as it was, where IndexOverlaps would read nothing.
bool IndexRuns(const SchedulerOptions& options, const ShardedIndex& index, const PreparedRequest& p, IndexMatches& out,
               std::span<const std::uint64_t> known = {});
// Whether Scheduler::PickFromFleet can decide this request (over every rank, unfiltered): mode
// kv at temperature 0.
bool FleetPickServes(const SchedulerOptions& options, const PreparedRequest& p);

class Scheduler {
 public:
  using Clock = std::function<SteadyTime()>;

  Scheduler(SchedulerOptions options, const ShardedIndex& index, Clock clock, std::uint64_t seed);

  const SchedulerOptions& options() const { return options_; }

  // Sets p's spread scale (CostParams::spread_scale) from the rates learned so far; a request
  // decided later (queued) keeps the scale of its arrival.
  void PriceSpread(PreparedRequest& p) const;
  // Overlap per rank from the predictions (approximate mode; else empty), into `out`.
  void PredictedOverlaps(const PreparedRequest& p, OverlapScores& out) const;
  // The overlaps a queued request is judged by again: predictions in approximate mode, else the
  // event index.
  void FreshOverlaps(const PreparedRequest& p, OverlapScores& out) const;

  // `ranks` (ascending) as candidates with their load and overlap (`overlaps` is reordered: RankOverlaps).
  std::vector<Candidate> Candidates(std::span<const RankInfo> ranks, std::span<const SequenceHash> seq,
                                    OverlapScores& overlaps) const;
  // What PickFromFleet chose.
  struct FleetChoice {
    std::optional<Candidate> chosen;  // nullopt: every rank is full
    std::uint32_t best_overlap = 0;   // the longest device overlap of any rank, full or not
    bool full_scan = false;           // made by the full scan (most ranks priced one by one)
    // From runs, where crowds could not be used (a tier rank in or beside a crowd, a slot reused
    // since the read, more crowds than kept): every run was translated.
    bool runs_refused = false;
  };
  // Whether a pick considers ranks past the queue threshold: best_worker does, a request that
  // would book does not (OpenRanks).
  enum class FullRanks { kIncluded, kExcluded };
  // For FleetPickServes requests over every registered rank (`ranks`, ascending, non-empty): the
  // rank, from the same random draws, that Decide picks among Candidates(ranks, ...) (after
  // OpenRanks when full ranks are left out), without a candidate for every rank (docs/design.md "Decisions
  // over a large fleet"). Ranks that differ from an idle one (the index matches them, they carry
  // the router's load or a learned rate) are priced one by one; every other rank costs what an
  // idle rank of its class costs (the registration fields the costs read), so a class is priced
  // once and its idle members are counted, not visited. The tie among equal costs is broken as
  // Selector breaks it: a uniform draw of the k-th tied rank in rank order, found by counting.
  // Which registration fields an idle rank's price reads, and whether a rank's history (recent
  // requests, learned rates) sets it apart, each cost declares (costs.h): this pick does not
  // know them. Time: O(those ranks x log ranks + classes), and with runs a copy and a compare of
  // each crowd's slots (below); the class table is rebuilt when `ranks` changes.
  // Decide({&*chosen, 1}) then books it without another draw. `overlaps` is reordered.
  FleetChoice PickFromFleet(const std::shared_ptr<const std::vector<RankInfo>>& ranks, const PreparedRequest& p,
                            OverlapScores& overlaps, FullRanks full);
  // The same choice from the index's runs (IndexRuns), with `overlaps` as scratch. A run of at
  // least kCrowd slots (thousands of ranks holding a shared prefix) is not translated rank by
  // rank: it is looked up among the crowds translated before (the same slots of the same shard,
  // no slot of that shard handed to another worker since, the same registered list), where its
  // registered ranks wait as positions per class, ascending; so it is counted, and the tie drawn
  // over it, without a lookup per rank: the run is known by its holder set's stamp, or compared
  // as memory where it has none (and a crowd copied whole at a shallower depth is intersected
  // with the deeper crowds of its shard); a run elided (read with CrowdStamps) must be found by
  // its stamp, else every run is translated from a read again. The other runs
  // are translated rank by rank. Translates every run instead, and decides as the form above,
  // where a crowd holds a host or disk tier rank's slot, a tier rank is matched beside a crowd,
  // a slot was reused since the read, this read has more crowds than are kept, or the full scan
  // is cheaper.
  FleetChoice PickFromFleet(const std::shared_ptr<const std::vector<RankInfo>>& ranks, const PreparedRequest& p,
                            const IndexMatches& matches, OverlapScores& overlaps, FullRanks full);
  static constexpr std::size_t kCrowd = 64;
  // Crowds translated (a run met for the first time; again after a slot of its shard was handed
  // to another worker, the registered list changed, or it was evicted); each other crowd was
  // found translated already.
  std::uint64_t crowds_translated() const { return crowds_translated_; }
  std::uint64_t crowds_reused() const { return crowds_reused_; }
  // Of those, the ones read elided (CrowdStamps): their slots not copied out of the index.
  std::uint64_t crowds_elided() const { return crowds_elided_; }
  // The holder-set stamps of the crowds kept, ascending, for the next read's IndexRuns: their
  // runs come elided, the crowd's slots not copied out of the index. A stamp evicted before the
  // read's decision costs that decision a second read (its choice the full scan's over that
  // read). Crowds with a tier rank's slot are left out: they are never used.
  void CrowdStamps(std::vector<std::uint64_t>& out) const;
  // PickFromFleet's choices made by classes, without the full scan it falls back to when most
  // ranks differ from an idle one.
  std::uint64_t class_picks() const { return class_picks_; }

  // Full: active prefill tokens above threshold x max_num_batched_tokens (never when the queue is
  // off; at the threshold it is not full).
  bool Full(const Candidate& c) const;
  // The candidates that are not full (all of them when the queue is off).
  std::vector<Candidate> OpenRanks(std::vector<Candidate> cands) const;
  // OK when one more booking of `blocks` blocks fits the booking bounds, else `overloaded`.
  Status BookingRoom(std::size_t blocks) const;
  // Picks among `cands` (non-empty) and, when the request updates states and has an id, books
  // it there (and records the prediction in approximate mode). `overloaded` past the booking
  // bounds, InvalidArgument when the request_id is booked already.
  Result<Decision> Decide(const RouteRequest& req, const PreparedRequest& p, std::span<const Candidate> cands);
  // A disaggregated-eligible request (protocol.md section 13) among open decode and prefill
  // candidates (both non-empty): the local decode rank by the full kv cost, the prefill rank by
  // the kv cost (prefill ranks carry no decode blocks: no decode load), the remote decode rank
  // by the cost without its cache (by load), then the policy's choice between them. A local
  // choice books as Decide does. A disaggregated one books the decode rank with the prompt's
  // blocks and no prefill tokens, and the prefill rank with the prompt's tokens not cached there
  // (ActiveLoad::BookPrefill); in approximate mode both ranks are predicted to hold the prompt.
  // `whole`: the request cannot take two legs (router.generate forwards one): the local
  // choice, whatever the policy. Same errors as Decide.
  Result<DisaggDecision> DecideDisagg(const RouteRequest& req, const PreparedRequest& p,
                                      std::span<const Candidate> decode, std::span<const Candidate> prefill,
                                      bool whole = false);
  // A booked disaggregated request's prefill leg ended (prefill_done): its prefill part is
  // released, its prefill rank's rates learn from the time since it was booked (against the
  // prior of its prefill there), and its transfer is timed from now. False when it had no
  // prefill part. SGLang's legs run at once, so its decode leg's first byte (MarkPrefill) mostly
  // comes first and releases the part: such requests teach neither the rates nor the transfer.
  bool PrefillDone(const std::string& request_id);
  // Its decode leg's first byte (mark_prefill): a transfer timed since PrefillDone teaches
  // KvTransfer; then ActiveLoad::MarkPrefill. False when nothing changed.
  bool MarkPrefill(const std::string& request_id);
  const KvTransfer& transfer() const { return transfer_; }

  // The engine's timing of a booked request, before its free: its rank's rates learn from it
  // (against the prior recorded when it was booked). False when nothing was learned.
  bool Learn(const std::string& request_id, const ResponseTiming& timing);
  // The learned rates of ranks not heard of lately drift toward the fleet's (WorkerRates::Drift).
  void DriftRates(SteadyTime now) { rates_.Drift(now); }
  const WorkerRates& rates() const { return rates_; }

  // The worker left: its bookings, predictions and learned rates go. Returns the bookings released.
  std::size_t ForgetWorker(std::uint64_t worker_id);
  // Only the learned rates of its ranks (a worker registered again as another device), and the
  // priors of its bookings, which ran on the old hardware: they teach the new one nothing.
  void ForgetRates(std::uint64_t worker_id) {
    rates_.RemoveWorker(worker_id);
    load_.DropPriors(worker_id);
    ForgetTransfersOf(worker_id);
  }
  // Prediction expiry (approximate mode), and the transfer timings of requests no longer booked.
  void ExpirePredictions(SteadyTime now);

  ActiveLoad& load() { return load_; }
  const ActiveLoad& load() const { return load_; }
  // Approximate mode's predictions; null outside it.
  const ApproxIndex* predictions() const { return approx_.get(); }

 private:
  // What Candidates reads once per call.
  struct CandidateContext {
    double recent_scale = 0;
    bool no_load = false;
    bool no_rates = false;
    WorkerRates::Rates typical;
  };
  CandidateContext ContextNow() const;
  // Drops the pending transfers whose prefill leg runs on worker_id: their priors were of its
  // old hardware (or it is gone), so its prefill_done teaches nothing.
  void ForgetTransfersOf(std::uint64_t worker_id);
  // What choosing c means for the request, unbooked: its overlaps within the request's blocks.
  static Decision DecisionOf(const Candidate& c, const SelectionRequest& req);
  Candidate CandidateOf(const RankInfo& r, const TieredOverlap& overlap, std::span<const SequenceHash> seq,
                        const CandidateContext& ctx) const;
  // The ranks of one registered list grouped by what an idle rank's price reads of them under
  // any cost (RankClassKeyOf, costs.h): PickFromFleet's table, kept while the list is.
  struct RankClasses {
    std::shared_ptr<const std::vector<RankInfo>> of;
    std::vector<std::vector<std::uint32_t>> members;  // positions in *of, ascending, per class
    std::vector<std::uint32_t> class_of;              // per position
    // Open addressing by rank, with what a pick marks on the ranks it meets (one cache line
    // holds all a pick reads and writes of a rank).
    struct Slot {
      WorkerKey rank;
      std::uint32_t pos1 = 0;  // position + 1 (0: a free slot)
      std::uint32_t cls = 0;
      std::uint32_t seen = 0;     // the pick that last met it
      std::uint32_t special = 0;  // then: its place among the special ranks, or kGrouped
    };
    static constexpr std::uint32_t kGrouped = 0xffffffffu;
    std::vector<Slot> slots;
    std::uint32_t pick = 0;
    static std::uint64_t Hash(WorkerKey rank);
    void Prefetch(std::uint64_t hash) const;
    // The rank's slot (its hash given), or null when it is not there.
    Slot* Find(WorkerKey rank, std::uint64_t hash);
  };
  RankClasses& ClassesOf(const std::shared_ptr<const std::vector<RankInfo>>& ranks);
  // Whether the full scan is cheaper than pricing by classes: most ranks are priced one by one.
  bool FullScanIsCheaper(const PreparedRequest& p, std::size_t ranks) const;

  // A crowd translated: one shard's run of holder slots, its registered ranks' positions in
  // the class table's list, per class, ascending. Valid while the list, the shard's count of
  // slot reuses and the slots are what they were.
  struct Crowd {
    std::size_t shard = 0;
    std::uint64_t slot_reuses = 0;
    std::uint64_t stamp = 0;  // the holder set's version its slots are (0: none)
    std::vector<std::uint32_t> slots;
    bool tiered = false;  // a tier rank's slot among them
    std::vector<std::vector<std::uint32_t>> positions;
    std::uint64_t used = 0;  // the read that last used it
  };
  // A crowd as one request's run meets it: at the run's depth.
  struct CrowdMatch {
    const Crowd* crowd;
    std::uint32_t depth;
  };
  // The crowds of `matches` into `crowds` and every other run translated into `overlaps`;
  // false where the choice must translate every run instead. `met` tells whether any run was
  // the size of a crowd.
  bool ReadCrowds(RankClasses& classes, const IndexMatches& matches, OverlapScores& overlaps,
                  std::vector<CrowdMatch>& crowds, bool& met);
  // The translated crowd of this run of `slots`: found, or translated now (null when a slot was
  // handed to another worker since the read, every kept crowd serves this read already, or the
  // run is elided and its stamp no longer kept).
  const Crowd* CrowdOf(RankClasses& classes, const IndexMatches& matches, std::size_t shard,
                       std::span<const std::uint32_t> slots, const MatchRuns::Run& run);
  // PickFromFleet's choice by classes, with the crowds already read: PickByClassesOf the
  // request's cost.
  FleetChoice PickByClasses(const std::shared_ptr<const std::vector<RankInfo>>& ranks, const PreparedRequest& p,
                            OverlapScores& overlaps, std::span<const CrowdMatch> crowds, FullRanks full);
  template <typename Cost>
  FleetChoice PickByClassesOf(const std::shared_ptr<const std::vector<RankInfo>>& ranks, const PreparedRequest& p,
                              OverlapScores& overlaps, std::span<const CrowdMatch> crowds, FullRanks full);

  const SchedulerOptions options_;
  const ShardedIndex& index_;
  const Clock clock_;
  ActiveLoad load_;
  WorkerRates rates_;
  Selector selector_;
  std::mt19937_64 rng_;
  const std::unique_ptr<ApproxIndex> approx_;
  KvTransfer transfer_;
  // Disaggregated bookings' transfers: the prediction made at booking, and when the prefill leg
  // ended (unset until then). Entries of requests no longer booked go at ExpirePredictions.
  struct PendingTransfer {
    double predicted_ms = 0;
    std::optional<SteadyTime> prefill_done_at;
    WorkerKey prefill_worker;
    PriorTtft prefill_prior;  // its prefill on the prefill rank (no decode there)
    SteadyTime booked_at;
  };
  std::unordered_map<std::string, PendingTransfer> transfers_;
  RankClasses classes_;
  std::uint64_t class_picks_ = 0;
  // Kept crowds: a few prefixes' over every shard (one prefix is a crowd per shard and depth).
  const std::size_t kept_crowds_;
  std::vector<Crowd> crowds_;  // of classes_'s list
  std::uint64_t crowd_reads_ = 0;
  std::uint64_t crowds_translated_ = 0;
  std::uint64_t crowds_reused_ = 0;
  std::uint64_t crowds_elided_ = 0;
};

}  // namespace kvrouter
