#include "router/engine/mock_engine.h"

#include <algorithm>
#include <cassert>
#include <utility>

#include "router/engine/engine_model.h"

namespace kvrouter {

double MockPrefillMs(double uncached_tokens, double speedup) { return PrefillMs(uncached_tokens) / speedup; }

double MockDecodeStepMs(double kv_utilization, double speedup) { return DecodeStepMs(kv_utilization) / speedup; }

MockEngine::MockEngine(MockEngineConfig config, EventSink sink) : config_(config), sink_(std::move(sink)) {
  assert(config_.block_size > 0);
  assert(config_.speedup_ratio > 0);
  if (config_.max_num_seqs == 0) config_.max_num_seqs = 1;  // else nothing could ever run
}

void MockEngine::Add(EngineRequest request) {
  Waiting w;
  w.local = ComputeLocalHashes(request.tokens, config_.block_size, request.lora_name, request.mm_items);
  w.seq = ComputeSequenceHashes(w.local);
  w.request = std::move(request);
  waiting_.push_back(std::move(w));
}

bool MockEngine::Abort(std::string_view id) {
  const auto waiting =
      std::find_if(waiting_.begin(), waiting_.end(), [&](const Waiting& w) { return w.request.id == id; });
  if (waiting != waiting_.end()) {
    waiting_.erase(waiting);  // nothing of it is in the cache yet
    return true;
  }
  const auto running = std::find_if(running_.begin(), running_.end(), [&](const Running& r) { return r.id == id; });
  if (running == running_.end()) return false;
  ReleaseAll(*running);
  running_.erase(running);
  return true;
}

double MockEngine::Utilization() const {
  if (config_.num_gpu_blocks == 0) return 0;
  return static_cast<double>(active_blocks_) / config_.num_gpu_blocks;
}

std::size_t MockEngine::CachedPrefixBlocks(std::span<const SequenceHash> seq_hashes) const {
  std::size_t n = 0;
  while (n < seq_hashes.size() && blocks_.contains(seq_hashes[n])) ++n;
  return n;
}

std::size_t MockEngine::LeadingHits(const Waiting& w) const { return CachedPrefixBlocks(w.seq); }

std::size_t MockEngine::EvictableAmong(const Waiting& w, std::size_t hits) const {
  std::size_t n = 0;
  for (std::size_t i = 0; i < hits; ++i) n += blocks_.at(w.seq[i]).refs == 0;
  return n;
}

void MockEngine::Reference(SequenceHash seq) {
  Block& b = blocks_.at(seq);
  if (b.refs++ == 0) {
    lru_.erase(b.lru);
    ++active_blocks_;
  }
}

void MockEngine::Release(SequenceHash seq) {
  Block& b = blocks_.at(seq);
  assert(b.refs > 0);
  if (--b.refs == 0) {
    b.lru = lru_.insert(lru_.end(), seq);
    --active_blocks_;
  }
}

void MockEngine::ReleaseAll(const Running& r) {
  for (auto it = r.blocks.rbegin(); it != r.blocks.rend(); ++it) Release(*it);
}

void MockEngine::Allocate(const Waiting& w, std::size_t hits) {
  for (std::size_t i = 0; i < hits; ++i) Reference(w.seq[i]);
  const std::size_t fresh = w.seq.size() - hits;
  if (fresh == 0) return;

  // Make room: evict least recently released blocks. The caller checked that enough exist.
  KvRemoved removed;
  while (blocks_.size() + fresh > config_.num_gpu_blocks) {
    assert(!lru_.empty());
    const SequenceHash victim = lru_.front();
    lru_.pop_front();
    blocks_.erase(victim);
    removed.block_hashes.push_back(victim);
  }
  if (!removed.block_hashes.empty()) Publish(std::move(removed));

  KvStored stored;
  if (hits > 0) stored.parent_hash = w.seq[hits - 1];
  stored.blocks.reserve(fresh);
  for (std::size_t i = hits; i < w.seq.size(); ++i) {
    // A miss's descendants are misses too (a cached block's parent is always cached), so every
    // block from the first miss on is new.
    auto [it, inserted] = blocks_.try_emplace(w.seq[i]);
    assert(inserted);
    (void)inserted;
    it->second.local = w.local[i];
    if (i > 0) it->second.parent = w.seq[i - 1];
    it->second.refs = 1;
    ++active_blocks_;
    stored.blocks.push_back({w.seq[i], w.local[i]});
  }
  const std::size_t bs = config_.block_size;
  stored_tokens_ = std::span<const std::uint32_t>(w.request.tokens).subspan(hits * bs, fresh * bs);
  Publish(std::move(stored));
  stored_tokens_ = {};
}

void MockEngine::Publish(KvEventData data) {
  if (sink_) sink_(std::move(data));
}

std::size_t MockEngine::Admit(std::vector<EngineOutput>& rejected) {
  const std::size_t budget = config_.max_num_batched_tokens;
  std::size_t prefill_tokens = 0;
  bool admitted_any = false;
  while (!waiting_.empty() && running_.size() < config_.max_num_seqs) {
    Waiting& w = waiting_.front();
    const auto prompt = static_cast<std::uint32_t>(w.request.tokens.size());
    if (w.seq.size() > config_.num_gpu_blocks) {
      rejected.push_back({.id = std::move(w.request.id), .kind = EngineOutput::kRejected, .prompt_tokens = prompt});
      waiting_.pop_front();
      continue;
    }
    const std::size_t hits = LeadingHits(w);
    const auto cached = static_cast<std::uint32_t>(hits * config_.block_size);
    const std::size_t uncached = prompt - cached;
    if (admitted_any && prefill_tokens + uncached > budget) break;
    const std::size_t fresh = w.seq.size() - hits;
    const std::size_t room = (config_.num_gpu_blocks - blocks_.size()) + lru_.size() - EvictableAmong(w, hits);
    if (fresh > room) break;  // waits until running requests release blocks

    Allocate(w, hits);
    Running r{.id = std::move(w.request.id),
              .prompt_tokens = prompt,
              .cached_tokens = cached,
              .max_tokens = std::max<std::uint32_t>(w.request.max_tokens, 1),
              .blocks = std::move(w.seq)};
    running_.push_back(std::move(r));
    waiting_.pop_front();
    prefill_tokens += uncached;
    admitted_any = true;
  }
  return admitted_any ? prefill_tokens : kNoneAdmitted;
}

double MockEngine::Step(double now_ms, std::vector<EngineOutput>& outputs) {
  if (Idle()) return 0;
  const std::size_t decoding = running_.size();  // everything already running decodes
  std::vector<EngineOutput> rejected;
  const std::size_t prefill_tokens = Admit(rejected);  // FIFO

  double duration = 0;
  if (prefill_tokens != kNoneAdmitted)
    duration += MockPrefillMs(static_cast<double>(prefill_tokens), config_.speedup_ratio);
  if (decoding > 0) duration += MockDecodeStepMs(Utilization(), config_.speedup_ratio);
  const double at = now_ms + duration;

  for (EngineOutput& o : rejected) {
    o.at_ms = at;
    outputs.push_back(std::move(o));
  }
  auto output = [&](const Running& r, EngineOutput::Kind kind) {
    outputs.push_back({.id = r.id,
                       .kind = kind,
                       .at_ms = at,
                       .prompt_tokens = r.prompt_tokens,
                       .cached_tokens = r.cached_tokens,
                       .output_tokens = r.output_tokens});
  };
  const bool every_token = config_.outputs == EngineOutputs::kEveryToken;
  for (std::size_t i = 0; i < running_.size(); ++i) {
    Running& r = running_[i];
    ++r.output_tokens;
    if (i >= decoding) {
      output(r, EngineOutput::kFirstToken);
    } else if (every_token) {
      output(r, EngineOutput::kToken);
    }
    if (r.output_tokens >= r.max_tokens) output(r, EngineOutput::kFinished);
  }
  // Finished requests release their blocks last to first (see lru_), in admission order.
  std::erase_if(running_, [&](Running& r) {
    if (r.output_tokens < r.max_tokens) return false;
    ReleaseAll(r);
    return true;
  });
  return duration;
}

}  // namespace kvrouter
