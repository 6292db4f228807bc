#include "events/worker_codec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <vector>

#include "events/msgpack_reader.h"
#include "tests/events/test_packer.h"

namespace kvrouter {
namespace {

KvEventBatch Removed(std::uint64_t worker, std::uint64_t event_id, std::vector<BlockHash> hashes) {
  KvEventBatch b{.worker_id = worker, .sequence = {SequenceKind::kEventId, event_id}};
  b.ops.resize(1);  // (push_back of a braced KvOp trips a GCC 12 -Wmaybe-uninitialized under ASan)
  b.ops[0].data = KvRemoved{std::move(hashes)};
  return b;
}

bool HasKey(std::span<const std::byte> body, std::string_view key) {
  auto doc = ParseMsgpack(body);
  return doc.ok() && FindKey(doc->get(), key) != nullptr;
}

TEST(GenerateCodecTest, OnlyTheFinalResponseCarriesFinishReason) {
  const GenerateResponse first{.request_id = "r", .token_ids = {5}, .index = 0};
  const GenerateResponse last{.request_id = "r",
                              .token_ids = {6, 7},
                              .index = 1,
                              .finish_reason = "length",
                              .cached_tokens = 64,
                              .prompt_tokens = 100,
                              .ttft_ms = 12.5};
  const auto a = first.Encode(), b = last.Encode();
  EXPECT_FALSE(HasKey(AsBytes(a), "finish_reason"));
  EXPECT_TRUE(HasKey(AsBytes(b), "finish_reason"));
  EXPECT_FALSE(HasKey(AsBytes(b), "message"));
  auto da = GenerateResponse::Decode(AsBytes(a));
  auto db = GenerateResponse::Decode(AsBytes(b));
  ASSERT_TRUE(da.ok() && db.ok());
  EXPECT_EQ(*da, first);
  EXPECT_EQ(*db, last);
  EXPECT_FALSE(da->is_final());
  EXPECT_TRUE(db->is_final());
}

TEST(GenerateCodecTest, RequestDefaultsAndLimits) {
  const GenerateRequest req{.request_id = "r", .token_ids = {1, 2, 3}, .max_tokens = 4, .dp_rank = 1};
  auto rt = GenerateRequest::Decode(AsBytes(req.Encode()));
  ASSERT_TRUE(rt.ok());
  EXPECT_EQ(*rt, req);

  msgpack::sbuffer minimal;
  msgpack::packer<msgpack::sbuffer> pk(minimal);
  pk.pack_map(2);
  PackKey(pk, "request_id");
  pk.pack("m");
  PackKey(pk, "token_ids");
  pk.pack_array(0);
  auto m = GenerateRequest::Decode(AsBytes(minimal));
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->max_tokens, 16u);
  EXPECT_EQ(m->dp_rank, 0u);

  GenerateRequest zero = req;
  zero.max_tokens = 0;
  auto z = GenerateRequest::Decode(AsBytes(zero.Encode()));
  ASSERT_FALSE(z.ok());
  EXPECT_NE(z.status().message().find("max_tokens"), std::string::npos);
}

TEST(RecoveryCodecTest, ReplyRoundTripsThroughTheDynamoEventGrammar) {
  RecoveryReply reply{.kind = "events", .last_event_id = 9};
  KvEventBatch stored = StoredPromptBatch(42, 8, std::vector<std::uint32_t>{1, 2, 3, 4, 5, 6, 7, 8}, 4);
  stored.dp_rank = 1;
  KvEventBatch removed{.worker_id = 42, .dp_rank = 1, .sequence = {SequenceKind::kEventId, 9}};
  removed.ops.resize(1);  // (push_back of a braced KvOp trips a GCC 12 -Wmaybe-uninitialized under ASan)
  removed.ops[0].data = KvRemoved{{11, 12}};
  KvEventBatch offloaded = StoredPromptBatch(42, 10, std::vector<std::uint32_t>{1, 2, 3, 4}, 4);
  offloaded.dp_rank = 1;
  offloaded.ops[0].tier = StorageTier::kHostPinned;  // a replayed event keeps its tier
  reply.events = {stored, removed, offloaded};
  auto back = DecodeRecoveryReply(AsBytes(EncodeRecoveryReply(reply)), 42);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->kind, "events");
  EXPECT_EQ(back->last_event_id, 9u);
  EXPECT_EQ(back->events, reply.events);

  const RecoveryReply too_new{.kind = "too_new", .last_event_id = 3, .message = "m"};
  auto tn = DecodeRecoveryReply(AsBytes(EncodeRecoveryReply(too_new)), 42);
  ASSERT_TRUE(tn.ok());
  EXPECT_EQ(tn->message, "m");
  EXPECT_TRUE(tn->events.empty());
}

// ---- Recovery query ----

TEST(RecoveryCodecTest, QueryRoundTripsWithAndWithoutBounds) {
  for (const RecoveryQuery& q : {RecoveryQuery{}, RecoveryQuery{.start_event_id = 0},
                                 RecoveryQuery{.start_event_id = 5, .end_event_id = ~0ull}}) {
    auto back = RecoveryQuery::Decode(AsBytes(q.Encode()));
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(*back, q);
  }
  TestPacker empty;  // {}: a tree dump
  empty.pk.pack_map(0);
  auto e = RecoveryQuery::Decode(empty.bytes());
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(*e, RecoveryQuery{});
}

TEST(RecoveryCodecTest, BadQueriesAreInvalidArgument) {
  TestPacker negative;
  negative.pk.pack_map(1);
  negative.Key("start_event_id");
  negative.pk.pack(-1);
  ExpectInvalid(RecoveryQuery::Decode(negative.bytes()), "start_event_id");
  TestPacker text;
  text.pk.pack_map(1);
  text.Key("end_event_id");
  text.pk.pack("9");
  ExpectInvalid(RecoveryQuery::Decode(text.bytes()), "end_event_id");
  ExpectInvalid(RecoveryQuery::Decode(AsBytes(std::string_view("\x91\x01", 2))), "must be a map");
  const auto body = RecoveryQuery{.start_event_id = 300, .end_event_id = 70000}.Encode();
  ExpectEveryTruncationFails(AsBytes(body), [](auto b) { return RecoveryQuery::Decode(b); });
}

// ---- Recovery reply ----

TEST(RecoveryCodecTest, EveryKindRoundTrips) {
  KvEventBatch chain = StoredPromptBatch(42, 12, std::vector<std::uint32_t>{1, 2, 3, 4, 5, 6, 7, 8}, 4);
  KvEventBatch child{.worker_id = 42, .sequence = {SequenceKind::kEventId, 12}};
  child.ops.resize(1);
  child.ops[0].data = KvStored{std::get<KvStored>(chain.ops[0].data).blocks.back().block_hash, {{0x77, 0x78}}};
  KvEventBatch cleared{.worker_id = 42, .dp_rank = 2, .sequence = {SequenceKind::kEventId, 11}};
  cleared.ops.resize(1);
  cleared.ops[0].data = KvCleared{};
  const std::vector<RecoveryReply> replies = {
      {.kind = "tree_dump", .events = {chain, child}, .last_event_id = 12},
      {.kind = "events", .events = {cleared, Removed(42, 12, {1, ~0ull})}, .last_event_id = 12},
      {.kind = "tree_dump", .last_event_id = 0},
      {.kind = "invalid_range", .last_event_id = 4, .message = "end_event_id 3 < start_event_id 4"},
      {.kind = "error", .message = "no"},
  };
  for (const RecoveryReply& reply : replies) {
    auto back = DecodeRecoveryReply(AsBytes(EncodeRecoveryReply(reply)), 42);
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(*back, reply) << reply.kind;
  }
}

TEST(RecoveryCodecTest, ReplyEventsBelongToTheQueriedWorkerOnTheDeviceTier) {
  const RecoveryReply reply{.kind = "events", .events = {Removed(42, 1, {5})}, .last_event_id = 1};
  auto back = DecodeRecoveryReply(AsBytes(EncodeRecoveryReply(reply)), 7);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ASSERT_EQ(back->events.size(), 1u);
  EXPECT_EQ(back->events[0].worker_id, 7u);
  EXPECT_EQ(back->events[0].ops.at(0).tier, StorageTier::kDevice);
}

TEST(RecoveryCodecTest, MissingOrNilEventsAreNone) {
  for (bool nil : {false, true}) {
    TestPacker p;
    p.pk.pack_map(nil ? 2 : 1);
    p.Key("kind");
    p.pk.pack("too_new");
    if (nil) {
      p.Key("events");
      p.pk.pack_nil();
    }
    auto r = DecodeRecoveryReply(p.bytes(), 1);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->kind, "too_new");
    EXPECT_TRUE(r->events.empty());
    EXPECT_EQ(r->last_event_id, 0u);
  }
}

// A recovery reply {kind, events: <packed by pack_events>}.
template <typename PackEvents>
std::string ReplyWithEvents(std::string_view kind, PackEvents pack_events) {
  TestPacker p;
  p.pk.pack_map(2);
  p.Key("kind");
  p.pk.pack(kind);
  p.Key("events");
  pack_events(p);
  return p.str();
}

// A KvCacheEvent {event_id, data: <a string>}.
void PackEvent(TestPacker& p, std::uint64_t event_id, std::string_view data) {
  p.pk.pack_map(2);
  p.Key("event_id");
  p.pk.pack(event_id);
  p.Key("data");
  p.pk.pack(data);
}

TEST(RecoveryCodecTest, BadRepliesAreInvalidArgumentNamingThePart) {
  TestPacker no_kind;
  no_kind.pk.pack_map(1);
  no_kind.Key("last_event_id");
  no_kind.pk.pack(1);
  ExpectInvalid(DecodeRecoveryReply(no_kind.bytes(), 1), "kind");

  const auto not_array = ReplyWithEvents("events", [](TestPacker& p) { p.pk.pack(3); });
  ExpectInvalid(DecodeRecoveryReply(AsBytes(not_array), 1), "events");

  const auto bad_second = ReplyWithEvents("events", [](TestPacker& p) {
    p.pk.pack_array(2);
    PackEvent(p, 1, "cleared");
    PackEvent(p, 2, "teleported");  // an unknown kind of data
  });
  ExpectInvalid(DecodeRecoveryReply(AsBytes(bad_second), 1), "events[1]");

  const auto not_map = ReplyWithEvents("events", [](TestPacker& p) {
    p.pk.pack_array(1);
    p.pk.pack(5);
  });
  ExpectInvalid(DecodeRecoveryReply(AsBytes(not_map), 1), "events[0]");

  ExpectInvalid(DecodeRecoveryReply(AsBytes(std::string_view("\xc1", 1)), 1), "");
}

TEST(RecoveryCodecTest, HugeDeclaredEventArrayIsRefusedWithoutAllocating) {
  const std::string body = ReplyWithEvents("tree_dump", [](TestPacker&) {}) + std::string(kHugeArrayHeader);
  auto r = DecodeRecoveryReply(AsBytes(body), 1);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
}

TEST(RecoveryCodecTest, EveryTruncatedReplyFails) {
  const RecoveryReply reply{
      .kind = "tree_dump",
      .events = {StoredPromptBatch(3, 2, std::vector<std::uint32_t>{1, 2, 3, 4}, 4), Removed(3, 2, {9})},
      .last_event_id = 2};
  ExpectEveryTruncationFails(AsBytes(EncodeRecoveryReply(reply)), [](auto b) { return DecodeRecoveryReply(b, 3); });
}

// ---- Generate ----

TEST(GenerateCodecTest, ErrorResponseCarriesItsMessage) {
  const GenerateResponse error{
      .request_id = "r", .finish_reason = "error", .prompt_tokens = 9, .message = "prompt too long"};
  const auto body = error.Encode();
  EXPECT_TRUE(HasKey(AsBytes(body), "message"));
  auto back = GenerateResponse::Decode(AsBytes(body));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, error);
}

TEST(GenerateCodecTest, BadRequestsAreInvalidArgumentNamingTheField) {
  TestPacker no_tokens;
  no_tokens.pk.pack_map(1);
  no_tokens.Key("request_id");
  no_tokens.pk.pack("r");
  ExpectInvalid(GenerateRequest::Decode(no_tokens.bytes()), "token_ids");

  TestPacker big_token;
  big_token.pk.pack_map(2);
  big_token.Key("request_id");
  big_token.pk.pack("r");
  big_token.Key("token_ids");
  big_token.pk.pack(std::vector<std::uint64_t>{1, 1ull << 32});
  ExpectInvalid(GenerateRequest::Decode(big_token.bytes()), "token_ids");

  GenerateRequest too_many{.request_id = "r", .token_ids = {1}, .max_tokens = kMaxGenerateTokens + 1};
  ExpectInvalid(GenerateRequest::Decode(AsBytes(too_many.Encode())), "max_tokens");
  too_many.max_tokens = kMaxGenerateTokens;
  EXPECT_TRUE(GenerateRequest::Decode(AsBytes(too_many.Encode())).ok());

  TestPacker no_id;
  no_id.pk.pack_map(1);
  no_id.Key("token_ids");
  no_id.pk.pack_array(0);
  ExpectInvalid(GenerateResponse::Decode(no_id.bytes()), "request_id");

  // A time to first token is a finite duration: NaN, infinities and negatives are refused.
  for (const double bad : {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(), -1.0}) {
    const GenerateResponse timed{.request_id = "r", .token_ids = {}, .finish_reason = "stop", .ttft_ms = bad};
    ExpectInvalid(GenerateResponse::Decode(AsBytes(timed.Encode())), "ttft_ms");
  }

  const GenerateRequest req{.request_id = "abc", .token_ids = {1, 70000}, .max_tokens = 3};
  ExpectEveryTruncationFails(AsBytes(req.Encode()), [](auto b) { return GenerateRequest::Decode(b); });
  const GenerateResponse fin{
      .request_id = "abc", .token_ids = {2}, .index = 1, .finish_reason = "stop", .ttft_ms = 3.5};
  ExpectEveryTruncationFails(AsBytes(fin.Encode()), [](auto b) { return GenerateResponse::Decode(b); });
}

}  // namespace
}  // namespace kvrouter

namespace kvrouter {
namespace {

TEST(GenerateResponseCodec, FinalityIsReadFromFinishReasonAlone) {
  GenerateResponse first{.request_id = "r", .token_ids = {1}};
  GenerateResponse last{.request_id = "r", .token_ids = {}, .index = 1, .finish_reason = "stop"};
  EXPECT_FALSE(*IsFinalGenerateResponse(AsBytes(first.Encode())));
  EXPECT_TRUE(*IsFinalGenerateResponse(AsBytes(last.Encode())));
  // A worker that writes only the keys that matter to a relay is understood too.
  msgpack::sbuffer minimal;
  msgpack::packer<msgpack::sbuffer> pk(minimal);
  pk.pack_map(1);
  PackKey(pk, "finish_reason");
  pk.pack("length");
  EXPECT_TRUE(*IsFinalGenerateResponse(AsBytes(minimal)));
  EXPECT_FALSE(IsFinalGenerateResponse(AsBytes(std::string_view("\x93\x01\x02\x03", 4))).ok());
}

}  // namespace
}  // namespace kvrouter

namespace kvrouter {
namespace {

TEST(RecoveryCodecTest, ASmallReplyIsOnePartWithoutMore) {
  RecoveryReply r{.kind = "events", .last_event_id = 3};
  r.events.push_back(StoredPromptBatch(1, 3, std::vector<std::uint32_t>{1, 2, 3, 4}, 4));
  auto parts = EncodeRecoveryReplyParts(r, 1 << 20);
  ASSERT_TRUE(parts.ok());
  ASSERT_EQ(parts->size(), 1u);
  auto back = DecodeRecoveryReply(AsBytes((*parts)[0]), 1);
  ASSERT_TRUE(back.ok());
  EXPECT_FALSE(back->more);
  EXPECT_EQ(back->events.size(), 1u);
}

TEST(RecoveryCodecTest, ARangeEventIsNeverCutAndOneTooLargeIsAnError) {
  std::vector<std::uint32_t> tokens(4 * 500);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::uint32_t>(i);
  RecoveryReply r{.kind = "events", .last_event_id = 1};
  r.events.push_back(StoredPromptBatch(1, 1, tokens, 4));  // 500 blocks, ~21 KB
  EXPECT_FALSE(EncodeRecoveryReplyParts(r, 4096).ok());
  r.kind = "tree_dump";  // a dump's chain may be cut
  auto parts = EncodeRecoveryReplyParts(r, 4096);
  ASSERT_TRUE(parts.ok()) << parts.status().ToString();
  EXPECT_GT(parts->size(), 1u);
  std::optional<BlockHash> last;
  std::size_t blocks = 0;
  for (const auto& part : *parts) {
    auto back = DecodeRecoveryReply(AsBytes(part), 1);
    ASSERT_TRUE(back.ok());
    for (const auto& b : back->events) {
      const auto& s = std::get<KvStored>(b.ops.at(0).data);
      EXPECT_EQ(s.parent_hash, last);  // consecutive chains: each hangs under the one before
      last = s.blocks.back().block_hash;
      blocks += s.blocks.size();
    }
  }
  EXPECT_EQ(blocks, 500u);
}

}  // namespace
}  // namespace kvrouter
