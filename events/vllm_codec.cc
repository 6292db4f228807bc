#include "events/vllm_codec.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>

#include "events/block_hash.h"
#include "events/msgpack_reader.h"

namespace kvrouter {
namespace {

using Packer = msgpack::packer<msgpack::sbuffer>;

// The fields of one event: by position in the array form (after the tag), by name in the map
// form. Borrows the parsed event.
class EventFields {
 public:
  static Result<EventFields> Of(const msgpack::object& event) {
    EventFields f;
    const msgpack::object* tag = nullptr;
    if (IsArray(event)) {
      std::span<const msgpack::object> items(event.via.array.ptr, event.via.array.size);
      if (items.empty()) return InvalidArgument("event array has no tag");
      tag = &items[0];
      f.positional_ = items.subspan(1);
    } else if (IsMap(event)) {
      tag = FindKey(event, "type");
      f.map_ = &event;
    } else {
      return InvalidArgument("event must be an array or a map");
    }
    auto name = ReadStr(tag, "type");
    if (!name.ok()) return name.status();
    f.tag_ = *name;
    return f;
  }

  std::string_view tag() const { return tag_; }

  // Field number `index` (0 = the first field after the tag) called `name`; nullptr if absent.
  const msgpack::object* Get(std::size_t index, std::string_view name) const {
    if (map_ != nullptr) return FindKey(*map_, name);
    return index < positional_.size() ? &positional_[index] : nullptr;
  }

 private:
  std::string_view tag_;
  std::span<const msgpack::object> positional_;
  const msgpack::object* map_ = nullptr;
};

bool EqualsIgnoringCase(std::string_view a, std::string_view b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end(), [](char x, char y) {
    return (x | 0x20) == (y | 0x20);  // ASCII letters only; enough for the names compared
  });
}

// medium (docs/protocol.md section 12), case-insensitive: GPU, DEVICE -> device; CPU, CPU_PINNED,
// CPU_TIER1 -> host pinned; CPU_TIER2, DISK, NVME, STORAGE -> disk; EXTERNAL, NETWORK, REMOTE,
// SHARED -> external; anything else -> device. nil is handled by the caller.
Result<StorageTier> ReadMedium(const msgpack::object* o, std::string_view field) {
  auto medium = ReadStr(o, field);
  if (!medium.ok()) return medium.status();
  auto is = [&](std::initializer_list<std::string_view> names) {
    return std::any_of(names.begin(), names.end(), [&](std::string_view n) { return EqualsIgnoringCase(*medium, n); });
  };
  if (is({"cpu", "cpu_pinned", "cpu_tier1"})) return StorageTier::kHostPinned;
  if (is({"cpu_tier2", "disk", "nvme", "storage"})) return StorageTier::kDisk;
  if (is({"external", "network", "remote", "shared"})) return StorageTier::kExternal;
  return StorageTier::kDevice;
}

// extra_keys of a BlockStored (docs/protocol.md section 12): one entry per block, nil or a list
// of keys; a key is an item identifier (a string, or [identifier, offset]) unless it is the LoRA
// name. The items' hashes per block, for HashBlockWithItems (a cache_salt, a string on the first
// block, keeps salted prefixes apart the same way). Keys of other shapes are skipped.
std::vector<std::vector<std::uint64_t>> ReadExtraKeys(const msgpack::object* o, std::string_view lora_name,
                                                      std::size_t blocks) {
  std::vector<std::vector<std::uint64_t>> out(blocks);
  if (o == nullptr || !IsArray(*o)) return out;
  for (std::size_t b = 0; b < std::min<std::size_t>(blocks, o->via.array.size); ++b) {
    const msgpack::object& keys = o->via.array.ptr[b];
    if (!IsArray(keys)) continue;
    for (std::uint32_t k = 0; k < keys.via.array.size; ++k) {
      const msgpack::object* key = &keys.via.array.ptr[k];
      if (IsArray(*key) && key->via.array.size >= 1) key = &key->via.array.ptr[0];  // [identifier, offset]
      auto id = ReadStr(key, "extra_keys");
      if (!id.ok() || (!lora_name.empty() && *id == lora_name)) continue;
      out[b].push_back(MmItemHash(*id));
    }
  }
  return out;
}

// BlockStored: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
// lora_name, extra_keys, ... `cut_short` is set when some blocks could not be hashed at
// ctx.block_size.
Result<KvOp> DecodeStored(const EventFields& f, const VllmBatchContext& ctx, bool& cut_short) {
  std::vector<std::uint64_t> hashes;
  std::vector<std::uint32_t> tokens;
  std::uint32_t block_size = 0;
  std::string_view lora_name;
  KvStored stored;
  KvOp op;
  FieldReads reads;
  reads.Required(f.Get(0, "block_hashes"), "block_hashes", ReadHashIntOrBinArray, hashes);
  reads.Optional(f.Get(1, "parent_block_hash"), "parent_block_hash", ReadHashIntOrBin, stored.parent_hash);
  reads.Required(f.Get(2, "token_ids"), "token_ids", ReadU32Array, tokens);
  reads.Required(f.Get(3, "block_size"), "block_size", ReadU32, block_size);
  // Field 4, lora_id, is not used: lora_name names the adapter that seeds the hash.
  reads.Optional(f.Get(5, "medium"), "medium", ReadMedium, op.tier);
  reads.Optional(f.Get(6, "lora_name"), "lora_name", ReadStr, lora_name);
  if (!reads.ok()) return reads.status();

  // Block k holds tokens [k*bs, (k+1)*bs). A different block size makes every block bad.
  std::size_t good = 0;
  if (block_size == ctx.block_size && block_size > 0) {
    good = std::min(hashes.size(), tokens.size() / block_size);
  }
  cut_short = good < hashes.size();
  const std::uint64_t seed = LoraSeed(lora_name);
  const std::span<const std::uint32_t> all_tokens(tokens);
  const auto items = ReadExtraKeys(f.Get(7, "extra_keys"), lora_name, good);
  stored.blocks.reserve(good);
  for (std::size_t k = 0; k < good; ++k) {
    stored.blocks.push_back(
        {hashes[k], HashBlockWithItems(all_tokens.subspan(k * block_size, block_size), items[k], seed)});
  }
  op.data = std::move(stored);
  return op;
}

// BlockRemoved: block_hashes, medium, ...
Result<KvOp> DecodeRemoved(const EventFields& f) {
  KvRemoved removed;
  KvOp op;
  FieldReads reads;
  reads.Required(f.Get(0, "block_hashes"), "block_hashes", ReadHashIntOrBinArray, removed.block_hashes);
  reads.Optional(f.Get(1, "medium"), "medium", ReadMedium, op.tier);
  if (!reads.ok()) return reads.status();
  op.data = std::move(removed);
  return op;
}

Result<KvOp> DecodeEvent(const msgpack::object& event, const VllmBatchContext& ctx, bool& cut_short) {
  auto fields = EventFields::Of(event);
  if (!fields.ok()) return fields.status();
  const std::string_view tag = fields->tag();
  if (tag == "BlockStored") return DecodeStored(*fields, ctx, cut_short);
  if (tag == "BlockRemoved") return DecodeRemoved(*fields);
  if (tag == "AllBlocksCleared") return KvOp{StorageTier::kDevice, KvCleared{}};
  return InvalidArgument(fmt::format("unknown vLLM event type '{}'", tag));
}

Result<std::int64_t> ReadDpRank(const msgpack::object* o, std::string_view field) {
  return ReadI64(o, field);  // checked for its type only: the subject's dp rank wins
}

void PackHashes(Packer& pk, const std::vector<std::uint64_t>& hashes) {
  pk.pack_array(static_cast<std::uint32_t>(hashes.size()));
  for (std::uint64_t h : hashes) pk.pack_uint64(h);
}

template <typename T>
void PackOptional(Packer& pk, const std::optional<T>& v) {
  if (v) {
    pk.pack(*v);
  } else {
    pk.pack_nil();
  }
}

void PackEvent(Packer& pk, const VllmStoredEvent& e) {
  pk.pack_array(e.extra_keys.empty() ? 8 : 9);
  pk.pack("BlockStored");
  PackHashes(pk, e.block_hashes);
  PackOptional(pk, e.parent_block_hash);
  pk.pack(e.token_ids);
  pk.pack_uint32(e.block_size);
  pk.pack_nil();  // lora_id
  PackOptional(pk, e.medium);
  PackOptional(pk, e.lora_name.empty() ? std::nullopt : std::optional(e.lora_name));
  if (!e.extra_keys.empty()) {
    pk.pack_array(static_cast<std::uint32_t>(e.extra_keys.size()));
    for (const auto& keys : e.extra_keys) {
      if (keys.empty()) {
        pk.pack_nil();
      } else {
        pk.pack(keys);
      }
    }
  }
}

void PackEvent(Packer& pk, const VllmRemovedEvent& e) {
  pk.pack_array(3);
  pk.pack("BlockRemoved");
  PackHashes(pk, e.block_hashes);
  PackOptional(pk, e.medium);
}

void PackEvent(Packer& pk, const VllmClearedEvent&) {
  pk.pack_array(1);
  pk.pack("AllBlocksCleared");
}

}  // namespace

Result<VllmDecoded> DecodeVllmBatch(std::span<const std::byte> body, const VllmBatchContext& ctx) {
  auto doc = ParseMsgpack(body);
  if (!doc.ok()) return doc.status();
  const msgpack::object& root = doc->get();

  // [ts, events, data_parallel_rank?] or the same names in a map.
  const msgpack::object* ts = nullptr;
  const msgpack::object* events = nullptr;
  const msgpack::object* dp_rank = nullptr;
  if (IsArray(root)) {
    if (root.via.array.size < 2) {
      return InvalidArgument("vLLM batch must be [ts, events, data_parallel_rank?]");
    }
    ts = &root.via.array.ptr[0];
    events = &root.via.array.ptr[1];
    if (root.via.array.size > 2) dp_rank = &root.via.array.ptr[2];
  } else if (IsMap(root)) {
    ts = FindKey(root, "ts");
    events = FindKey(root, "events");
    dp_rank = FindKey(root, "data_parallel_rank");
  } else {
    return InvalidArgument("vLLM batch must be an array or a map");
  }
  double ts_value = 0;
  std::int64_t batch_dp_rank = 0;
  std::span<const msgpack::object> event_list;
  FieldReads reads;
  reads.Required(ts, "ts", ReadF64, ts_value);
  reads.Required(events, "events", ReadArray, event_list);
  reads.Optional(dp_rank, "data_parallel_rank", ReadDpRank, batch_dp_rank);
  if (!reads.ok()) return reads.status();

  VllmDecoded out;
  KvEventBatch& batch = out.batch;
  batch.worker_id = ctx.worker_id;
  batch.dp_rank = ctx.dp_rank;
  if (ctx.kv_seq) batch.sequence = {SequenceKind::kVllmSeq, *ctx.kv_seq};
  batch.ops.reserve(event_list.size());
  for (std::size_t i = 0; i < event_list.size(); ++i) {
    bool cut_short = false;
    auto op = DecodeEvent(event_list[i], ctx, cut_short);
    if (!op.ok()) return InvalidArgument(fmt::format("event {}: {}", i, op.status().message()));
    if (cut_short) ++out.block_size_mismatches;
    batch.ops.push_back(std::move(op).value());
  }
  return out;
}

std::optional<std::uint64_t> ParseKvSeqHeader(std::string_view value) {
  if (value.empty()) return std::nullopt;
  std::uint64_t seq = 0;
  const char* end = value.data() + value.size();
  auto [ptr, ec] = std::from_chars(value.data(), end, seq);
  if (ec != std::errc() || ptr != end) return std::nullopt;
  return seq;
}

msgpack::sbuffer EncodeVllmBatch(double ts, const std::vector<VllmEvent>& events,
                                 std::optional<std::uint32_t> dp_rank) {
  msgpack::sbuffer buf;
  Packer pk(buf);
  pk.pack_array(3);
  pk.pack_double(ts);
  pk.pack_array(static_cast<std::uint32_t>(events.size()));
  for (const VllmEvent& e : events) {
    std::visit([&pk](const auto& ev) { PackEvent(pk, ev); }, e);
  }
  PackOptional(pk, dp_rank);
  return buf;
}

}  // namespace kvrouter
