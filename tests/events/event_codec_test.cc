#include "events/event_codec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "events/msgpack_reader.h"
#include "tests/events/test_packer.h"

namespace kvrouter {
namespace {

using ::testing::HasSubstr;

KvEventBatch StoredBatch() {
  KvEventBatch b{.worker_id = 42, .dp_rank = 3, .sequence = {SequenceKind::kEventId, 17}};
  b.ops.push_back({StorageTier::kDevice, KvStored{0x1111, {{0xa1, 0xb1}, {0xa2, 0xb2}, {0xffffffffffffffffull, 0}}}});
  return b;
}

KvEventBatch WithData(KvEventData data, StorageTier tier = StorageTier::kDevice) {
  KvEventBatch b{.worker_id = 9, .dp_rank = 0, .sequence = {SequenceKind::kEventId, 1}};
  b.ops.push_back({tier, std::move(data)});
  return b;
}

// Packs {worker_id: 5, event: {event_id: 1, data: <written by pack_data>}} with extra keys.
template <typename PackData>
std::string RouterEventWith(PackData pack_data) {
  TestPacker p;
  p.pk.pack_map(2);
  p.Key("worker_id");
  p.pk.pack_fix_uint8(5);
  p.Key("event");
  p.pk.pack_map(2);
  p.Key("event_id");
  p.pk.pack_fix_uint16(1);
  p.Key("data");
  pack_data(p);
  return p.str();
}

void ExpectInvalid(std::span<const std::byte> body, std::string_view message_part) {
  auto r = DecodeDynamoEvent(body);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr(std::string(message_part)));
}

TEST(DynamoEventCodec, StoredChainRoundTrips) {
  const KvEventBatch batch = StoredBatch();
  auto body = EncodeDynamoEnvelope(batch, {.publisher_id = 42, .sequence = 3});
  auto decoded = DecodeDynamoEvent(AsBytes(body));
  ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
  EXPECT_EQ(*decoded, batch);
}

TEST(DynamoEventCodec, RemovedAndClearedRoundTrip) {
  for (const KvEventBatch& batch : {WithData(KvRemoved{{1, 2, 0x8000000000000000ull}}), WithData(KvCleared{}),
                                    WithData(KvStored{std::nullopt, {{1, 2}}}, StorageTier::kHostPinned),
                                    WithData(KvRemoved{{7}}, StorageTier::kExternal)}) {
    auto decoded = DecodeDynamoEvent(AsBytes(EncodeDynamoEnvelope(batch, {})));
    ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
    EXPECT_EQ(*decoded, batch);
  }
}

TEST(DynamoEventCodec, BareRouterEventIsAccepted) {
  const KvEventBatch batch = StoredBatch();
  auto decoded = DecodeDynamoEvent(AsBytes(EncodeRouterEvent(batch)));
  ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
  EXPECT_EQ(*decoded, batch);
}

TEST(KvCacheEventCodec, PackedEventDecodesWithTheGivenWorkerAndTier) {
  KvEventBatch batch = StoredBatch();
  msgpack::sbuffer buf;
  PackKvCacheEvent(buf, batch);
  auto doc = ParseMsgpack(AsBytes(buf));
  ASSERT_TRUE(doc.ok()) << doc.status().ToString();
  EXPECT_EQ(FindKey(doc->get(), "worker_id"), nullptr);  // only {event_id, dp_rank, data}
  auto decoded = DecodeKvCacheEvent(doc->get(), 42, StorageTier::kDevice);
  ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
  EXPECT_EQ(*decoded, batch);
  auto other = DecodeKvCacheEvent(doc->get(), 8, StorageTier::kDisk);
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(other->worker_id, 8u);
  EXPECT_EQ(other->ops.at(0).tier, StorageTier::kDisk);
}

TEST(KvCacheEventCodec, TheRouterEventCarriesThePackedEventUnchanged) {
  const KvEventBatch batch = StoredBatch();
  msgpack::sbuffer event;
  PackKvCacheEvent(event, batch);
  const msgpack::sbuffer router_event = EncodeRouterEvent(batch);
  const std::string whole(router_event.data(), router_event.size());
  EXPECT_NE(whole.find(std::string(event.data(), event.size())), std::string::npos);
}

TEST(KvCacheEventCodec, NonMapEventIsAnError) {
  TestPacker p;
  p.pk.pack_array(1);
  p.pk.pack(1);
  auto doc = ParseMsgpack(p.bytes());
  ASSERT_TRUE(doc.ok());
  auto r = DecodeKvCacheEvent(doc->get(), 1, StorageTier::kDevice);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
}

TEST(DynamoEventCodec, EnvelopeCarriesTheHeader) {
  auto body = EncodeDynamoEnvelope(StoredBatch(),
                                   {.publisher_id = 42, .sequence = 3, .published_at_ms = 1700000000000, .topic = "t"});
  auto doc = ParseMsgpack(AsBytes(body));
  ASSERT_TRUE(doc.ok());
  EXPECT_EQ(*ReadU64(FindKey(doc->get(), "publisher_id"), "publisher_id"), 42u);
  EXPECT_EQ(*ReadU64(FindKey(doc->get(), "sequence"), "sequence"), 3u);
  EXPECT_EQ(*ReadU64(FindKey(doc->get(), "published_at"), "published_at"), 1700000000000u);
  EXPECT_EQ(*ReadStr(FindKey(doc->get(), "topic"), "topic"), "t");
  EXPECT_EQ(FindKey(doc->get(), "payload")->type, msgpack::type::BIN);
}

TEST(DynamoEventCodec, DeviceTierIsNotWritten) {
  auto doc = ParseMsgpack(AsBytes(EncodeRouterEvent(StoredBatch())));
  ASSERT_TRUE(doc.ok());
  EXPECT_EQ(FindKey(doc->get(), "storage_tier"), nullptr);
}

TEST(DynamoEventCodec, NegativeHashIsReinterpreted) {
  auto body = RouterEventWith([](TestPacker& p) {
    p.pk.pack_map(1);
    p.Key("stored");
    p.pk.pack_map(2);
    p.Key("parent_hash");
    p.pk.pack_fix_int64(-1);
    p.Key("blocks");
    p.pk.pack_array(1);
    p.pk.pack_map(2);
    p.Key("block_hash");
    p.pk.pack_fix_int8(-2);
    p.Key("tokens_hash");
    p.pk.pack_int64(-3);
  });
  auto r = DecodeDynamoEvent(AsBytes(body));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const auto& stored = std::get<KvStored>(r->ops.at(0).data);
  EXPECT_EQ(stored.parent_hash, 0xffffffffffffffffull);
  ASSERT_EQ(stored.blocks.size(), 1u);
  EXPECT_EQ(stored.blocks[0].block_hash, 0xfffffffffffffffeull);
  EXPECT_EQ(stored.blocks[0].tokens_hash, 0xfffffffffffffffdull);
}

TEST(DynamoEventCodec, NarrowIntegerWidthsAreAccepted) {
  auto body = RouterEventWith([](TestPacker& p) {
    p.pk.pack_map(1);
    p.Key("removed");
    p.pk.pack_map(1);
    p.Key("block_hashes");
    p.pk.pack_array(3);
    p.pk.pack_fix_uint8(1);
    p.pk.pack_fix_uint16(2);
    p.pk.pack_fix_uint32(3);
  });
  auto r = DecodeDynamoEvent(AsBytes(body));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->worker_id, 5u);
  EXPECT_EQ(r->sequence, (EventSequence{SequenceKind::kEventId, 1}));
  EXPECT_EQ(r->ops.at(0).data, KvEventData(KvRemoved{{1, 2, 3}}));
}

TEST(DynamoEventCodec, NilParentHashStartsAChainAndDpRankDefaultsToZero) {
  auto body = RouterEventWith([](TestPacker& p) {
    p.pk.pack_map(1);
    p.Key("stored");
    p.pk.pack_map(2);
    p.Key("parent_hash");
    p.pk.pack_nil();
    p.Key("blocks");
    p.pk.pack_array(0);
  });
  auto r = DecodeDynamoEvent(AsBytes(body));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->dp_rank, 0u);
  EXPECT_EQ(r->ops.at(0).tier, StorageTier::kDevice);
  EXPECT_EQ(std::get<KvStored>(r->ops.at(0).data).parent_hash, std::nullopt);
}

TEST(DynamoEventCodec, UnknownKeysAreIgnored) {
  TestPacker inner;
  inner.pk.pack_map(4);
  inner.Key("worker_id");
  inner.pk.pack(8);
  inner.Key("future_field");
  inner.pk.pack_array(2);
  inner.pk.pack(1);
  inner.pk.pack("x");
  inner.Key("event");
  inner.pk.pack_map(4);
  inner.Key("event_id");
  inner.pk.pack(2);
  inner.Key("dp_rank");
  inner.pk.pack(1);
  inner.Key("extra");
  inner.pk.pack_nil();
  inner.Key("data");
  inner.pk.pack_map(1);
  inner.Key("stored");
  inner.pk.pack_map(3);
  inner.Key("parent_hash");
  inner.pk.pack(77);
  inner.Key("something");
  inner.pk.pack(true);
  inner.Key("blocks");
  inner.pk.pack_array(1);
  inner.pk.pack_map(4);
  inner.Key("block_hash");
  inner.pk.pack(10);
  inner.Key("mm_extra_info");
  inner.pk.pack_map(1);
  inner.Key("mm_hashes");
  inner.pk.pack_array(0);
  inner.Key("tokens_hash");
  inner.pk.pack(20);
  inner.Key("more");
  inner.pk.pack(1.5);
  inner.Key("trailing");
  inner.pk.pack("x");

  TestPacker envelope;
  envelope.pk.pack_map(3);
  envelope.Key("payload");
  envelope.Bin(inner.str());
  envelope.Key("topic");
  envelope.pk.pack(42);  // informational fields are not checked
  envelope.Key("unknown");
  envelope.pk.pack_nil();

  auto r = DecodeDynamoEvent(envelope.bytes());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  KvEventBatch want{.worker_id = 8, .dp_rank = 1, .sequence = {SequenceKind::kEventId, 2}};
  want.ops.push_back({StorageTier::kDevice, KvStored{77, {{10, 20}}}});
  EXPECT_EQ(*r, want);
}

TEST(DynamoEventCodec, UnknownEventKindIsAnError) {
  auto foo = RouterEventWith([](TestPacker& p) {
    p.pk.pack_map(1);
    p.Key("foo");
    p.pk.pack_map(0);
  });
  ExpectInvalid(AsBytes(foo), "unknown event kind 'foo'");
  auto wiped = RouterEventWith([](TestPacker& p) { p.pk.pack("wiped"); });
  ExpectInvalid(AsBytes(wiped), "unknown event kind 'wiped'");
}

TEST(DynamoEventCodec, DataWithTwoKindsIsAnError) {
  auto body = RouterEventWith([](TestPacker& p) {
    p.pk.pack_map(2);
    p.Key("removed");
    p.pk.pack_map(1);
    p.Key("block_hashes");
    p.pk.pack_array(0);
    p.Key("cleared");
    p.pk.pack_nil();
  });
  ExpectInvalid(AsBytes(body), "'data'");
}

TEST(DynamoEventCodec, ClearedAsAMapKeyIsAccepted) {
  auto body = RouterEventWith([](TestPacker& p) {
    p.pk.pack_map(1);
    p.Key("cleared");
    p.pk.pack_nil();
  });
  auto r = DecodeDynamoEvent(AsBytes(body));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->ops.at(0).data, KvEventData(KvCleared{}));
}

TEST(DynamoEventCodec, StorageTierIsDecoded) {
  TestPacker p;
  p.pk.pack_map(3);
  p.Key("worker_id");
  p.pk.pack(1);
  p.Key("storage_tier");
  p.pk.pack("disk");
  p.Key("event");
  p.pk.pack_map(2);
  p.Key("event_id");
  p.pk.pack(1);
  p.Key("data");
  p.pk.pack("cleared");
  auto r = DecodeDynamoEvent(p.bytes());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->ops.at(0).tier, StorageTier::kDisk);
}

TEST(DynamoEventCodec, UnknownStorageTierIsAnError) {
  TestPacker p;
  p.pk.pack_map(3);
  p.Key("worker_id");
  p.pk.pack(1);
  p.Key("storage_tier");
  p.pk.pack("GPU");
  p.Key("event");
  p.pk.pack_map(2);
  p.Key("event_id");
  p.pk.pack(1);
  p.Key("data");
  p.pk.pack("cleared");
  ExpectInvalid(p.bytes(), "storage_tier");
}

TEST(DynamoEventCodec, MissingRequiredFieldsAreNamed) {
  TestPacker no_worker;
  no_worker.pk.pack_map(1);
  no_worker.Key("event");
  no_worker.pk.pack_map(0);
  ExpectInvalid(no_worker.bytes(), "missing field 'worker_id'");

  TestPacker no_event_id;
  no_event_id.pk.pack_map(2);
  no_event_id.Key("worker_id");
  no_event_id.pk.pack(1);
  no_event_id.Key("event");
  no_event_id.pk.pack_map(1);
  no_event_id.Key("data");
  no_event_id.pk.pack("cleared");
  ExpectInvalid(no_event_id.bytes(), "missing field 'event_id'");

  TestPacker no_data;
  no_data.pk.pack_map(2);
  no_data.Key("worker_id");
  no_data.pk.pack(1);
  no_data.Key("event");
  no_data.pk.pack_map(1);
  no_data.Key("event_id");
  no_data.pk.pack(1);
  ExpectInvalid(no_data.bytes(), "missing field 'data'");

  auto no_tokens_hash = RouterEventWith([](TestPacker& p) {
    p.pk.pack_map(1);
    p.Key("stored");
    p.pk.pack_map(1);
    p.Key("blocks");
    p.pk.pack_array(1);
    p.pk.pack_map(1);
    p.Key("block_hash");
    p.pk.pack(1);
  });
  ExpectInvalid(AsBytes(no_tokens_hash), "missing field 'tokens_hash'");
}

TEST(DynamoEventCodec, WrongTypesAreNamed) {
  auto str_hash = RouterEventWith([](TestPacker& p) {
    p.pk.pack_map(1);
    p.Key("removed");
    p.pk.pack_map(1);
    p.Key("block_hashes");
    p.pk.pack_array(2);
    p.pk.pack(1);
    p.pk.pack("2");
  });
  ExpectInvalid(AsBytes(str_hash), "'block_hashes'");

  TestPacker negative_worker;
  negative_worker.pk.pack_map(2);
  negative_worker.Key("worker_id");
  negative_worker.pk.pack(-1);
  negative_worker.Key("event");
  negative_worker.pk.pack_map(0);
  ExpectInvalid(negative_worker.bytes(), "'worker_id'");

  auto blocks_not_array = RouterEventWith([](TestPacker& p) {
    p.pk.pack_map(1);
    p.Key("stored");
    p.pk.pack_map(1);
    p.Key("blocks");
    p.pk.pack(3);
  });
  ExpectInvalid(AsBytes(blocks_not_array), "'blocks'");
}

TEST(DynamoEventCodec, BodyThatIsNotAMapIsAnError) {
  TestPacker p;
  p.pk.pack_array(0);
  ExpectInvalid(p.bytes(), "must be a map");
}

TEST(DynamoEventCodec, PayloadThatIsNotBinIsAnError) {
  TestPacker p;
  p.pk.pack_map(1);
  p.Key("payload");
  p.pk.pack("not bin");
  ExpectInvalid(p.bytes(), "'payload'");
}

TEST(DynamoEventCodec, TruncatedBodyIsAnError) {
  auto body = EncodeDynamoEnvelope(StoredBatch(), {});
  ExpectEveryTruncationFails(AsBytes(body), DecodeDynamoEvent);
  ExpectEveryTruncationFails(AsBytes(EncodeRouterEvent(StoredBatch())), DecodeDynamoEvent);
}

TEST(DynamoEventCodec, TruncatedPayloadIsAnError) {
  auto full = EncodeRouterEvent(StoredBatch());
  TestPacker p;
  p.pk.pack_map(1);
  p.Key("payload");
  p.Bin(std::string_view(full.data(), full.size() - 1));
  ExpectInvalid(p.bytes(), "payload");
}

TEST(DynamoEventCodec, HugeDeclaredArrayIsRefusedWithoutAllocating) {
  auto body = RouterEventWith([](TestPacker& p) {
    p.pk.pack_map(1);
    p.Key("removed");
    p.pk.pack_map(1);
    p.Key("block_hashes");
  });
  body += std::string(kHugeArrayHeader) + "\x01";
  ExpectInvalid(AsBytes(body), "declares 4294967295 elements");
}

TEST(DynamoEventCodec, DeepNestingIsRefused) {
  auto body = RouterEventWith([](TestPacker& p) {
    p.pk.pack_map(1);
    p.Key("stored");
    for (int i = 0; i < 20; ++i) {
      p.pk.pack_map(1);
      p.Key("blocks");
    }
    p.pk.pack_array(0);
  });
  ExpectInvalid(AsBytes(body), "nests deeper");
}

// ---- the pull decoder against the tree decoder -------------------------------------------

std::string AsString(const msgpack::sbuffer& b) { return {b.data(), b.size()}; }

std::vector<std::string> PublishedShapes() {
  std::vector<std::string> out;
  KvEventBatch removed = WithData(KvRemoved{{1, 0xfffffffffffffff0ull, 3}}, StorageTier::kHostPinned);
  removed.dp_rank = 7;
  for (const KvEventBatch& b : {StoredBatch(), removed, WithData(KvCleared{}),
                                WithData(KvStored{std::nullopt, {{5, 6}}}, StorageTier::kDisk)}) {
    out.push_back(AsString(EncodeDynamoEnvelope(b, {.publisher_id = 3, .sequence = 9})));
    out.push_back(AsString(EncodeRouterEvent(b)));
  }
  return out;
}

TEST(DynamoEventPull, TakesEveryShapeWorkersPublishWithTheTreeDecodersResult) {
  for (const std::string& body : PublishedShapes()) {
    const auto pulled = DecodeDynamoEventPull(AsBytes(body));
    const auto tree = DecodeDynamoEventTree(AsBytes(body));
    ASSERT_TRUE(tree.ok()) << tree.status().message();
    ASSERT_TRUE(pulled.has_value()) << "the fast path must take what workers publish";
    EXPECT_EQ(*pulled, *tree);
  }
}

// Every byte of every shape replaced by values that change its meaning, and every truncation:
// whatever the pull decoder accepts, the tree decoder accepts with the same batch.
TEST(DynamoEventPull, NeverAcceptsWhatTheTreeDecoderRefusesOrReadsDifferently) {
  std::size_t pulled_variants = 0, variants = 0;
  for (const std::string& shape : PublishedShapes()) {
    std::vector<std::string> bodies;
    for (std::size_t i = 0; i < shape.size(); ++i) {
      bodies.push_back(shape.substr(0, i));
      // The boundaries of every form the pull reader reads inline (fixmap, fixstr, fixint,
      // uint64, the scalars Skip passes over) and of the general forms.
      for (unsigned v : {0x00u,
                         0x01u,
                         0x7fu,
                         0x80u,
                         0x81u,
                         0x8fu,
                         0x90u,
                         0xa1u,
                         0xbfu,
                         0xc0u,
                         0xc1u,
                         0xc2u,
                         0xc4u,
                         0xccu,
                         0xcdu,
                         0xcfu,
                         0xd0u,
                         0xd3u,
                         0xd9u,
                         0xdeu,
                         0xe0u,
                         0xffu,
                         (static_cast<unsigned char>(shape[i]) + 1u) & 0xffu}) {
        std::string b = shape;
        b[i] = static_cast<char>(v);
        bodies.push_back(std::move(b));
      }
    }
    for (const std::string& body : bodies) {
      ++variants;
      const auto pulled = DecodeDynamoEventPull(AsBytes(body));
      if (!pulled) continue;
      ++pulled_variants;
      const auto tree = DecodeDynamoEventTree(AsBytes(body));
      ASSERT_TRUE(tree.ok()) << "pull accepted what the tree refuses: " << tree.status().message();
      ASSERT_EQ(*pulled, *tree);
      const auto both = DecodeDynamoEvent(AsBytes(body));
      ASSERT_TRUE(both.ok());
      EXPECT_EQ(*both, *tree);
    }
  }
  // The mutations must exercise acceptance too (values, widths, keys changed in place).
  EXPECT_GT(pulled_variants, variants / 20);
}

TEST(DynamoEventPull, LeavesDuplicateKeysAndOddTypesToTheTreeDecoder) {
  // A repeated worker_id: the tree decoder reads the first; the pull decoder declines.
  TestPacker p;
  p.pk.pack_map(3);
  p.Key("worker_id");
  p.pk.pack_uint64(5);
  p.Key("worker_id");
  p.pk.pack_uint64(6);
  p.Key("event");
  p.pk.pack_map(2);
  p.Key("event_id");
  p.pk.pack_uint64(1);
  p.Key("data");
  p.pk.pack(std::string("cleared"));
  EXPECT_FALSE(DecodeDynamoEventPull(AsBytes(p.str())).has_value());
  auto both = DecodeDynamoEvent(AsBytes(p.str()));
  ASSERT_TRUE(both.ok());
  EXPECT_EQ(both->worker_id, 5u);
}

// The ingest path decodes into batches the index hands back (ShardedIndex::Spare): whatever a
// batch held before, decoding into it gives exactly what a fresh decode gives.
TEST(DynamoEventInto, AUsedBatchDecodesAsAFreshOne) {
  std::vector<std::string> bodies = PublishedShapes();
  // One only the tree decoder takes (a key twice): the pull decoder writes part of it first.
  bodies.push_back(RouterEventWith([](TestPacker& p) {
    p.pk.pack_map(1);
    p.Key("stored");
    p.pk.pack_map(2);
    p.Key("blocks");
    p.pk.pack_array(0);
    p.Key("blocks");
    p.pk.pack_array(0);
  }));
  ASSERT_FALSE(DecodeDynamoEventPull(AsBytes(bodies.back())).has_value());
  KvEventBatch several = StoredBatch();  // more than one op, a sequence of another kind
  several.ops.push_back({StorageTier::kDisk, KvRemoved{{1, 2}}});
  several.sequence = {SequenceKind::kVllmSeq, 99};
  std::size_t reused = 0;
  for (const std::string& before : bodies) {
    for (const std::string& body : bodies) {
      for (bool stale_several : {false, true}) {
        KvEventBatch used = stale_several ? several : DecodeDynamoEvent(AsBytes(before)).value();
        const void* memory = used.ops.data();
        ASSERT_TRUE(DecodeDynamoEventInto(AsBytes(body), used).ok());
        const auto fresh = DecodeDynamoEvent(AsBytes(body));
        ASSERT_TRUE(fresh.ok());
        EXPECT_EQ(used, *fresh);
        reused += used.ops.data() == memory;
      }
    }
  }
  EXPECT_GT(reused, bodies.size() * bodies.size());  // the memory is kept, not reallocated
  // An error is an error, into a used batch too.
  KvEventBatch used = StoredBatch();
  EXPECT_FALSE(DecodeDynamoEventInto(AsBytes(std::string("\x81\xa7payload\xc0")), used).ok());
}

// A dump's chain (PackStoredEvent) decodes as the §6 event it is, storage_tier included, and
// stays within the size bound a dump reply is planned with, at the widest values.
TEST(StoredEventCodec, ADumpChainDecodesAsItsEventAndKeepsItsSizeBound) {
  const std::uint64_t big = ~std::uint64_t{0};
  const KvStored stored{.parent_hash = big, .blocks = {{big, big}, {big - 1, 7}, {0, big}}};
  msgpack::sbuffer out;
  PackStoredEvent(out, big, ~std::uint32_t{0}, StorageTier::kHostPinned, stored);
  EXPECT_LE(out.size(), kStoredEventBytes + 3 * kStoredBlockBytes);
  auto doc = ParseMsgpack(AsBytes(out));
  ASSERT_TRUE(doc.ok());
  auto batch = DecodeKvCacheEvent(doc->get(), 5, StorageTier::kDevice);
  ASSERT_TRUE(batch.ok()) << batch.status().ToString();
  EXPECT_EQ(batch->sequence.value, big);
  EXPECT_EQ(batch->dp_rank, ~std::uint32_t{0});
  ASSERT_EQ(batch->ops.size(), 1u);
  EXPECT_EQ(batch->ops[0].tier, StorageTier::kHostPinned);
  EXPECT_EQ(std::get<KvStored>(batch->ops[0].data), stored);
}

}  // namespace
}  // namespace kvrouter
