// MockEngine: a simulated vLLM-like engine for kvmocker and offline replays: a paged KV cache with
// prefix caching and LRU eviction, a FIFO scheduler bounded by max_num_seqs and
// max_num_batched_tokens (prompts prefilled whole, or in chunks as vLLM V1 does), docs/design.md's
// timing model, the legs of disaggregated serving (protocol.md section 13: pinned prefill blocks,
// KV pulls), and the cache changes (KvEventData) that a KvEventPublisher
// (events/worker_publisher.h) numbers, buffers and serves recovery from.
// Thread contract: not thread-safe, no threads, no clock: the owner drives it with virtual time
// through Step() (see "Timers" below); the sink runs synchronously inside Step() and must not call
// back into the engine.
//
//   MockEngine e({.block_size = 64}, [&](KvEventData&& d) { Send(publisher.Publish(std::move(d))); });
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "events/block_hash.h"
#include "events/kv_event.h"

namespace kvrouter {

// Which outputs Step() reports for a request that runs (EngineOutput::Kind).
enum class EngineOutputs {
  kFirstAndFinish,  // kFirstToken and kFinished only: offline replays need no more
  kEveryToken,      // also kToken for every later token, for a front that streams them
};

struct MockEngineConfig {
  std::uint32_t num_gpu_blocks = 16384;                    // KV cache capacity in blocks
  std::uint32_t block_size = 64;                           // tokens per block (> 0)
  std::uint32_t max_num_seqs = 256;                        // running requests at most
  std::uint32_t max_num_batched_tokens = 8192;             // uncached prompt tokens prefilled per step
  double speedup_ratio = 1.0;                              // divides every duration (> 0)
  EngineOutputs outputs = EngineOutputs::kFirstAndFinish;  // kToken outputs only when asked
  // vLLM V1's chunked prefill: max_num_batched_tokens is the step's whole token budget, decode
  // tokens first, and a prompt larger than what is left is prefilled over several steps (see
  // Step). Off (the default): a step prefills each prompt it admits whole.
  bool chunked_prefill = false;
  // Disaggregated serving (docs/protocol.md section 13, "kvmocker's roles").
  std::uint64_t kv_bytes_per_token = 131072;  // KV bytes of one token (all layers, K and V)
  double kv_transfer_gbps = 400;              // Gbit/s a decode leg pulls KV at (> 0)
  // How long a finished prefill leg's blocks stay pinned for their pull, in ms of virtual time
  // (divided by speedup_ratio like every duration; vLLM's kv_lease_duration is wall time).
  std::uint32_t kv_lease_ms = 30000;
};

// The timing model of docs/design.md, in ms, divided by `speedup`.
// Prefill of N uncached tokens: 4.21e-7 N^2 + 0.0152 N + 16.5.
double MockPrefillMs(double uncached_tokens, double speedup);
// One decode step at KV utilisation u in [0, 1]: max(1, -25.74 u^2 + 54.01 u + 5.74).
double MockDecodeStepMs(double kv_utilization, double speedup);

// The KV pull of `blocks` blocks in ms, divided by config.speedup_ratio: blocks * block_size *
// kv_bytes_per_token * 8 bits / (kv_transfer_gbps * 1e9 bit/s), converted to ms.
double MockKvTransferMs(std::size_t blocks, const MockEngineConfig& config);

// Which part of a request an engine runs (docs/protocol.md section 13).
enum class EngineLeg : std::uint8_t {
  kWhole,    // prefill and decode here (an aggregated engine, or a local prefill)
  kPrefill,  // prefill and one token; the prompt's blocks stay pinned for the decode engine's pull
  kDecode,   // pull the prompt's KV (EngineRequest::transfer) instead of prefilling, then decode
};

// What a decode leg pulls: the prefill engine's request and the blocks it pinned for it. (The
// router's price of a transfer is KvTransfer, router/scheduling/cost_disagg.h.)
struct KvPull {
  std::uint64_t source_worker_id = 0;
  std::string source_request_id;
  // The prompt's full blocks' sequence hashes as the prefill engine computed them. The decode
  // engine's own hashes of the prompt must equal them, else the transfer is invalid.
  std::vector<SequenceHash> blocks;
};

struct EngineRequest {
  std::string id;
  std::vector<std::uint32_t> tokens;  // the prompt
  std::uint32_t max_tokens = 1;       // tokens to generate; 0 is treated as 1 (a kPrefill leg: 1)
  std::string lora_name;              // part of the block hashes (docs/protocol.md section 1)
  std::vector<MmItem> mm_items;       // multimodal items, part of their blocks' hashes (section 12)
  EngineLeg leg = EngineLeg::kWhole;
  // kDecode only. Missing, or blocks unequal to the engine's hashes of the prompt: the leg runs
  // as kWhole (a local prefill, as vLLM does) and local_prefills_on_invalid_transfer() counts it.
  std::optional<KvPull> transfer;
};

// One per first-token, later token (when asked), finish or rejection moment of a request.
struct EngineOutput {
  // kFirstToken then kFinished (both from the same step when max_tokens <= 1). With
  // EngineOutputs::kEveryToken, each later token gets a kToken (output_tokens 2, 3, ...,
  // max_tokens) between them; the step of the last token reports its kToken, then kFinished.
  // kRejected: the prompt has more full blocks than the whole cache, so it can never be
  // admitted; it is dropped from the queue without touching the cache and gets no other output.
  // kPulled: a kDecode leg's KV transfer ended (at_ms: its end, which may precede the step that
  // reports it); the owner tells the prefill engine (MockEngine::ReleasePinned). Its tokens follow
  // as any request's, kFirstToken from the first step that starts at or after at_ms.
  enum Kind { kFirstToken, kToken, kFinished, kRejected, kPulled };
  std::string id;
  Kind kind = kFirstToken;
  double at_ms = 0;  // virtual time at the end of the step that produced it
  std::uint32_t prompt_tokens = 0;
  std::uint32_t cached_tokens = 0;  // leading prompt blocks found in the cache * block_size
  std::uint32_t output_tokens = 0;  // generated so far (1 at the first token)
};

// Simplifications: only the prompt's full blocks occupy the cache; generated tokens and the
// trailing partial prompt block take no blocks and are never cached. Without chunked_prefill, a
// step that admits a prefill lasts the whole prefill plus the decode step of every request
// already running, which all wait for it; with it, each step carries at most a budget's worth
// of prefill (docs/design.md compares both with vLLM's chunked prefill).
//
// Timers: a decode leg's transfer end and a prefill leg's lease end. Step(now) first fires every
// timer at or before now. The contract that keeps owners from spinning: when Step(now) returns 0
// and the engine is not Idle(), nothing changes until NextTimerMs() (then > now) or the owner's
// next Add, Abort or ReleasePinned; step again at the earliest of those. Outputs of a step whose
// duration is 0 (kPulled, kRejected) are due at once.
//   MockEngine e(config, sink);  e.Add({.id = "r1", .tokens = prompt, .max_tokens = 16});
//   for (double now = 0; !e.Idle();) {
//     if (const double d = e.Step(now, outputs); d > 0) now += d;
//     else if (auto t = e.NextTimerMs()) now = *t;  // else Idle(): the loop ends
//   }
class MockEngine {
 public:
  // Receives every change of the cache (device tier), in order, synchronously from Step(): a
  // stored chain, removed (evicted) blocks. The data is the sink's. May be empty.
  using EventSink = std::function<void(KvEventData&&)>;

  MockEngine(MockEngineConfig config, EventSink sink);

  // Joins the waiting queue (FIFO). Hashes the prompt (and checks a decode leg's transfer) now;
  // nothing else happens until Step().
  void Add(EngineRequest request);
  // The request leaves the engine at once, waiting, in transfer or running (its client went
  // away), and gets no more outputs from later steps. A running request or one in transfer
  // releases its blocks, which stay cached (evictable), as vLLM keeps an aborted request's
  // computed blocks. False when the engine does not hold `id` (unknown, finished or rejected; a
  // finished prefill leg's pin is ReleasePinned's).
  bool Abort(std::string_view id);
  // The decode engine pulled the blocks prefill leg `id` pinned: they become evictable (and stay
  // cached). False when nothing is pinned for `id` (not a prefill leg, still running, released,
  // lease ended, or a prompt without a full block, which pins nothing). A prefill leg finishing
  // under the id of a pin still held replaces that pin.
  bool ReleasePinned(std::string_view id);
  // Nothing waiting, in transfer, running or pinned: no Step is needed until the next Add.
  bool Idle() const { return waiting_.empty() && running_.empty() && transfers_.empty() && pins_.empty(); }
  // The earliest timer (a transfer's or a lease's end) not yet fired, in virtual ms.
  std::optional<double> NextTimerMs() const;

  // Runs one scheduler step starting at now_ms and returns its duration in ms (0 when nothing
  // computes). First every timer at or before now_ms fires: a lease's blocks become evictable, a
  // transfer's request joins the running batch (kPulled). Every running request decodes one
  // token; then waiting requests are admitted in FIFO order while fewer than max_num_seqs run
  // or transfer, their uncached prompt tokens fit the step's budget (the first prefill of a step
  // always fits, however large) and the cache can make room for their new blocks (evicting LRU
  // unreferenced blocks); the first request that does not fit stops admission. A decode leg with
  // a valid transfer takes no budget: it references its cached prefix, allocates (and publishes
  // stored for) the blocks it lacks and waits MockKvTransferMs(lacking blocks) before it joins
  // the running batch (at once when it lacks none: it decodes in this step). vLLM publishes
  // received blocks when they arrive; here they are published at admission, so a chain's parent
  // is always published before its children, and a request sharing them meanwhile hits them.
  // Duration = MockPrefillMs(uncached tokens admitted) if any prefill was admitted
  // + MockDecodeStepMs(Utilization()) if any request decoded. Appends outputs with
  // at_ms = now_ms + duration; finished requests release their blocks at the end of the step, a
  // prefill leg's stay pinned until ReleasePinned or kv_lease_ms after its finish.
  //
  // With chunked_prefill (vLLM V1's scheduler), the step has a budget of max_num_batched_tokens
  // tokens. Every running request past its prefill decodes one token and takes one of them (all
  // decode even past the budget, which then floors at 0); then requests still prefilling take, in
  // admission order, as many of their remaining uncached tokens as the budget leaves; then waiting
  // requests are admitted as above while budget is left (their blocks allocated and their cached
  // prefix counted at admission), each taking what it needs of the rest. A request prefilling
  // uncached tokens [a, b) of its prompt in this step costs PrefillChunkMs(a, b) (engine_model.h);
  // a request's first token comes at the end of the step that prefills its last token, a fully
  // cached prompt's in its admission step, and only then does it decode. A decode leg admitted
  // with a valid transfer takes no budget, as above. Duration = (sum of the chunks' costs
  // + the step overhead if any prefill ran) / speedup_ratio + MockDecodeStepMs(Utilization()) if
  // any request decoded; one prompt prefilled whole in a step costs MockPrefillMs as above.
  double Step(double now_ms, std::vector<EngineOutput>& outputs);
  // The later (non-first) tokens the last Step() produced, one per running request past its
  // first token: the kToken outputs it reports with kEveryToken, whatever the outputs setting.
  // Each such token's gap since its request's previous token is that step's duration when steps
  // run back to back. 0 before the first step.
  std::size_t last_step_tokens() const { return last_step_tokens_; }

  // Referenced blocks (held by running requests, transfers and pins) / num_gpu_blocks: what the
  // decode model sees, like vLLM's kv_cache_usage. Cached unreferenced blocks are free memory and
  // do not count.
  double Utilization() const;
  std::size_t ActiveBlocks() const { return active_blocks_; }  // referenced (running, transfers, pins)
  std::size_t CachedBlocks() const { return blocks_.size(); }  // holding content (active + evictable)
  std::size_t NumWaiting() const { return waiting_.size(); }
  std::size_t NumRunning() const { return running_.size(); }
  std::size_t NumTransferring() const { return transfers_.size(); }  // decode legs pulling KV
  // Distinct blocks pinned by finished prefill legs now: a block two legs pin counts once
  // (kvmocker_pinned_blocks).
  std::size_t PinnedBlocks() const { return pinned_blocks_; }
  // The blocks prefill leg `id` pinned (its prompt's full blocks' sequence hashes, what a decode
  // leg's KvPull::blocks names); empty when nothing is pinned for it. Valid until the next
  // non-const call.
  std::span<const SequenceHash> PinnedBlocksOf(std::string_view id) const;
  // Decode legs run as local prefills because their transfer was missing or did not match.
  std::uint64_t local_prefills_on_invalid_transfer() const { return local_prefills_on_invalid_transfer_; }
  // Leading blocks of a sequence (its sequence hashes, docs/protocol.md section 1) in the cache.
  std::size_t CachedPrefixBlocks(std::span<const SequenceHash> seq_hashes) const;

  // Inside the sink, while it receives a stored event: the prompt tokens of the chain's blocks
  // (block k holds [k * block_size, (k + 1) * block_size)), for publishers whose wire format
  // carries tokens (vLLM BlockStored). Empty for other events and outside the sink; the view
  // ends when the sink returns.
  std::span<const std::uint32_t> stored_tokens() const { return stored_tokens_; }

 private:
  struct Block {
    LocalHash local = 0;
    std::optional<SequenceHash> parent;     // nullopt for a sequence's first block
    std::uint32_t refs = 0;                 // running requests, transfers, pins holding it; 0 = evictable
    std::uint32_t pins = 0;                 // of those, prefill legs' pins
    std::list<SequenceHash>::iterator lru;  // position in lru_, valid while refs == 0
  };
  struct Waiting {
    EngineRequest request;
    std::vector<LocalHash> local;
    std::vector<SequenceHash> seq;
  };
  struct Running {
    std::string id;
    std::uint32_t prompt_tokens = 0;
    std::uint32_t cached_tokens = 0;
    std::uint32_t max_tokens = 1;
    std::uint32_t output_tokens = 0;
    std::vector<SequenceHash> blocks;  // the prompt's full blocks, all referenced
    EngineLeg leg = EngineLeg::kWhole;
    // Uncached prompt tokens prefilled so far and still to prefill (chunked_prefill only; without
    // it a request is prefilled whole at admission). It decodes once prefill_left is 0.
    std::uint32_t prefilled = 0;
    std::uint32_t prefill_left = 0;
  };
  // A decode leg pulling the KV it lacks; joins running_ at end_ms.
  struct Transfer {
    Running request;
    double end_ms = 0;
  };
  // A finished prefill leg's blocks, referenced until the pull or the lease's end.
  struct PinnedLeg {
    std::vector<SequenceHash> blocks;
    double lease_end_ms = 0;
  };
  // The prefill work of one step, or of one Admit call.
  struct Prefills {
    bool prefill = false;             // a prefill ran (even of 0 uncached tokens)
    std::size_t prefill_tokens = 0;   // uncached prompt tokens prefilled
    double chunk_ms = 0;              // chunked_prefill: the chunks' PrefillChunkMs, summed
    std::size_t joined_decoders = 0;  // decode legs that lacked no block: they decode this step
  };

  // Admits waiting requests (FIFO) within the step's limits: `budget` uncached tokens (without
  // chunked_prefill, the first prefill may exceed it); requests too large for the whole cache go
  // to `outputs` as kRejected, transfers that end at once as kPulled.
  Prefills Admit(double now_ms, std::size_t budget, std::vector<EngineOutput>& outputs);
  // chunked_prefill: the chunks of the requests still prefilling, in admission order, within
  // `budget` uncached tokens, which it lowers by what they take.
  Prefills ContinuePrefills(std::size_t& budget);
  // Fires the leases and transfers that end at or before now_ms.
  void FireTimers(double now_ms, std::vector<EngineOutput>& outputs);
  void Pin(std::string id, std::vector<SequenceHash> blocks, double finished_ms);
  void Unpin(const PinnedLeg& pin);
  std::size_t LeadingHits(const Waiting& w) const;
  // Evictable blocks among the first `hits` (they stop being evictable once referenced).
  std::size_t EvictableAmong(const Waiting& w, std::size_t hits) const;
  void Reference(SequenceHash seq);
  void Release(SequenceHash seq);
  // Releases a leaving running request's blocks last to first (see lru_).
  void ReleaseAll(const Running& r);
  // References the hits, evicts for and inserts the new blocks, publishes removed + stored.
  void Allocate(const Waiting& w, std::size_t hits);
  void Publish(KvEventData data);

  MockEngineConfig config_;
  EventSink sink_;
  std::deque<Waiting> waiting_;
  std::vector<Running> running_;     // in admission order
  std::vector<Transfer> transfers_;  // in admission order
  std::unordered_map<std::string, PinnedLeg> pins_;
  std::set<std::pair<double, std::string>> lease_ends_;  // (lease_end_ms, id) of every pin
  std::size_t pinned_blocks_ = 0;                        // blocks with pins > 0
  std::uint64_t local_prefills_on_invalid_transfer_ = 0;
  std::unordered_map<SequenceHash, Block> blocks_;
  // Unreferenced blocks, least recently released first. A request releases its blocks last to
  // first, so a block's evictable descendants always precede it: eviction takes leaves first
  // and every cached block's parent stays cached (the published tree has no orphans).
  std::list<SequenceHash> lru_;
  std::size_t active_blocks_ = 0;
  std::size_t last_step_tokens_ = 0;
  std::span<const std::uint32_t> stored_tokens_;  // set only around the sink call of a stored event
};

}  // namespace kvrouter
