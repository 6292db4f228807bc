// MockEngine: a simulated vLLM-like engine for kvmocker and offline replays: a paged KV cache with
// prefix caching and LRU eviction, a FIFO scheduler bounded by max_num_seqs and
// max_num_batched_tokens, docs/design.md's timing model, and the cache changes (KvEventData) that a
// KvEventPublisher (events/worker_publisher.h) numbers, buffers and serves recovery from.
// Thread contract: not thread-safe, no threads, no clock: the owner drives it with virtual time
// through Step(); the sink runs synchronously inside Step() and must not call back into the engine.
//
//   MockEngine e({.block_size = 64}, [&](KvEventData&& d) { Send(publisher.Publish(std::move(d))); });
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <list>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
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
};

// The timing model of docs/design.md, in ms, divided by `speedup`.
// Prefill of N uncached tokens: 4.21e-7 N^2 + 0.0152 N + 16.5.
double MockPrefillMs(double uncached_tokens, double speedup);
// One decode step at KV utilisation u in [0, 1]: max(1, -25.74 u^2 + 54.01 u + 5.74).
double MockDecodeStepMs(double kv_utilization, double speedup);

struct EngineRequest {
  std::string id;
  std::vector<std::uint32_t> tokens;  // the prompt
  std::uint32_t max_tokens = 1;       // tokens to generate; 0 is treated as 1
  std::string lora_name;              // part of the block hashes (docs/protocol.md section 1)
  std::vector<MmItem> mm_items;       // multimodal items, part of their blocks' hashes (section 12)
};

// One per first-token, later token (when asked), finish or rejection moment of a request.
struct EngineOutput {
  // kFirstToken then kFinished (both from the same step when max_tokens <= 1). With
  // EngineOutputs::kEveryToken, each later token gets a kToken (output_tokens 2, 3, ...,
  // max_tokens) between them; the step of the last token reports its kToken, then kFinished.
  // kRejected: the prompt has more full blocks than the whole cache, so it can never be
  // admitted; it is dropped from the queue without touching the cache and gets no other output.
  enum Kind { kFirstToken, kToken, kFinished, kRejected };
  std::string id;
  Kind kind = kFirstToken;
  double at_ms = 0;  // virtual time at the end of the step that produced it
  std::uint32_t prompt_tokens = 0;
  std::uint32_t cached_tokens = 0;  // leading prompt blocks found in the cache * block_size
  std::uint32_t output_tokens = 0;  // generated so far (1 at the first token)
};

// Simplifications: only the prompt's full blocks occupy the cache; generated tokens and the
// trailing partial prompt block take no blocks and are never cached. Prefills are not chunked.
//   MockEngine e(config, sink);  e.Add({.id = "r1", .tokens = prompt, .max_tokens = 16});
//   for (double now = 0; !e.Idle();) now += e.Step(now, outputs);
class MockEngine {
 public:
  // Receives every change of the cache (device tier), in order, synchronously from Step(): a
  // stored chain, removed (evicted) blocks. The data is the sink's. May be empty.
  using EventSink = std::function<void(KvEventData&&)>;

  MockEngine(MockEngineConfig config, EventSink sink);

  // Joins the waiting queue (FIFO). Hashes the prompt now; nothing else happens until Step().
  void Add(EngineRequest request);
  // The request leaves the engine at once, waiting or running (its client went away), and gets
  // no more outputs from later steps. A running request releases its blocks, which stay cached
  // (evictable), as vLLM keeps an aborted request's computed blocks. False when the engine does
  // not hold `id` (unknown, finished or rejected).
  bool Abort(std::string_view id);
  bool Idle() const { return waiting_.empty() && running_.empty(); }

  // Runs one scheduler step starting at now_ms and returns its duration in ms (0 when idle).
  // Every running request decodes one token; then waiting requests are admitted in FIFO order
  // while fewer than max_num_seqs run, their uncached prompt tokens fit the step's budget (the
  // first prefill of a step always fits, however large) and the cache can make room for their
  // new blocks (evicting LRU unreferenced blocks); the first request that does not fit stops
  // admission. Duration = MockPrefillMs(uncached tokens admitted) if any request was admitted
  // + MockDecodeStepMs(Utilization()) if any request decoded. Appends outputs with
  // at_ms = now_ms + duration; finished requests release their blocks at the end of the step.
  double Step(double now_ms, std::vector<EngineOutput>& outputs);

  // Referenced blocks (held by running requests) / num_gpu_blocks: what the decode model sees,
  // like vLLM's kv_cache_usage. Cached unreferenced blocks are free memory and do not count.
  double Utilization() const;
  std::size_t ActiveBlocks() const { return active_blocks_; }  // referenced by running requests
  std::size_t CachedBlocks() const { return blocks_.size(); }  // holding content (active + evictable)
  std::size_t NumWaiting() const { return waiting_.size(); }
  std::size_t NumRunning() const { return running_.size(); }
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
    std::uint32_t refs = 0;                 // running requests holding it; 0 = evictable
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
  };

  // Admits waiting requests (FIFO) within the step's limits; requests too large for the whole
  // cache go to `rejected`. Returns the uncached prompt tokens admitted, or kNoneAdmitted.
  static constexpr std::size_t kNoneAdmitted = ~std::size_t{0};
  std::size_t Admit(std::vector<EngineOutput>& rejected);
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
  std::vector<Running> running_;  // in admission order
  std::unordered_map<SequenceHash, Block> blocks_;
  // Unreferenced blocks, least recently released first. A request releases its blocks last to
  // first, so a block's evictable descendants always precede it: eviction takes leaves first
  // and every cached block's parent stays cached (the published tree has no orphans).
  std::list<SequenceHash> lru_;
  std::size_t active_blocks_ = 0;
  std::span<const std::uint32_t> stored_tokens_;  // set only around the sink call of a stored event
};

}  // namespace kvrouter
