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

// seq[0] = local[0]; seq[i] = XXH3-64(LE(seq[i-1]) || LE(local[i]), seed 1337).
std::vector<SequenceHash> ComputeSequenceHashes(std::span<const LocalHash> local_hashes);

// One step of the sequence chain, for callers that extend a prefix block by block.
SequenceHash ChainSequenceHash(SequenceHash parent, LocalHash local);

}  // namespace kvrouter
