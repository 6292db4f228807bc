// Block hashing of docs/protocol.md section 1: local block hashes (XXH3-64, seed 1337, LoRA-adjusted
// seed) and sequence hashes that identify a whole prefix. Pure functions, thread-safe.
//
//   auto local = ComputeLocalHashes(tokens, 64, lora_name);
//   auto seq = ComputeSequenceHashes(local);
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace kvrouter {

using LocalHash = std::uint64_t;     // XXH3 of one block's tokens ("tokens_hash")
using SequenceHash = std::uint64_t;  // identifies the prefix ending at a block
using BlockHash = std::uint64_t;     // an engine's opaque block id ("block_hash")

inline constexpr std::uint64_t kBlockHashSeed = 1337;

// Seed for local hashes: 1337, plus XXH3-64(lora_name, seed 0) when lora_name is non-empty.
std::uint64_t LoraSeed(std::string_view lora_name);

// Local hash of one block of tokens (hashed as little-endian u32 bytes) with the given seed.
LocalHash HashBlockTokens(std::span<const std::uint32_t> block_tokens, std::uint64_t seed);

// Local hashes of every full block of `tokens`; a trailing partial block is not hashed.
// block_size must be > 0.
std::vector<LocalHash> ComputeLocalHashes(std::span<const std::uint32_t> tokens, std::uint32_t block_size,
                                          std::string_view lora_name = {});

// A multimodal item of a prompt (docs/protocol.md section 12): its hash and the token positions
// [offset, offset + length) its placeholder tokens take.
struct MmItem {
  std::uint64_t hash = 0;
  std::uint32_t offset = 0;
  std::uint32_t length = 0;
  bool operator==(const MmItem&) const = default;
};

// An item identifier as a hash: 64 hex digits (vLLM's) -> the u64 of its first 16; any other
// string -> XXH3-64 of its bytes, seed 0.
std::uint64_t MmItemHash(std::string_view identifier);

// Local hash of one block with the distinct hashes of the items overlapping it: XXH3-64 over the
// block's tokens as LE u32 followed by those hashes, sorted ascending, as LE u64 (the seed as for
// the tokens alone). Without items it is HashBlockTokens.
LocalHash HashBlockWithItems(std::span<const std::uint32_t> block_tokens, std::span<const std::uint64_t> item_hashes,
                             std::uint64_t seed);

// ComputeLocalHashes with multimodal items: an item belongs to every block its range overlaps.
// Items that overlap no full block change nothing.
std::vector<LocalHash> ComputeLocalHashes(std::span<const std::uint32_t> tokens, std::uint32_t block_size,
                                          std::string_view lora_name, std::span<const MmItem> items);

// seq[0] = local[0]; seq[i] = XXH3-64(LE(seq[i-1]) || LE(local[i]), seed 1337).
std::vector<SequenceHash> ComputeSequenceHashes(std::span<const LocalHash> local_hashes);

// One step of the sequence chain, for callers that extend a prefix block by block.
SequenceHash ChainSequenceHash(SequenceHash parent, LocalHash local);

}  // namespace kvrouter
