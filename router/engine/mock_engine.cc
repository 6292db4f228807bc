#include "router/engine/mock_engine.h"

#include <algorithm>
#include <cassert>
#include <utility>

#include "router/engine/engine_model.h"

namespace kvrouter {

double MockPrefillMs(double uncached_tokens, double speedup) { return PrefillMs(uncached_tokens) / speedup; }

double MockDecodeStepMs(double kv_utilization, double speedup) { return DecodeStepMs(kv_utilization) / speedup; }

double MockKvTransferMs(std::size_t blocks, const MockEngineConfig& config) {
  const double bits =
      static_cast<double>(blocks) * config.block_size * static_cast<double>(config.kv_bytes_per_token) * 8;
  return bits / (config.kv_transfer_gbps * 1e9) * 1000 / config.speedup_ratio;
}

MockEngine::MockEngine(MockEngineConfig config, EventSink sink) : config_(config), sink_(std::move(sink)) {
  assert(config_.block_size > 0);
  assert(config_.speedup_ratio > 0);
  assert(config_.kv_transfer_gbps > 0);
  if (config_.max_num_seqs == 0) config_.max_num_seqs = 1;  // else nothing could ever run
  // A chunked step never exceeds its budget: without one token of it nothing would prefill.
  if (config_.chunked_prefill && config_.max_num_batched_tokens == 0) config_.max_num_batched_tokens = 1;
}

void MockEngine::Add(EngineRequest request) {
  Waiting w;
  w.local = ComputeLocalHashes(request.tokens, config_.block_size, request.lora_name, request.mm_items);
  w.seq = ComputeSequenceHashes(w.local);
  if (request.leg == EngineLeg::kPrefill) request.max_tokens = 1;
  if (request.leg == EngineLeg::kDecode && (!request.transfer || request.transfer->blocks != w.seq)) {
    // vLLM's NixlConnector prefills locally when the transfer parameters do not hold.
    request.leg = EngineLeg::kWhole;
    ++local_prefills_on_invalid_transfer_;
  }
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
  if (running != running_.end()) {
    ReleaseAll(*running);
    running_.erase(running);
    return true;
  }
  const auto transfer =
      std::find_if(transfers_.begin(), transfers_.end(), [&](const Transfer& t) { return t.request.id == id; });
  if (transfer == transfers_.end()) return false;
  ReleaseAll(transfer->request);
  transfers_.erase(transfer);
  return true;
}

bool MockEngine::ReleasePinned(std::string_view id) {
  const auto it = pins_.find(std::string(id));
  if (it == pins_.end()) return false;
  Unpin(it->second);
  lease_ends_.erase({it->second.lease_end_ms, it->first});
  pins_.erase(it);
  return true;
}

std::span<const SequenceHash> MockEngine::PinnedBlocksOf(std::string_view id) const {
  const auto it = pins_.find(std::string(id));
  if (it == pins_.end()) return {};
  return it->second.blocks;
}

std::optional<double> MockEngine::NextTimerMs() const {
  std::optional<double> next;
  if (!lease_ends_.empty()) next = lease_ends_.begin()->first;
  for (const Transfer& t : transfers_) {
    if (!next || t.end_ms < *next) next = t.end_ms;
  }
  return next;
}

void MockEngine::Pin(std::string id, std::vector<SequenceHash> blocks, double finished_ms) {
  if (blocks.empty()) return;  // nothing for a pull to wait for
  for (const SequenceHash seq : blocks) pinned_blocks_ += blocks_.at(seq).pins++ == 0;
  if (auto old = pins_.find(id); old != pins_.end()) {
    Unpin(old->second);  // after the new pins: shared blocks stay referenced throughout
    lease_ends_.erase({old->second.lease_end_ms, id});
    pins_.erase(old);
  }
  const double lease_end = finished_ms + config_.kv_lease_ms / config_.speedup_ratio;
  lease_ends_.emplace(lease_end, id);
  pins_.emplace(std::move(id), PinnedLeg{.blocks = std::move(blocks), .lease_end_ms = lease_end});
}

void MockEngine::Unpin(const PinnedLeg& pin) {
  // Last to first, as a finishing request releases (see lru_).
  for (auto it = pin.blocks.rbegin(); it != pin.blocks.rend(); ++it) {
    pinned_blocks_ -= --blocks_.at(*it).pins == 0;
    Release(*it);
  }
}

void MockEngine::FireTimers(double now_ms, std::vector<EngineOutput>& outputs) {
  while (!lease_ends_.empty() && lease_ends_.begin()->first <= now_ms) {
    const auto pin = pins_.find(lease_ends_.begin()->second);
    assert(pin != pins_.end());
    Unpin(pin->second);
    pins_.erase(pin);
    lease_ends_.erase(lease_ends_.begin());
  }
  // Ended transfers join the running batch in the order they ended (then of admission).
  std::vector<Transfer> ended;
  std::erase_if(transfers_, [&](Transfer& t) {
    if (t.end_ms > now_ms) return false;
    ended.push_back(std::move(t));
    return true;
  });
  std::stable_sort(ended.begin(), ended.end(),
                   [](const Transfer& a, const Transfer& b) { return a.end_ms < b.end_ms; });
  for (Transfer& t : ended) {
    const Running& r = t.request;
    outputs.push_back({.id = r.id,
                       .kind = EngineOutput::kPulled,
                       .at_ms = t.end_ms,
                       .prompt_tokens = r.prompt_tokens,
                       .cached_tokens = r.cached_tokens});
    running_.push_back(std::move(t.request));
  }
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

MockEngine::Prefills MockEngine::ContinuePrefills(std::size_t& budget) {
  Prefills p;
  for (Running& r : running_) {
    if (budget == 0) break;
    if (r.prefill_left == 0) continue;
    const auto chunk = static_cast<std::uint32_t>(std::min<std::size_t>(r.prefill_left, budget));
    p.chunk_ms += PrefillChunkMs(r.prefilled, r.prefilled + chunk);
    r.prefilled += chunk;
    r.prefill_left -= chunk;
    budget -= chunk;
    p.prefill = true;
    p.prefill_tokens += chunk;
  }
  return p;
}

MockEngine::Prefills MockEngine::Admit(double now_ms, std::size_t budget, std::vector<EngineOutput>& outputs) {
  const bool chunked = config_.chunked_prefill;
  Prefills a;
  // A decode leg in transfer holds its max_num_seqs slot: it joins the batch when the pull ends.
  while (!waiting_.empty() && running_.size() + transfers_.size() < config_.max_num_seqs) {
    Waiting& w = waiting_.front();
    const auto prompt = static_cast<std::uint32_t>(w.request.tokens.size());
    if (w.seq.size() > config_.num_gpu_blocks) {
      outputs.push_back({.id = std::move(w.request.id), .kind = EngineOutput::kRejected, .prompt_tokens = prompt});
      waiting_.pop_front();
      continue;
    }
    const bool pull = w.request.leg == EngineLeg::kDecode;  // Add checked its transfer
    const std::size_t hits = LeadingHits(w);
    const auto cached = static_cast<std::uint32_t>(hits * config_.block_size);
    const std::size_t uncached = pull ? 0 : prompt - cached;  // a pull computes nothing
    if (!pull && (chunked ? a.prefill_tokens >= budget : a.prefill && a.prefill_tokens + uncached > budget)) break;
    const std::size_t fresh = w.seq.size() - hits;
    const std::size_t room = (config_.num_gpu_blocks - blocks_.size()) + lru_.size() - EvictableAmong(w, hits);
    if (fresh > room) break;  // waits until running requests release blocks

    Allocate(w, hits);  // a pull's received blocks are cached and published as vLLM does
    Running r{.id = std::move(w.request.id),
              .prompt_tokens = prompt,
              .cached_tokens = cached,
              .max_tokens = std::max<std::uint32_t>(w.request.max_tokens, 1),
              .blocks = std::move(w.seq),
              .leg = w.request.leg};
    waiting_.pop_front();
    if (!pull) {
      // Chunked, it takes what is left of the budget (> 0 here) and prefills the rest later.
      const std::size_t chunk = chunked ? std::min(uncached, budget - a.prefill_tokens) : uncached;
      if (chunked) a.chunk_ms += PrefillChunkMs(0, static_cast<double>(chunk));
      r.prefilled = static_cast<std::uint32_t>(chunk);
      r.prefill_left = static_cast<std::uint32_t>(uncached - chunk);
      running_.push_back(std::move(r));
      a.prefill = true;
      a.prefill_tokens += chunk;
    } else if (fresh > 0) {
      transfers_.push_back({.request = std::move(r), .end_ms = now_ms + MockKvTransferMs(fresh, config_)});
    } else {  // holds every block already: nothing to pull, it decodes in this step
      outputs.push_back({.id = r.id,
                         .kind = EngineOutput::kPulled,
                         .at_ms = now_ms,
                         .prompt_tokens = r.prompt_tokens,
                         .cached_tokens = r.cached_tokens});
      running_.push_back(std::move(r));
      ++a.joined_decoders;
    }
  }
  return a;
}

double MockEngine::Step(double now_ms, std::vector<EngineOutput>& outputs) {
  last_step_tokens_ = 0;
  FireTimers(now_ms, outputs);
  if (waiting_.empty() && running_.empty()) return 0;
  const std::size_t first_admission_output = outputs.size();
  // Requests past their prefill when the step starts: all of them decode.
  const auto decoders_before = static_cast<std::size_t>(
      std::count_if(running_.begin(), running_.end(), [](const Running& r) { return r.prefill_left == 0; }));
  std::size_t budget = config_.max_num_batched_tokens;
  double prefill_ms = 0;
  bool prefill = false;
  std::size_t decoding = decoders_before;
  if (config_.chunked_prefill) {
    budget -= std::min(budget, decoders_before);  // decode tokens take the budget first
    const Prefills continued = ContinuePrefills(budget);
    const Prefills admitted = Admit(now_ms, budget, outputs);  // FIFO
    prefill = continued.prefill || admitted.prefill;
    if (prefill) prefill_ms = (continued.chunk_ms + admitted.chunk_ms + kStepOverheadMs) / config_.speedup_ratio;
    decoding += admitted.joined_decoders;
  } else {
    // A step that carries a prefill lasts it whole: every request decoding here waits for it.
    const Prefills admitted = Admit(now_ms, budget, outputs);  // FIFO
    prefill = admitted.prefill;
    if (prefill) prefill_ms = MockPrefillMs(static_cast<double>(admitted.prefill_tokens), config_.speedup_ratio);
    decoding += admitted.joined_decoders;
  }

  double duration = prefill_ms;
  if (decoding > 0) duration += MockDecodeStepMs(Utilization(), config_.speedup_ratio);
  const double at = now_ms + duration;

  for (std::size_t i = first_admission_output; i < outputs.size(); ++i) {
    if (outputs[i].kind == EngineOutput::kRejected) outputs[i].at_ms = at;
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
  for (Running& r : running_) {
    if (r.prefill_left > 0) continue;  // chunked: its first token waits for its last chunk
    ++r.output_tokens;
    last_step_tokens_ += r.output_tokens > 1;
    if (r.output_tokens == 1) {
      output(r, EngineOutput::kFirstToken);
    } else if (every_token) {
      output(r, EngineOutput::kToken);
    }
    if (r.output_tokens >= r.max_tokens) output(r, EngineOutput::kFinished);
  }
  // Finished requests release their blocks last to first (see lru_), in admission order; a
  // prefill leg's stay pinned for the pull.
  std::erase_if(running_, [&](Running& r) {
    if (r.output_tokens < r.max_tokens) return false;
    if (r.leg == EngineLeg::kPrefill) {
      Pin(std::move(r.id), std::move(r.blocks), at);
    } else {
      ReleaseAll(r);
    }
    return true;
  });
  return duration;
}

}  // namespace kvrouter
