#include "events/block_hash.h"

#include <xxhash.h>

#include <bit>
#include <cstring>

namespace kvrouter {

static_assert(std::endian::native == std::endian::little,
              "block hashing hashes tokens as little-endian bytes in place");

std::uint64_t LoraSeed(std::string_view lora_name) {
  if (lora_name.empty()) return kBlockHashSeed;
  return kBlockHashSeed + XXH3_64bits_withSeed(lora_name.data(), lora_name.size(), 0);
}

LocalHash HashBlockTokens(std::span<const std::uint32_t> block_tokens, std::uint64_t seed) {
  return XXH3_64bits_withSeed(block_tokens.data(), block_tokens.size_bytes(), seed);
}

std::vector<LocalHash> ComputeLocalHashes(std::span<const std::uint32_t> tokens, std::uint32_t block_size,
                                          std::string_view lora_name) {
  std::vector<LocalHash> out;
  if (block_size == 0) return out;
  const std::uint64_t seed = LoraSeed(lora_name);
  const std::size_t blocks = tokens.size() / block_size;
  out.reserve(blocks);
  for (std::size_t b = 0; b < blocks; ++b) {
    out.push_back(HashBlockTokens(tokens.subspan(b * block_size, block_size), seed));
  }
  return out;
}

SequenceHash ChainSequenceHash(SequenceHash parent, LocalHash local) {
  std::uint64_t buf[2] = {parent, local};
  return XXH3_64bits_withSeed(buf, sizeof(buf), kBlockHashSeed);
}

std::vector<SequenceHash> ComputeSequenceHashes(std::span<const LocalHash> local_hashes) {
  std::vector<SequenceHash> out;
  out.reserve(local_hashes.size());
  for (std::size_t i = 0; i < local_hashes.size(); ++i) {
    out.push_back(i == 0 ? local_hashes[0] : ChainSequenceHash(out.back(), local_hashes[i]));
  }
  return out;
}

}  // namespace kvrouter
