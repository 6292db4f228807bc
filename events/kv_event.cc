#include "events/kv_event.h"

namespace kvrouter {

std::string_view StorageTierName(StorageTier tier) {
  switch (tier) {
    case StorageTier::kDevice: return "device";
    case StorageTier::kHostPinned: return "host_pinned";
    case StorageTier::kDisk: return "disk";
    case StorageTier::kExternal: return "external";
  }
  return "device";
}

std::optional<StorageTier> StorageTierFromName(std::string_view name) {
  if (name == "device") return StorageTier::kDevice;
  if (name == "host_pinned") return StorageTier::kHostPinned;
  if (name == "disk") return StorageTier::kDisk;
  if (name == "external") return StorageTier::kExternal;
  return std::nullopt;
}

KvEventBatch StoredPromptBatch(std::uint64_t worker_id, std::uint64_t event_id, std::span<const std::uint32_t> tokens,
                               std::uint32_t block_size, std::string_view lora_name) {
  const auto local = ComputeLocalHashes(tokens, block_size, lora_name);
  const auto seq = ComputeSequenceHashes(local);
  KvStored stored;
  stored.blocks.reserve(local.size());
  for (std::size_t i = 0; i < local.size(); ++i) stored.blocks.push_back({seq[i], local[i]});
  KvEventBatch b{.worker_id = worker_id, .sequence = {SequenceKind::kEventId, event_id}};
  b.ops.push_back({StorageTier::kDevice, std::move(stored)});
  return b;
}

}  // namespace kvrouter
