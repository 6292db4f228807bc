#include "events/msgpack_reader.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <vector>

#include "tests/events/test_packer.h"

namespace kvrouter {
namespace {

using ::testing::HasSubstr;

// Parses `p` or fails the test.
msgpack::object_handle Parse(const TestPacker& p) {
  auto doc = ParseMsgpack(p.bytes());
  EXPECT_TRUE(doc.ok()) << doc.status().ToString();
  return doc.ok() ? std::move(doc).value() : msgpack::object_handle();
}

// `levels` arrays nested in one another around a single integer.
std::string NestedArrays(int levels) { return std::string(static_cast<std::size_t>(levels), '\x91') + '\x01'; }

TEST(MsgpackReader, ParsesOneValueSpanningTheInput) {
  TestPacker p;
  p.pk.pack_map(1);
  p.Key("a");
  p.pk.pack(std::vector<int>{1, 2, 3});
  auto doc = Parse(p);
  auto a = ReadArray(FindKey(doc.get(), "a"), "a");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->size(), 3u);
}

TEST(MsgpackReader, EmptyInputIsAnError) {
  auto doc = ParseMsgpack({});
  ASSERT_FALSE(doc.ok());
  EXPECT_EQ(doc.status().code(), StatusCode::kInvalidArgument);
}

TEST(MsgpackReader, TruncatedInputIsAnError) {
  TestPacker p;
  p.pk.pack(std::vector<std::string>{"abc", "def"});
  ExpectEveryTruncationFails(p.bytes(), ParseMsgpack);
}

TEST(MsgpackReader, TruncatedLengthFieldIsAnError) {
  auto doc = ParseMsgpack(AsBytes(std::string_view("\xdc\x00", 2)));  // array16, 1 length byte
  ASSERT_FALSE(doc.ok());
  EXPECT_THAT(doc.status().message(), HasSubstr("truncated"));
}

TEST(MsgpackReader, TrailingBytesAreAnError) {
  auto doc = ParseMsgpack(AsBytes(std::string_view("\x01\x02", 2)));
  ASSERT_FALSE(doc.ok());
  EXPECT_THAT(doc.status().message(), HasSubstr("trailing"));
}

TEST(MsgpackReader, ReservedByteIsAnError) {
  auto doc = ParseMsgpack(AsBytes(std::string_view("\xc1", 1)));
  ASSERT_FALSE(doc.ok());
  EXPECT_EQ(doc.status().code(), StatusCode::kInvalidArgument);
}

// The refusal comes from the shape scan ("declares ..."), which runs before msgpack-c allocates
// anything: the 2^32-1 element array is never materialised.
TEST(MsgpackReader, HugeDeclaredArrayIsRefusedWithoutAllocating) {
  std::string body = std::string(kHugeArrayHeader) + "\x01\x02";
  auto doc = ParseMsgpack(AsBytes(body));
  ASSERT_FALSE(doc.ok());
  EXPECT_EQ(doc.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(doc.status().message(), HasSubstr("declares 4294967295 elements"));
}

TEST(MsgpackReader, HugeDeclaredMapStrBinAndExtAreRefused) {
  for (std::string_view header :
       {"\xdf\xff\xff\xff\xff", "\xdb\xff\xff\xff\xff", "\xc6\xff\xff\xff\xff", "\xc9\xff\xff\xff\xff\x01"}) {
    std::string body = std::string(header) + "\x01\x02";
    auto doc = ParseMsgpack(AsBytes(body));
    ASSERT_FALSE(doc.ok());
    EXPECT_THAT(doc.status().message(), HasSubstr("declares"));
  }
}

TEST(MsgpackReader, ArrayDeclaringOneElementMoreThanTheBytesLeftIsRefused) {
  auto doc = ParseMsgpack(AsBytes(std::string_view("\x93\x01\x02", 3)));
  ASSERT_FALSE(doc.ok());
}

TEST(MsgpackReader, SixteenNestingLevelsAreAccepted) {
  std::string body = NestedArrays(static_cast<int>(kMaxDepth));
  EXPECT_TRUE(ParseMsgpack(AsBytes(body)).ok());
}

TEST(MsgpackReader, DeepNestingIsRefused) {
  std::string body = NestedArrays(static_cast<int>(kMaxDepth) + 1);
  auto doc = ParseMsgpack(AsBytes(body));
  ASSERT_FALSE(doc.ok());
  EXPECT_THAT(doc.status().message(), HasSubstr("nests deeper"));
}

TEST(MsgpackReader, VeryDeepNestingIsRefusedWithoutRecursing) {
  std::string body = NestedArrays(100000);
  EXPECT_FALSE(ParseMsgpack(AsBytes(body)).ok());
}

TEST(MsgpackReader, IntegersOfAnyWidthAreAccepted) {
  TestPacker p;
  p.pk.pack_array(8);
  p.pk.pack_fix_uint8(200);
  p.pk.pack_fix_uint16(60000);
  p.pk.pack_fix_uint32(4000000000u);
  p.pk.pack_fix_uint64(7);
  p.pk.pack_fix_int8(5);
  p.pk.pack_fix_int16(300);
  p.pk.pack_fix_int32(70000);
  p.pk.pack_fix_int64(9);
  auto doc = Parse(p);
  const msgpack::object* v = doc.get().via.array.ptr;
  const std::uint64_t want[] = {200, 60000, 4000000000u, 7, 5, 300, 70000, 9};
  for (std::size_t i = 0; i < 8; ++i) {
    auto r = ReadU64(&v[i], "n");
    ASSERT_TRUE(r.ok()) << i;
    EXPECT_EQ(*r, want[i]);
  }
}

TEST(MsgpackReader, NegativeHashIsReinterpreted) {
  TestPacker p;
  p.pk.pack_fix_int64(-2);
  auto doc = Parse(p);
  auto bits = ReadU64Bits(&doc.get(), "block_hash");
  ASSERT_TRUE(bits.ok());
  EXPECT_EQ(*bits, 0xfffffffffffffffeull);
}

TEST(MsgpackReader, ReadU64RefusesNegatives) {
  TestPacker p;
  p.pk.pack_fix_int8(-1);
  auto doc = Parse(p);
  auto r = ReadU64(&doc.get(), "worker_id");
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("worker_id"));
}

TEST(MsgpackReader, ReadU32RefusesValuesAboveU32Max) {
  TestPacker p;
  p.pk.pack_uint64(std::uint64_t{1} << 32);
  auto doc = Parse(p);
  auto r = ReadU32(&doc.get(), "dp_rank");
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("dp_rank"));
}

TEST(MsgpackReader, WrongTypeErrorNamesTheField) {
  TestPacker p;
  p.pk.pack("seven");
  auto doc = Parse(p);
  auto r = ReadU64(&doc.get(), "event_id");
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), HasSubstr("'event_id'"));
}

TEST(MsgpackReader, MissingFieldErrorNamesTheField) {
  auto r = ReadStr(nullptr, "request_id");
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("missing field 'request_id'"));
}

TEST(MsgpackReader, BinHashTakesLastEightBytesBigEndian) {
  TestPacker p;
  std::string bytes(24, '\xaa');
  bytes += std::string("\x01\x02\x03\x04\x05\x06\x07\x08", 8);
  p.Bin(bytes);
  auto doc = Parse(p);
  auto h = ReadHashIntOrBin(&doc.get(), "block_hashes");
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(*h, 0x0102030405060708ull);
}

TEST(MsgpackReader, ShortBinHashIsReadBigEndianAsItIs) {
  TestPacker p;
  p.Bin(std::string_view("\x01\x02\x03", 3));
  auto doc = Parse(p);
  auto h = ReadHashIntOrBin(&doc.get(), "block_hashes");
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(*h, 0x010203ull);
}

TEST(MsgpackReader, EmptyBinHashIsAnError) {
  TestPacker p;
  p.Bin("");
  auto doc = Parse(p);
  EXPECT_FALSE(ReadHashIntOrBin(&doc.get(), "block_hashes").ok());
}

TEST(MsgpackReader, IntHashIsItsBitPattern) {
  TestPacker p;
  p.pk.pack_array(2);
  p.pk.pack_fix_uint16(513);
  p.pk.pack_int64(-1);
  auto doc = Parse(p);
  auto hashes = ReadHashIntOrBinArray(&doc.get(), "block_hashes");
  ASSERT_TRUE(hashes.ok());
  EXPECT_EQ(*hashes, (std::vector<std::uint64_t>{513, ~std::uint64_t{0}}));
}

TEST(MsgpackReader, StringIsNotAHash) {
  TestPacker p;
  p.pk.pack("abc");
  auto doc = Parse(p);
  EXPECT_FALSE(ReadHashIntOrBin(&doc.get(), "block_hashes").ok());
}

TEST(MsgpackReader, ArrayReaderNamesTheBadElement) {
  TestPacker p;
  p.pk.pack_array(3);
  p.pk.pack(1);
  p.pk.pack(2);
  p.pk.pack(-3);
  auto doc = Parse(p);
  auto r = ReadU32Array(&doc.get(), "token_ids");
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("'token_ids'"));
  EXPECT_THAT(r.status().message(), HasSubstr("element 2"));
}

TEST(MsgpackReader, FindKeyIgnoresNonStringKeys) {
  TestPacker p;
  p.pk.pack_map(2);
  p.pk.pack(1);
  p.pk.pack("int key");
  p.Key("a");
  p.pk.pack("str key");
  auto doc = Parse(p);
  EXPECT_EQ(FindKey(doc.get(), "1"), nullptr);
  auto a = ReadStr(FindKey(doc.get(), "a"), "a");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(*a, "str key");
  EXPECT_EQ(FindKey(doc.get().via.map.ptr[0].val, "a"), nullptr);  // not a map
}

TEST(MsgpackReader, FieldReadsKeepsTheFirstFailure) {
  TestPacker p;
  p.pk.pack_map(1);
  p.Key("b");
  p.pk.pack("not a number");
  auto doc = Parse(p);
  std::uint64_t a = 0;
  std::uint64_t b = 0;
  FieldReads reads;
  reads.Required(doc.get(), "a", ReadU64, a);
  reads.Required(doc.get(), "b", ReadU64, b);
  ASSERT_FALSE(reads.ok());
  EXPECT_THAT(reads.status().message(), HasSubstr("missing field 'a'"));
}

TEST(MsgpackReader, FieldReadsOptionalKeepsTheDefaultWhenAbsentOrNil) {
  TestPacker p;
  p.pk.pack_map(2);
  p.Key("nil");
  p.pk.pack_nil();
  p.Key("set");
  p.pk.pack(5);
  auto doc = Parse(p);
  std::uint32_t absent = 11;
  std::uint32_t nil = 12;
  std::optional<std::uint32_t> set;
  FieldReads reads;
  reads.Optional(doc.get(), "absent", ReadU32, absent);
  reads.Optional(doc.get(), "nil", ReadU32, nil);
  reads.Optional(doc.get(), "set", ReadU32, set);
  ASSERT_TRUE(reads.ok());
  EXPECT_EQ(absent, 11u);
  EXPECT_EQ(nil, 12u);
  EXPECT_EQ(set, 5u);
}

}  // namespace
}  // namespace kvrouter
