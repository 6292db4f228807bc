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

}  // namespace kvrouter
