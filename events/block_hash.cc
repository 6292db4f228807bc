#include "events/block_hash.h"

#include <xxhash.h>

#include <algorithm>
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

std::uint64_t MmItemHash(std::string_view identifier) {
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  if (identifier.size() == 64 &&
      std::all_of(identifier.begin(), identifier.end(), [&](char c) { return hex(c) >= 0; })) {
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < 16; ++i) v = (v << 4) | static_cast<std::uint64_t>(hex(identifier[i]));
    return v;
  }
  return XXH3_64bits_withSeed(identifier.data(), identifier.size(), 0);
}

LocalHash HashBlockWithItems(std::span<const std::uint32_t> block_tokens, std::span<const std::uint64_t> item_hashes,
                             std::uint64_t seed) {
  if (item_hashes.empty()) return HashBlockTokens(block_tokens, seed);
  std::vector<std::uint64_t> sorted(item_hashes.begin(), item_hashes.end());
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  std::vector<std::byte> bytes(block_tokens.size_bytes() + sorted.size() * sizeof(std::uint64_t));
  std::memcpy(bytes.data(), block_tokens.data(), block_tokens.size_bytes());
  std::memcpy(bytes.data() + block_tokens.size_bytes(), sorted.data(), sorted.size() * sizeof(std::uint64_t));
  return XXH3_64bits_withSeed(bytes.data(), bytes.size(), seed);
}

std::vector<LocalHash> ComputeLocalHashes(std::span<const std::uint32_t> tokens, std::uint32_t block_size,
                                          std::string_view lora_name, std::span<const MmItem> items) {
  if (items.empty() || block_size == 0) return ComputeLocalHashes(tokens, block_size, lora_name);
  const std::uint64_t seed = LoraSeed(lora_name);
  const std::size_t blocks = tokens.size() / block_size;
  std::vector<std::vector<std::uint64_t>> of_block(blocks);
  for (const MmItem& item : items) {
    if (item.length == 0) continue;
    const std::uint64_t first = item.offset / block_size;
    const std::uint64_t last = (std::uint64_t{item.offset} + item.length - 1) / block_size;
    for (std::uint64_t b = first; b <= last && b < blocks; ++b) of_block[b].push_back(item.hash);
  }
  std::vector<LocalHash> out;
  out.reserve(blocks);
  for (std::size_t b = 0; b < blocks; ++b) {
    out.push_back(HashBlockWithItems(tokens.subspan(b * block_size, block_size), of_block[b], seed));
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
