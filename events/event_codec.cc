#include "events/event_codec.h"

#include <fmt/format.h>

#include <cassert>
#include <optional>
#include <utility>

#include "events/msgpack_reader.h"
#include "events/msgpack_writer.h"

namespace kvrouter {
namespace {

using Packer = msgpack::packer<msgpack::sbuffer>;

// {"stored": {parent_hash, blocks: [{block_hash, tokens_hash, mm_extra_info?}...]}}
Result<KvStored> DecodeStored(const msgpack::object& stored) {
  if (!IsMap(stored)) return InvalidArgument("field 'stored' must be a map");
  KvStored out;
  FieldReads reads;
  reads.Optional(stored, "parent_hash", ReadU64Bits, out.parent_hash);
  auto blocks = ReadArray(FindKey(stored, "blocks"), "blocks");
  if (!blocks.ok()) reads.Fail(blocks.status());
  if (!reads.ok()) return reads.status();
  out.blocks.reserve(blocks->size());
  for (const msgpack::object& block : *blocks) {
    if (!IsMap(block)) return InvalidArgument("field 'blocks' must hold maps");
    StoredBlock b;
    reads.Required(block, "block_hash", ReadU64Bits, b.block_hash);
    reads.Required(block, "tokens_hash", ReadU64Bits, b.tokens_hash);
    if (!reads.ok()) return reads.status();  // mm_extra_info is not used
    out.blocks.push_back(b);
  }
  return out;
}

// {"removed": {block_hashes: [u64...]}}
Result<KvRemoved> DecodeRemoved(const msgpack::object& removed) {
  if (!IsMap(removed)) return InvalidArgument("field 'removed' must be a map");
  KvRemoved out;
  FieldReads reads;
  reads.Required(removed, "block_hashes", ReadU64BitsArray, out.block_hashes);
  if (!reads.ok()) return reads.status();
  return out;
}

// data = {"stored": ...} | {"removed": ...} | "cleared", decoded into `out`. The map names the
// event kind with its single key, so a second key is refused rather than ignored.
// {"cleared": <anything>} is taken as "cleared" too (a serializer may write a unit variant so).
Status DecodeData(const msgpack::object* data, KvEventData& out) {
  if (data == nullptr) return InvalidArgument("missing field 'data'");
  std::string_view kind;
  const msgpack::object* body = nullptr;
  if (data->type == msgpack::type::STR) {
    kind = std::string_view(data->via.str.ptr, data->via.str.size);
  } else if (IsMap(*data) && data->via.map.size == 1) {
    auto key = ReadStr(&data->via.map.ptr[0].key, "data key");
    if (!key.ok()) return key.status();
    kind = *key;
    body = &data->via.map.ptr[0].val;
  } else {
    return InvalidArgument("field 'data' must be \"cleared\" or a map with one key");
  }

  if (kind == "cleared") {
    out.emplace<KvCleared>();
    return Status::Ok();
  }
  if (body != nullptr && kind == "stored") {
    auto stored = DecodeStored(*body);
    if (!stored.ok()) return stored.status();
    out.emplace<KvStored>(std::move(stored).value());
    return Status::Ok();
  }
  if (body != nullptr && kind == "removed") {
    auto removed = DecodeRemoved(*body);
    if (!removed.ok()) return removed.status();
    out.emplace<KvRemoved>(std::move(removed).value());
    return Status::Ok();
  }
  return InvalidArgument(fmt::format("unknown event kind '{}' in field 'data'", kind));
}

Result<StorageTier> ReadStorageTier(const msgpack::object* o, std::string_view field) {
  auto name = ReadStr(o, field);
  if (!name.ok()) return name.status();
  auto tier = StorageTierFromName(*name);
  if (!tier) return InvalidArgument(fmt::format("unknown {} '{}'", field, *name));
  return *tier;
}

// router_event = {worker_id, storage_tier?, event: kv_event}
Result<KvEventBatch> DecodeRouterEvent(const msgpack::object& root) {
  if (!IsMap(root)) return InvalidArgument("RouterEvent must be a map");
  std::uint64_t worker_id = 0;
  StorageTier tier = StorageTier::kDevice;
  FieldReads reads;
  reads.Required(root, "worker_id", ReadU64, worker_id);
  reads.Optional(root, "storage_tier", ReadStorageTier, tier);
  if (!reads.ok()) return reads.status();
  const msgpack::object* event = FindKey(root, "event");
  if (event == nullptr) return InvalidArgument("missing field 'event'");
  return DecodeKvCacheEvent(*event, worker_id, tier);
}

// {parent_hash, blocks} of a stored chain, appended to `out`.
void PackStored(msgpack::sbuffer& out, const KvStored& stored) {
  MapWriter chain;
  chain.With("parent_hash", [&](Packer& pk) {
    if (stored.parent_hash) {
      pk.pack_uint64(*stored.parent_hash);
    } else {
      pk.pack_nil();
    }
  });
  chain.With("blocks", [&](msgpack::sbuffer& blocks) {
    Packer(blocks).pack_array(static_cast<std::uint32_t>(stored.blocks.size()));
    MapWriter block;
    for (const StoredBlock& b : stored.blocks) {
      block.Clear();
      block.Field("block_hash", b.block_hash).Field("tokens_hash", b.tokens_hash);
      block.AppendTo(blocks);
    }
  });
  chain.AppendTo(out);
}

// data = "cleared" | {"stored": {parent_hash, blocks}} | {"removed": {block_hashes}}, appended
// to `out`.
void PackData(msgpack::sbuffer& out, const KvEventData& data) {
  if (std::holds_alternative<KvCleared>(data)) {
    Packer(out).pack("cleared");
    return;
  }
  MapWriter kind;
  if (const auto* stored = std::get_if<KvStored>(&data)) {
    kind.With("stored", [&](msgpack::sbuffer& buf) { PackStored(buf, *stored); });
  } else {
    MapWriter removed;
    removed.Field("block_hashes", std::get<KvRemoved>(data).block_hashes);
    kind.Map("removed", removed);
  }
  kind.AppendTo(out);
}

// ---- the ingest path's pull decoder --------------------------------------------------------
// Decodes the shapes Dynamo workers publish straight from the bytes. It accepts a strict subset
// of what the tree decoder below accepts, with the same meaning (first-class fields, any
// integer width, nil optionals, unknown keys skipped): anything else (a duplicate or non-string
// key, an unusual type, a malformed value) returns nullopt, and the tree decoder gives the
// verdict and its error message. The DynamoEventPull tests and fuzz_dynamo_event pin the two together.

using Pull = MsgpackPull;

// {"parent_hash": h|nil, "blocks": [{"block_hash": h, "tokens_hash": h, ...}...], ...}
bool PullStored(Pull& in, KvStored& out) {
  std::uint32_t keys = 0;
  if (!in.MapHeader(keys)) return false;
  bool seen_parent = false, seen_blocks = false;
  for (std::uint32_t k = 0; k < keys; ++k) {
    std::string_view key;
    if (!in.Str(key)) return false;
    if (key == "parent_hash") {
      if (std::exchange(seen_parent, true)) return false;
      std::uint64_t h = 0;
      if (in.TakeNil()) continue;
      if (!in.U64Bits(h)) return false;
      out.parent_hash = h;
    } else if (key == "blocks") {
      if (std::exchange(seen_blocks, true)) return false;
      std::uint32_t n = 0;
      if (!in.ArrayHeader(n)) return false;
      out.blocks.resize(n);
      for (StoredBlock& b : out.blocks) {
        std::uint32_t fields = 0;
        if (!in.MapHeader(fields)) return false;
        bool seen_block = false, seen_tokens = false;
        for (std::uint32_t f = 0; f < fields; ++f) {
          std::string_view name;
          if (!in.Str(name)) return false;
          if (name == "block_hash") {
            if (std::exchange(seen_block, true) || !in.U64Bits(b.block_hash)) return false;
          } else if (name == "tokens_hash") {
            if (std::exchange(seen_tokens, true) || !in.U64Bits(b.tokens_hash)) return false;
          } else if (!in.Skip()) {
            return false;
          }
        }
        if (!seen_block || !seen_tokens) return false;
      }
    } else if (!in.Skip()) {
      return false;
    }
  }
  return seen_blocks;
}

// {"block_hashes": [h...], ...}
bool PullRemoved(Pull& in, KvRemoved& out) {
  std::uint32_t keys = 0;
  if (!in.MapHeader(keys)) return false;
  bool seen = false;
  for (std::uint32_t k = 0; k < keys; ++k) {
    std::string_view key;
    if (!in.Str(key)) return false;
    if (key != "block_hashes") {
      if (!in.Skip()) return false;
      continue;
    }
    std::uint32_t n = 0;
    if (std::exchange(seen, true) || !in.ArrayHeader(n)) return false;
    out.block_hashes.resize(n);
    for (std::uint64_t& h : out.block_hashes) {
      if (!in.U64Bits(h)) return false;
    }
  }
  return seen;
}

// "cleared" | {"stored": ...} | {"removed": ...} | {"cleared": <anything>}
bool PullData(Pull& in, KvEventData& out) {
  std::string_view kind;
  if (in.Str(kind)) {
    if (kind != "cleared") return false;
    out.emplace<KvCleared>();
    return true;
  }
  std::uint32_t keys = 0;
  if (!in.MapHeader(keys) || keys != 1 || !in.Str(kind)) return false;
  // A recycled op keeps its vector's memory when it held the same kind.
  if (kind == "stored") {
    auto* stored = std::get_if<KvStored>(&out);
    if (stored == nullptr) return PullStored(in, out.emplace<KvStored>());
    stored->parent_hash.reset();
    return PullStored(in, *stored);
  }
  if (kind == "removed") {
    auto* removed = std::get_if<KvRemoved>(&out);
    return PullRemoved(in, removed != nullptr ? *removed : out.emplace<KvRemoved>());
  }
  if (kind == "cleared" && in.Skip()) {
    out.emplace<KvCleared>();
    return true;
  }
  return false;
}

// {"event_id": u64, "dp_rank": u32|nil, "data": ..., ...}
bool PullKvCacheEvent(Pull& in, KvEventBatch& batch, KvOp& op) {
  std::uint32_t keys = 0;
  if (!in.MapHeader(keys)) return false;
  bool seen_id = false, seen_rank = false, seen_data = false;
  for (std::uint32_t k = 0; k < keys; ++k) {
    std::string_view key;
    if (!in.Str(key)) return false;
    if (key == "event_id") {
      if (std::exchange(seen_id, true) || !in.U64(batch.sequence.value)) return false;
    } else if (key == "dp_rank") {
      if (std::exchange(seen_rank, true)) return false;
      if (!in.TakeNil() && !in.U32(batch.dp_rank)) return false;
    } else if (key == "data") {
      if (std::exchange(seen_data, true) || !PullData(in, op.data)) return false;
    } else if (!in.Skip()) {
      return false;
    }
  }
  return seen_id && seen_data;
}

// {"worker_id": u64, "storage_tier": str|nil, "event": {...}, ...}: the whole of `bytes`, into
// `batch` (every field set; its first op's memory reused, any other op dropped).
bool PullRouterEvent(std::span<const std::byte> bytes, KvEventBatch& batch) {
  Pull in(bytes);
  std::uint32_t keys = 0;
  if (!in.MapHeader(keys)) return false;
  batch.worker_id = 0;
  batch.dp_rank = 0;
  batch.sequence = {SequenceKind::kEventId, 0};
  batch.ops.resize(1);
  KvOp& op = batch.ops.front();
  op.tier = StorageTier::kDevice;
  bool seen_worker = false, seen_tier = false, seen_event = false;
  for (std::uint32_t k = 0; k < keys; ++k) {
    std::string_view key;
    if (!in.Str(key)) return false;
    if (key == "worker_id") {
      if (std::exchange(seen_worker, true) || !in.U64(batch.worker_id)) return false;
    } else if (key == "storage_tier") {
      if (std::exchange(seen_tier, true)) return false;
      std::string_view name;
      if (in.TakeNil()) continue;
      if (!in.Str(name)) return false;
      auto tier = StorageTierFromName(name);
      if (!tier) return false;
      op.tier = *tier;
    } else if (key == "event") {
      if (std::exchange(seen_event, true) || !PullKvCacheEvent(in, batch, op)) return false;
    } else if (!in.Skip()) {
      return false;
    }
  }
  return seen_worker && seen_event && in.AtEnd();
}

// An envelope {"payload": bin(RouterEvent), ...} or a bare RouterEvent.
bool PullDynamoEvent(std::span<const std::byte> body, KvEventBatch& batch) {
  Pull in(body);
  std::uint32_t keys = 0;
  if (!in.MapHeader(keys)) return false;
  std::optional<std::span<const std::byte>> payload;
  for (std::uint32_t k = 0; k < keys; ++k) {
    std::string_view key;
    if (!in.Str(key)) return false;
    if (key == "payload") {
      std::span<const std::byte> bin;
      if (payload || !in.Bin(bin)) return false;
      payload = bin;
    } else if (!in.Skip()) {
      return false;
    }
  }
  if (!in.AtEnd()) return false;
  return PullRouterEvent(payload ? *payload : body, batch);
}

}  // namespace

std::optional<KvEventBatch> DecodeDynamoEventPull(std::span<const std::byte> body) {
  KvEventBatch batch;
  if (!PullDynamoEvent(body, batch)) return std::nullopt;
  return batch;
}

void PackKvCacheEvent(msgpack::sbuffer& out, const KvEventBatch& batch, bool with_tier) {
  assert(batch.ops.size() == 1);
  // Without an op (a caller bug) an empty removal keeps the event id sequence intact.
  const KvEventData data = batch.ops.empty() ? KvEventData{KvRemoved{}} : batch.ops.front().data;
  MapWriter event;
  event.Field("event_id", batch.sequence.value).Field("dp_rank", batch.dp_rank);
  if (with_tier && !batch.ops.empty() && batch.ops.front().tier != StorageTier::kDevice) {
    event.Field("storage_tier", StorageTierName(batch.ops.front().tier));
  }
  event.With("data", [&](msgpack::sbuffer& buf) { PackData(buf, data); });
  event.AppendTo(out);
}

void PackStoredEvent(msgpack::sbuffer& out, std::uint64_t event_id, std::uint32_t dp_rank, StorageTier tier,
                     const KvStored& stored) {
  // Packed straight into `out` (a dump writes millions of blocks): the maps' sizes are fixed.
  Packer pk(out);
  auto key = [&](std::string_view k) {
    pk.pack_str(static_cast<std::uint32_t>(k.size())).pack_str_body(k.data(), k.size());
  };
  pk.pack_map(4);
  key("event_id");
  pk.pack_uint64(event_id);
  key("dp_rank");
  pk.pack_uint32(dp_rank);
  key("storage_tier");
  key(StorageTierName(tier));
  key("data");
  pk.pack_map(1);
  key("stored");
  pk.pack_map(2);
  key("parent_hash");
  if (stored.parent_hash) {
    pk.pack_uint64(*stored.parent_hash);
  } else {
    pk.pack_nil();
  }
  key("blocks");
  pk.pack_array(static_cast<std::uint32_t>(stored.blocks.size()));
  for (const StoredBlock& b : stored.blocks) {
    pk.pack_map(2);
    key("block_hash");
    pk.pack_uint64(b.block_hash);
    key("tokens_hash");
    pk.pack_uint64(b.tokens_hash);
  }
}

Result<KvEventBatch> DecodeKvCacheEvent(const msgpack::object& event, std::uint64_t worker_id, StorageTier tier) {
  if (!IsMap(event)) return InvalidArgument("field 'event' must be a map");
  KvEventBatch batch{.worker_id = worker_id};
  KvOp op{.tier = tier};
  std::uint64_t event_id = 0;
  FieldReads reads;
  reads.Required(event, "event_id", ReadU64, event_id);
  reads.Optional(event, "dp_rank", ReadU32, batch.dp_rank);
  reads.Optional(event, "storage_tier", ReadStorageTier, op.tier);  // recovery replies' extension
  if (!reads.ok()) return reads.status();
  if (Status s = DecodeData(FindKey(event, "data"), op.data); !s.ok()) return s;
  batch.sequence = {SequenceKind::kEventId, event_id};
  batch.ops.push_back(std::move(op));
  return batch;
}

Result<KvEventBatch> DecodeDynamoEvent(std::span<const std::byte> body) {
  KvEventBatch batch;
  if (Status s = DecodeDynamoEventInto(body, batch); !s.ok()) return s;
  return batch;
}

Status DecodeDynamoEventInto(std::span<const std::byte> body, KvEventBatch& out) {
  if (body.size() <= kMaxMessageBytes && PullDynamoEvent(body, out)) return Status::Ok();
  auto tree = DecodeDynamoEventTree(body);
  if (!tree.ok()) return tree.status();
  out = std::move(tree).value();
  return Status::Ok();
}

Result<KvEventBatch> DecodeDynamoEventTree(std::span<const std::byte> body) {
  // One zone per decoding thread, cleared per message: the ingest path allocates only the
  // batch it returns (strings and bins reference `body`).
  thread_local msgpack::zone zone;
  zone.clear();
  auto doc = ParseMsgpackIn(zone, body);
  if (!doc.ok()) return doc.status();
  const msgpack::object& root = *doc;
  if (!IsMap(root)) return InvalidArgument("kv event body must be a map");
  const msgpack::object* payload = FindKey(root, "payload");
  if (payload == nullptr) return DecodeRouterEvent(root);

  // Envelope: only the payload matters; publisher_id, sequence, published_at and topic are
  // informational and not checked. The payload's objects join the envelope's in the zone.
  if (payload->type != msgpack::type::BIN) return InvalidArgument("field 'payload' must be bin");
  auto inner = ParseMsgpackIn(zone, {reinterpret_cast<const std::byte*>(payload->via.bin.ptr), payload->via.bin.size});
  if (!inner.ok()) return InvalidArgument("field 'payload': " + inner.status().message());
  return DecodeRouterEvent(*inner);
}

msgpack::sbuffer EncodeRouterEvent(const KvEventBatch& batch) {
  const StorageTier tier = batch.ops.empty() ? StorageTier::kDevice : batch.ops.front().tier;
  MapWriter w;
  w.Field("worker_id", batch.worker_id);
  if (tier != StorageTier::kDevice) w.Field("storage_tier", StorageTierName(tier));
  w.With("event", [&](msgpack::sbuffer& out) { PackKvCacheEvent(out, batch); });
  return std::move(w).Finish();
}

msgpack::sbuffer EncodeDynamoEnvelope(const KvEventBatch& batch, const EnvelopeHeader& header) {
  const msgpack::sbuffer payload = EncodeRouterEvent(batch);
  MapWriter w;
  w.Field("publisher_id", header.publisher_id)
      .Field("sequence", header.sequence)
      .Field("published_at", header.published_at_ms)
      .Field("topic", header.topic);
  w.With("payload", [&](Packer& pk) {
    pk.pack_bin(static_cast<std::uint32_t>(payload.size()));
    pk.pack_bin_body(payload.data(), static_cast<std::uint32_t>(payload.size()));
  });
  return std::move(w).Finish();
}

}  // namespace kvrouter
