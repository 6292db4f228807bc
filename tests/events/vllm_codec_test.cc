#include "events/vllm_codec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/events/test_packer.h"

namespace kvrouter {
namespace {

using ::testing::HasSubstr;

// Golden local hashes of docs/protocol.md section 1 (block_size 4).
constexpr LocalHash kHash1234 = 14643705804678351452ull;
constexpr LocalHash kHash5678 = 16777012769546811212ull;
constexpr LocalHash kHash1234Lora = 15633847640104431966ull;  // lora_name "my-adapter"

const VllmBatchContext kCtx{.worker_id = 3, .dp_rank = 1, .kv_seq = 12, .block_size = 4};

Result<VllmDecoded> Decode(std::span<const std::byte> body, const VllmBatchContext& ctx = kCtx) {
  return DecodeVllmBatch(body, ctx);
}

Result<VllmDecoded> Decode(const msgpack::sbuffer& body, const VllmBatchContext& ctx = kCtx) {
  return DecodeVllmBatch(AsBytes(body), ctx);
}

VllmStoredEvent Stored(std::vector<std::uint64_t> hashes, std::vector<std::uint32_t> tokens,
                       std::uint32_t block_size = 4) {
  return {.block_hashes = std::move(hashes), .token_ids = std::move(tokens), .block_size = block_size};
}

// Packs [ts, [<one event written by pack_event>], nil].
template <typename PackEvent>
std::string BatchWith(PackEvent pack_event) {
  TestPacker p;
  p.pk.pack_array(3);
  p.pk.pack_double(1.5);
  p.pk.pack_array(1);
  pack_event(p);
  p.pk.pack_nil();
  return p.str();
}

void ExpectInvalid(std::span<const std::byte> body, std::string_view message_part) {
  auto r = Decode(body);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr(std::string(message_part)));
}

TEST(VllmCodec, StoredEventHashesTokensAtTheRouterBlockSize) {
  auto r = Decode(EncodeVllmBatch(1.0, {Stored({100, 200}, {1, 2, 3, 4, 5, 6, 7, 8})}, 0));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->block_size_mismatches, 0u);
  KvEventBatch want{.worker_id = 3, .dp_rank = 1, .sequence = {SequenceKind::kVllmSeq, 12}};
  want.ops.push_back({StorageTier::kDevice, KvStored{std::nullopt, {{100, kHash1234}, {200, kHash5678}}}});
  EXPECT_EQ(r->batch, want);
}

TEST(VllmCodec, LoraNameSeedsTheTokensHash) {
  VllmStoredEvent e = Stored({100}, {1, 2, 3, 4});
  e.lora_name = "my-adapter";
  auto r = Decode(EncodeVllmBatch(1.0, {e}, std::nullopt));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(std::get<KvStored>(r->batch.ops.at(0).data).blocks.at(0).tokens_hash, kHash1234Lora);
}

TEST(VllmCodec, AllEventKindsRoundTripInOrder) {
  VllmStoredEvent stored = Stored({7}, {1, 2, 3, 4});
  stored.parent_block_hash = 6;
  auto r = Decode(
      EncodeVllmBatch(2.0, {stored, VllmRemovedEvent{{7, 0xffffffffffffffffull}, "CPU"}, VllmClearedEvent{}}, 0));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->batch.ops.size(), 3u);
  EXPECT_EQ(r->batch.ops[0], (KvOp{StorageTier::kDevice, KvStored{6, {{7, kHash1234}}}}));
  EXPECT_EQ(r->batch.ops[1], (KvOp{StorageTier::kHostPinned, KvRemoved{{7, 0xffffffffffffffffull}}}));
  EXPECT_EQ(r->batch.ops[2], (KvOp{StorageTier::kDevice, KvCleared{}}));
}

TEST(VllmCodec, WithoutKvSeqTheSequenceIsNone) {
  VllmBatchContext ctx = kCtx;
  ctx.kv_seq.reset();
  auto r = Decode(EncodeVllmBatch(1.0, {VllmClearedEvent{}}, 0), ctx);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->batch.sequence, (EventSequence{SequenceKind::kNone, 0}));
}

TEST(VllmCodec, EmptyEventListIsAnEmptyBatch) {
  auto r = Decode(EncodeVllmBatch(1.0, {}, 0));
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->batch.ops.empty());
  EXPECT_EQ(r->batch.sequence, (EventSequence{SequenceKind::kVllmSeq, 12}));
}

TEST(VllmCodec, SubjectDpRankWinsOverBatch) {
  auto r = Decode(EncodeVllmBatch(1.0, {VllmClearedEvent{}}, 7));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->batch.worker_id, 3u);
  EXPECT_EQ(r->batch.dp_rank, 1u);
}

TEST(VllmCodec, OlderTwoElementBatchIsAccepted) {
  TestPacker p;
  p.pk.pack_array(2);
  p.pk.pack_double(1.0);
  p.pk.pack_array(1);
  p.pk.pack_array(1);
  p.pk.pack("AllBlocksCleared");
  auto r = Decode(p.bytes());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->batch.ops.size(), 1u);
}

TEST(VllmCodec, MapFormBatchIsAccepted) {
  TestPacker p;
  p.pk.pack_map(4);
  p.Key("data_parallel_rank");
  p.pk.pack(0);
  p.Key("events");
  p.pk.pack_array(1);
  p.pk.pack_array(1);
  p.pk.pack("AllBlocksCleared");
  p.Key("ts");
  p.pk.pack(17);  // an int timestamp is a number too
  p.Key("unknown");
  p.pk.pack("ignored");
  auto r = Decode(p.bytes());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->batch.ops.at(0).data, KvEventData(KvCleared{}));
}

TEST(VllmCodec, MapFormEventsAreAccepted) {
  TestPacker p;
  p.pk.pack_array(2);
  p.pk.pack_double(1.0);
  p.pk.pack_array(3);
  p.pk.pack_map(6);
  p.Key("token_ids");
  p.pk.pack(std::vector<std::uint32_t>{1, 2, 3, 4});
  p.Key("type");
  p.pk.pack("BlockStored");
  p.Key("block_hashes");
  p.pk.pack(std::vector<std::uint64_t>{9});
  p.Key("block_size");
  p.pk.pack(4);
  p.Key("medium");
  p.pk.pack("GPU");
  p.Key("extra_keys");
  p.pk.pack_array(0);
  p.pk.pack_map(3);
  p.Key("type");
  p.pk.pack("BlockRemoved");
  p.Key("block_hashes");
  p.pk.pack(std::vector<std::uint64_t>{9});
  p.Key("medium");
  p.pk.pack("DISK");
  p.pk.pack_map(1);
  p.Key("type");
  p.pk.pack("AllBlocksCleared");
  auto r = Decode(p.bytes());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->batch.ops.size(), 3u);
  EXPECT_EQ(r->batch.ops[0], (KvOp{StorageTier::kDevice, KvStored{std::nullopt, {{9, kHash1234}}}}));
  EXPECT_EQ(r->batch.ops[1], (KvOp{StorageTier::kDisk, KvRemoved{{9}}}));
  EXPECT_EQ(r->batch.ops[2], (KvOp{StorageTier::kDevice, KvCleared{}}));
}

TEST(VllmCodec, ArrayStoppingAfterBlockSizeIsAccepted) {
  auto body = BatchWith([](TestPacker& p) {
    p.pk.pack_array(5);
    p.pk.pack("BlockStored");
    p.pk.pack(std::vector<std::uint64_t>{9});
    p.pk.pack_nil();
    p.pk.pack(std::vector<std::uint32_t>{1, 2, 3, 4});
    p.pk.pack_fix_uint8(4);
  });
  auto r = Decode(AsBytes(body));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->batch.ops.at(0), (KvOp{StorageTier::kDevice, KvStored{std::nullopt, {{9, kHash1234}}}}));
}

TEST(VllmCodec, TrailingUnknownFieldsAreIgnored) {
  auto body = BatchWith([](TestPacker& p) {
    p.pk.pack_array(14);
    p.pk.pack("BlockStored");
    p.pk.pack(std::vector<std::uint64_t>{9});
    p.pk.pack(8);
    p.pk.pack(std::vector<std::uint32_t>{1, 2, 3, 4});
    p.pk.pack(4);
    p.pk.pack(3);        // lora_id
    p.pk.pack_nil();     // medium
    p.pk.pack_nil();     // lora_name
    p.pk.pack_array(0);  // extra_keys
    p.pk.pack(0);        // group_idx
    p.pk.pack("full");   // kv_cache_spec_kind
    p.pk.pack_nil();     // kv_cache_spec_sliding_window
    p.pk.pack_map(0);    // unknown
    p.pk.pack(1.5);      // unknown
  });
  auto r = Decode(AsBytes(body));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->batch.ops.at(0), (KvOp{StorageTier::kDevice, KvStored{8, {{9, kHash1234}}}}));
}

TEST(VllmCodec, BinHashTakesLastEightBytesBigEndian) {
  auto body = BatchWith([](TestPacker& p) {
    p.pk.pack_array(3);
    p.pk.pack("BlockRemoved");
    p.pk.pack_array(2);
    p.Bin(std::string(24, '\x55') + std::string("\x01\x02\x03\x04\x05\x06\x07\x08", 8));
    p.Bin(std::string_view("\x01\x00", 2));  // shorter than 8 bytes: read as it is
    p.pk.pack_nil();
  });
  auto r = Decode(AsBytes(body));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->batch.ops.at(0).data, KvEventData(KvRemoved{{0x0102030405060708ull, 0x100}}));
}

TEST(VllmCodec, NegativeHashIsReinterpreted) {
  auto body = BatchWith([](TestPacker& p) {
    p.pk.pack_array(5);
    p.pk.pack("BlockStored");
    p.pk.pack_array(1);
    p.pk.pack_fix_int64(-5);
    p.pk.pack_fix_int8(-1);
    p.pk.pack(std::vector<std::uint32_t>{1, 2, 3, 4});
    p.pk.pack(4);
  });
  auto r = Decode(AsBytes(body));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->batch.ops.at(0).data,
            KvEventData(KvStored{0xffffffffffffffffull, {{0xfffffffffffffffbull, kHash1234}}}));
}

TEST(VllmCodec, BlockSizeMismatchStopsAtFirstBadBlock) {
  // Every block is bad at another block size: the op stays, with no blocks.
  auto r = Decode(EncodeVllmBatch(1.0, {Stored({1, 2}, {1, 2, 3, 4, 5, 6, 7, 8}, 8), Stored({3}, {1, 2, 3, 4})}, 0));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->block_size_mismatches, 1u);
  ASSERT_EQ(r->batch.ops.size(), 2u);
  EXPECT_TRUE(std::get<KvStored>(r->batch.ops[0].data).blocks.empty());
  EXPECT_EQ(std::get<KvStored>(r->batch.ops[1].data).blocks.size(), 1u);
}

TEST(VllmCodec, TooFewTokensStopsAtFirstBadBlock) {
  auto r = Decode(EncodeVllmBatch(1.0, {Stored({1, 2, 3}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10})}, 0));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->block_size_mismatches, 1u);
  EXPECT_EQ(std::get<KvStored>(r->batch.ops.at(0).data).blocks,
            (std::vector<StoredBlock>{{1, kHash1234}, {2, kHash5678}}));
}

TEST(VllmCodec, MismatchesAreCountedOncePerEvent) {
  auto r = Decode(
      EncodeVllmBatch(1.0, {Stored({1, 2, 3}, {1, 2, 3, 4}), Stored({4, 5}, {}), Stored({6}, {1, 2, 3, 4}, 2)}, 0));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->block_size_mismatches, 3u);
  EXPECT_EQ(std::get<KvStored>(r->batch.ops[0].data).blocks.size(), 1u);
}

TEST(VllmCodec, ExtraTokensAfterTheLastBlockAreIgnored) {
  auto r = Decode(EncodeVllmBatch(1.0, {Stored({1}, {1, 2, 3, 4, 5, 6})}, 0));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->block_size_mismatches, 0u);
  EXPECT_EQ(std::get<KvStored>(r->batch.ops.at(0).data).blocks.size(), 1u);
}

// extra_keys (protocol.md section 12): item identifiers enter the hashes of their blocks, the
// LoRA name does not (it seeds them already), and [identifier, offset] counts as the identifier.
TEST(VllmCodec, ExtraKeysEnterTheBlocksHashes) {
  const std::vector<std::uint32_t> tokens = {1, 2, 3, 4, 5, 6, 7, 8};
  const std::string image(64, 'b');
  VllmStoredEvent e{.block_hashes = {11, 12}, .token_ids = tokens, .block_size = 4, .lora_name = "adapter"};
  e.extra_keys = {{}, {image, "adapter"}};
  auto r = Decode(EncodeVllmBatch(1.0, {e}, 0));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const auto& blocks = std::get<KvStored>(r->batch.ops.at(0).data).blocks;
  ASSERT_EQ(blocks.size(), 2u);
  const MmItem item{.hash = MmItemHash(image), .offset = 4, .length = 4};
  const auto want = ComputeLocalHashes(tokens, 4, "adapter", std::span<const MmItem>(&item, 1));
  EXPECT_EQ(blocks[0].tokens_hash, want[0]);
  EXPECT_EQ(blocks[1].tokens_hash, want[1]);
  EXPECT_NE(blocks[1].tokens_hash, ComputeLocalHashes(tokens, 4, "adapter")[1]);
  // The [identifier, offset] form, written by hand.
  auto body = BatchWith([&](TestPacker& p) {
    p.pk.pack_array(9);
    p.pk.pack("BlockStored");
    p.pk.pack(std::vector<std::uint64_t>{11});
    p.pk.pack_nil();
    p.pk.pack(std::vector<std::uint32_t>{1, 2, 3, 4});
    p.pk.pack(4);
    p.pk.pack_nil();
    p.pk.pack_nil();
    p.pk.pack_nil();
    p.pk.pack_array(1);
    p.pk.pack_array(1);
    p.pk.pack_array(2);
    p.pk.pack(image);
    p.pk.pack(0);
  });
  auto pair = Decode(AsBytes(body));
  ASSERT_TRUE(pair.ok()) << pair.status().ToString();
  const MmItem at0{.hash = MmItemHash(image), .offset = 0, .length = 4};
  EXPECT_EQ(std::get<KvStored>(pair->batch.ops.at(0).data).blocks.at(0).tokens_hash,
            ComputeLocalHashes(std::vector<std::uint32_t>{1, 2, 3, 4}, 4, "", std::span<const MmItem>(&at0, 1))[0]);
}

TEST(VllmCodec, MediumMapsToTier) {
  // docs/protocol.md section 12, case-insensitive; anything else is the device.
  const std::pair<std::optional<std::string>, StorageTier> cases[] = {
      {std::nullopt, StorageTier::kDevice},
      {"GPU", StorageTier::kDevice},
      {"DEVICE", StorageTier::kDevice},
      {"gpu", StorageTier::kDevice},
      {"", StorageTier::kDevice},
      {"TPU", StorageTier::kDevice},
      {"CPU", StorageTier::kHostPinned},
      {"cpu", StorageTier::kHostPinned},
      {"CPU_PINNED", StorageTier::kHostPinned},
      {"CPU_TIER1", StorageTier::kHostPinned},
      {"CPU_TIER2", StorageTier::kDisk},
      {"DISK", StorageTier::kDisk},
      {"disk", StorageTier::kDisk},
      {"NVME", StorageTier::kDisk},
      {"STORAGE", StorageTier::kDisk},
      {"EXTERNAL", StorageTier::kExternal},
      {"NETWORK", StorageTier::kExternal},
      {"REMOTE", StorageTier::kExternal},
      {"shared", StorageTier::kExternal},
  };
  for (const auto& [medium, tier] : cases) {
    auto r = Decode(EncodeVllmBatch(1.0, {VllmRemovedEvent{{1}, medium}}, 0));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->batch.ops.at(0).tier, tier) << medium.value_or("nil");
  }
}

TEST(VllmCodec, MediumThatIsNotAStringIsAnError) {
  auto body = BatchWith([](TestPacker& p) {
    p.pk.pack_array(3);
    p.pk.pack("BlockRemoved");
    p.pk.pack_array(0);
    p.pk.pack(1);
  });
  ExpectInvalid(AsBytes(body), "'medium'");
}

TEST(VllmCodec, UnknownEventKindIsAnError) {
  auto body = BatchWith([](TestPacker& p) {
    p.pk.pack_array(2);
    p.pk.pack("BlockMoved");
    p.pk.pack_array(0);
  });
  ExpectInvalid(AsBytes(body), "unknown vLLM event type 'BlockMoved'");
}

TEST(VllmCodec, MalformedEventsAreErrors) {
  ExpectInvalid(AsBytes(BatchWith([](TestPacker& p) { p.pk.pack(5); })), "array or a map");
  ExpectInvalid(AsBytes(BatchWith([](TestPacker& p) { p.pk.pack_array(0); })), "no tag");
  ExpectInvalid(AsBytes(BatchWith([](TestPacker& p) { p.pk.pack_map(0); })), "missing field 'type'");
  ExpectInvalid(AsBytes(BatchWith([](TestPacker& p) {
                  p.pk.pack_array(1);
                  p.pk.pack(1);
                })),
                "'type'");
}

TEST(VllmCodec, MissingBlockSizeIsAnError) {
  auto body = BatchWith([](TestPacker& p) {
    p.pk.pack_array(4);
    p.pk.pack("BlockStored");
    p.pk.pack(std::vector<std::uint64_t>{9});
    p.pk.pack_nil();
    p.pk.pack(std::vector<std::uint32_t>{1, 2, 3, 4});
  });
  ExpectInvalid(AsBytes(body), "missing field 'block_size'");
}

TEST(VllmCodec, ErrorNamesTheEventAndTheField) {
  TestPacker p;
  p.pk.pack_array(2);
  p.pk.pack(1.0);
  p.pk.pack_array(2);
  p.pk.pack_array(1);
  p.pk.pack("AllBlocksCleared");
  p.pk.pack_array(5);
  p.pk.pack("BlockStored");
  p.pk.pack(std::vector<std::uint64_t>{9});
  p.pk.pack_nil();
  p.pk.pack(std::vector<std::int64_t>{1, -2});
  p.pk.pack(4);
  auto r = Decode(p.bytes());
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("event 1"));
  EXPECT_THAT(r.status().message(), HasSubstr("'token_ids'"));
}

TEST(VllmCodec, MalformedBatchesAreErrors) {
  TestPacker one_element;
  one_element.pk.pack_array(1);
  one_element.pk.pack(1.0);
  ExpectInvalid(one_element.bytes(), "[ts, events");

  TestPacker scalar;
  scalar.pk.pack(1);
  ExpectInvalid(scalar.bytes(), "array or a map");

  TestPacker events_not_array;
  events_not_array.pk.pack_array(2);
  events_not_array.pk.pack(1.0);
  events_not_array.pk.pack("x");
  ExpectInvalid(events_not_array.bytes(), "'events'");

  TestPacker string_ts;
  string_ts.pk.pack_array(2);
  string_ts.pk.pack("now");
  string_ts.pk.pack_array(0);
  ExpectInvalid(string_ts.bytes(), "'ts'");

  TestPacker string_rank;
  string_rank.pk.pack_array(3);
  string_rank.pk.pack(1.0);
  string_rank.pk.pack_array(0);
  string_rank.pk.pack("0");
  ExpectInvalid(string_rank.bytes(), "'data_parallel_rank'");

  TestPacker map_without_events;
  map_without_events.pk.pack_map(1);
  map_without_events.Key("ts");
  map_without_events.pk.pack(1.0);
  ExpectInvalid(map_without_events.bytes(), "missing field 'events'");
}

TEST(VllmCodec, TruncatedBodyIsAnError) {
  VllmStoredEvent e = Stored({1, 2}, {1, 2, 3, 4, 5, 6, 7, 8});
  e.lora_name = "x";
  auto body = EncodeVllmBatch(1.0, {e, VllmRemovedEvent{{1}, "CPU"}, VllmClearedEvent{}}, 0);
  ExpectEveryTruncationFails(AsBytes(body), [](std::span<const std::byte> b) { return Decode(b); });
}

TEST(VllmCodec, HugeDeclaredArrayIsRefusedWithoutAllocating) {
  TestPacker p;
  p.pk.pack_array(2);
  p.pk.pack(1.0);
  std::string body = p.str() + std::string(kHugeArrayHeader);
  ExpectInvalid(AsBytes(body), "declares 4294967295 elements");
}

TEST(VllmCodec, DeepNestingIsRefused) {
  auto body = BatchWith([](TestPacker& p) {
    p.pk.pack_array(2);
    p.pk.pack("BlockRemoved");
    for (int i = 0; i < 20; ++i) p.pk.pack_array(1);
    p.pk.pack(1);
  });
  ExpectInvalid(AsBytes(body), "nests deeper");
}

TEST(VllmCodec, KvSeqHeaderIsADecimalU64) {
  EXPECT_EQ(ParseKvSeqHeader("0"), 0u);
  EXPECT_EQ(ParseKvSeqHeader("12"), 12u);
  EXPECT_EQ(ParseKvSeqHeader("18446744073709551615"), 18446744073709551615ull);
  for (std::string_view bad : {"", "-1", "+1", " 1", "1 ", "12a", "0x10", "18446744073709551616"}) {
    EXPECT_EQ(ParseKvSeqHeader(bad), std::nullopt) << "'" << bad << "'";
  }
}

}  // namespace
}  // namespace kvrouter
