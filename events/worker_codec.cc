#include "events/worker_codec.h"

#include <fmt/format.h>

#include <utility>

#include "events/event_codec.h"
#include "events/msgpack_reader.h"
#include "events/msgpack_writer.h"

namespace kvrouter {

// ---------------------------------------------------------------------------------------------
// Recovery.

msgpack::sbuffer RecoveryQuery::Encode() const {
  MapWriter w;
  w.Field("start_event_id", start_event_id).Field("end_event_id", end_event_id);
  return std::move(w).Finish();
}

Result<RecoveryQuery> RecoveryQuery::Decode(std::span<const std::byte> body) {
  auto doc = ParseMsgpackMap(body, "recovery query");
  if (!doc.ok()) return doc.status();
  const msgpack::object& root = doc->get();
  RecoveryQuery q;
  FieldReads reads;
  reads.Optional(root, "start_event_id", ReadU64, q.start_event_id);
  reads.Optional(root, "end_event_id", ReadU64, q.end_event_id);
  if (!reads.ok()) return reads.status();
  return q;
}

msgpack::sbuffer EncodeRecoveryReply(const RecoveryReply& reply) {
  MapWriter w;
  w.Field("kind", reply.kind);
  w.With("events", [&](msgpack::sbuffer& out) {
    msgpack::packer<msgpack::sbuffer>(out).pack_array(static_cast<std::uint32_t>(reply.events.size()));
    for (const KvEventBatch& b : reply.events) PackKvCacheEvent(out, b, /*with_tier=*/true);
  });
  w.Field("last_event_id", reply.last_event_id);
  if (!reply.message.empty()) w.Field("message", reply.message);
  if (reply.more) w.Field("more", true);
  return std::move(w).Finish();
}

namespace {

// A dump's stored chain cut in two consecutive chains (the second hangs under the first's last
// block); false when it has a single block.
bool HalveChain(const KvEventBatch& b, KvEventBatch& first, KvEventBatch& second) {
  if (b.ops.size() != 1) return false;
  const auto* stored = std::get_if<KvStored>(&b.ops[0].data);
  if (stored == nullptr || stored->blocks.size() < 2) return false;
  const std::size_t half = stored->blocks.size() / 2;
  first = b;
  second = b;
  auto& a = std::get<KvStored>(first.ops[0].data);
  auto& c = std::get<KvStored>(second.ops[0].data);
  a.blocks.resize(half);
  c.blocks.erase(c.blocks.begin(), c.blocks.begin() + static_cast<std::ptrdiff_t>(half));
  c.parent_hash = a.blocks.back().block_hash;
  return true;
}

}  // namespace

Result<std::vector<msgpack::sbuffer>> EncodeRecoveryReplyParts(const RecoveryReply& reply, std::size_t max_bytes) {
  RecoveryReply head = reply;
  head.events.clear();
  head.more = true;
  // Every part repeats the fields around the list; the list's header grows to 5 bytes at most.
  const std::size_t overhead = EncodeRecoveryReply(head).size() + 5;
  if (overhead >= max_bytes) return InvalidArgument("max_bytes cannot hold even an empty recovery reply");
  const std::size_t room = max_bytes - overhead;
  // Each event packed alone; a dump's chain too large for a part is cut until it fits.
  std::vector<msgpack::sbuffer> packed;
  std::vector<KvEventBatch> todo(reply.events.rbegin(), reply.events.rend());  // a stack, in order
  while (!todo.empty()) {
    KvEventBatch b = std::move(todo.back());
    todo.pop_back();
    msgpack::sbuffer one;
    PackKvCacheEvent(one, b, /*with_tier=*/true);
    if (one.size() > room) {
      KvEventBatch first, second;
      if (reply.kind != "tree_dump" || !HalveChain(b, first, second)) {
        return InvalidArgument(fmt::format("a recovery event of {} bytes cannot fit in {}", one.size(), max_bytes));
      }
      todo.push_back(std::move(second));
      todo.push_back(std::move(first));
      continue;
    }
    packed.push_back(std::move(one));
  }
  std::vector<msgpack::sbuffer> parts;
  std::size_t i = 0;
  do {
    std::size_t used = 0, n = 0;
    while (i + n < packed.size() && used + packed[i + n].size() <= room) used += packed[i + n++].size();
    MapWriter w;
    w.Field("kind", reply.kind);
    w.With("events", [&](msgpack::sbuffer& out) {
      msgpack::packer<msgpack::sbuffer>(out).pack_array(static_cast<std::uint32_t>(n));
      for (std::size_t k = i; k < i + n; ++k) out.write(packed[k].data(), packed[k].size());
    });
    w.Field("last_event_id", reply.last_event_id);
    if (!reply.message.empty()) w.Field("message", reply.message);
    i += n;
    if (i < packed.size()) w.Field("more", true);
    parts.push_back(std::move(w).Finish());
  } while (i < packed.size());
  return parts;
}

Result<RecoveryReply> DecodeRecoveryReply(std::span<const std::byte> body, std::uint64_t worker_id) {
  auto doc = ParseMsgpackMap(body, "recovery reply");
  if (!doc.ok()) return doc.status();
  const msgpack::object& root = doc->get();
  RecoveryReply r;
  FieldReads reads;
  reads.Required(root, "kind", ReadStr, r.kind);
  reads.Optional(root, "last_event_id", ReadU64, r.last_event_id);
  reads.Optional(root, "message", ReadStr, r.message);
  reads.Optional(root, "more", ReadBool, r.more);
  if (!reads.ok()) return reads.status();
  const msgpack::object* events = FindKey(root, "events");
  if (IsNil(events)) return r;
  auto list = ReadArray(events, "events");
  if (!list.ok()) return list.status();
  r.events.reserve(list->size());  // bounded by the bytes read: an element takes at least one
  for (std::size_t i = 0; i < list->size(); ++i) {
    auto batch = DecodeKvCacheEvent((*list)[i], worker_id, StorageTier::kDevice);
    if (!batch.ok()) {
      return InvalidArgument(fmt::format("events[{}]: {}", i, batch.status().message()));
    }
    r.events.push_back(std::move(batch).value());
  }
  return r;
}

// ---------------------------------------------------------------------------------------------
// Generate.

msgpack::sbuffer GenerateRequest::Encode() const {
  MapWriter w;
  w.Field("request_id", request_id)
      .Field("token_ids", token_ids)
      .Field("max_tokens", max_tokens)
      .Field("dp_rank", dp_rank);
  return std::move(w).Finish();
}

Result<GenerateRequest> GenerateRequest::Decode(std::span<const std::byte> body) {
  auto doc = ParseMsgpackMap(body, "generate request");
  if (!doc.ok()) return doc.status();
  const msgpack::object& root = doc->get();
  GenerateRequest r;
  FieldReads reads;
  reads.Required(root, "request_id", ReadStr, r.request_id);
  reads.Required(root, "token_ids", ReadU32Array, r.token_ids);
  reads.Optional(root, "max_tokens", ReadU32, r.max_tokens);
  reads.Optional(root, "dp_rank", ReadU32, r.dp_rank);
  if (!reads.ok()) return reads.status();
  if (r.max_tokens < 1 || r.max_tokens > kMaxGenerateTokens) {
    return InvalidArgument(fmt::format("max_tokens must be in [1, {}]", kMaxGenerateTokens));
  }
  return r;
}

msgpack::sbuffer GenerateResponse::Encode() const {
  MapWriter w;
  w.Field("request_id", request_id).Field("token_ids", token_ids).Field("index", index);
  if (is_final()) {
    w.Field("finish_reason", *finish_reason)
        .Field("cached_tokens", cached_tokens)
        .Field("prompt_tokens", prompt_tokens)
        .Field("ttft_ms", ttft_ms);
    if (!message.empty()) w.Field("message", message);
  }
  return std::move(w).Finish();
}

Result<GenerateResponse> GenerateResponse::Decode(std::span<const std::byte> body) {
  auto doc = ParseMsgpackMap(body, "generate response");
  if (!doc.ok()) return doc.status();
  const msgpack::object& root = doc->get();
  GenerateResponse r;
  FieldReads reads;
  reads.Required(root, "request_id", ReadStr, r.request_id);
  reads.Required(root, "token_ids", ReadU32Array, r.token_ids);
  reads.Optional(root, "index", ReadU32, r.index);
  reads.Optional(root, "finish_reason", ReadStr, r.finish_reason);
  reads.Optional(root, "cached_tokens", ReadU32, r.cached_tokens);
  reads.Optional(root, "prompt_tokens", ReadU32, r.prompt_tokens);
  reads.Optional(root, "ttft_ms", ReadNonNegative, r.ttft_ms);
  reads.Optional(root, "message", ReadStr, r.message);
  if (!reads.ok()) return reads.status();
  return r;
}

Result<bool> IsFinalGenerateResponse(std::span<const std::byte> body) {
  auto doc = ParseMsgpackMap(body, "generate response");
  if (!doc.ok()) return doc.status();
  return !IsNil(FindKey(doc->get(), "finish_reason"));
}

}  // namespace kvrouter
