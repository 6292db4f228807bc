#include "events/msgpack_writer.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace kvrouter {
namespace {

TEST(MapWriter, MapSizeIsCountedFromTheFieldsWritten) {
  MapWriter w;
  w.Field("a", 1).Field("b", std::string("x"));
  const bool with_c = false;
  if (with_c) w.Field("c", 3);
  EXPECT_EQ(w.fields(), 2u);
  const msgpack::sbuffer body = std::move(w).Finish();
  auto doc = ParseMsgpackMap(AsBytes(body), "test");
  ASSERT_TRUE(doc.ok()) << doc.status().ToString();
  EXPECT_EQ(doc->get().via.map.size, 2u);
  EXPECT_EQ(*ReadU64(FindKey(doc->get(), "a"), "a"), 1u);
  EXPECT_EQ(*ReadStr(FindKey(doc->get(), "b"), "b"), "x");
}

TEST(MapWriter, NestedMapsAndArraysOfMapsAreCountedToo) {
  MapWriter inner;
  inner.Field("x", 7);
  MapWriter w;
  w.Map("inner", inner);
  w.With("list", [](msgpack::sbuffer& out) {
    msgpack::packer<msgpack::sbuffer>(out).pack_array(3);
    MapWriter element;
    for (int i = 0; i < 3; ++i) {
      element.Clear();
      element.Field("i", i);
      if (i == 2) element.Field("last", true);
      element.AppendTo(out);
    }
  });
  w.With("nil", [](MapWriter::Packer& pk) { pk.pack_nil(); });
  const msgpack::sbuffer body = std::move(w).Finish();
  auto doc = ParseMsgpackMap(AsBytes(body), "test");
  ASSERT_TRUE(doc.ok()) << doc.status().ToString();
  const msgpack::object& m = doc->get();
  EXPECT_EQ(m.via.map.size, 3u);
  EXPECT_EQ(*ReadU64(FindKey(*FindKey(m, "inner"), "x"), "x"), 7u);
  auto list = ReadArray(FindKey(m, "list"), "list");
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 3u);
  EXPECT_EQ((*list)[0].via.map.size, 1u);
  EXPECT_EQ((*list)[2].via.map.size, 2u);
  EXPECT_EQ(*ReadU64(FindKey((*list)[1], "i"), "i"), 1u);
  EXPECT_TRUE(IsNil(FindKey(m, "nil")));
}

TEST(MapWriter, AnEmptyWriterIsAnEmptyMap) {
  const msgpack::sbuffer body = MapWriter().Finish();
  ASSERT_EQ(body.size(), 1u);
  EXPECT_EQ(static_cast<unsigned char>(body.data()[0]), 0x80);  // fixmap of 0
}

// Every width of integer and of array header, byte for byte as msgpack-c's own packer.
TEST(PackU32Array, WritesWhatMsgpackCsPackerWrites) {
  const std::vector<std::uint32_t> widths = {0, 1, 127, 128, 255, 256, 65535, 65536, 0xffffffffu, 42};
  for (std::size_t n : {std::size_t{0}, std::size_t{3}, std::size_t{15}, std::size_t{16}, std::size_t{65535},
                        std::size_t{65536}, std::size_t{70000}}) {
    std::vector<std::uint32_t> values(n);
    for (std::size_t i = 0; i < n; ++i) values[i] = widths[i % widths.size()] - (i / widths.size() % 2);
    msgpack::sbuffer ours, theirs;
    ours.write("x", 1);  // appended after what is there
    theirs.write("x", 1);
    PackU32Array(ours, values);
    msgpack::packer<msgpack::sbuffer>(theirs).pack(values);
    ASSERT_EQ(std::string_view(ours.data(), ours.size()), std::string_view(theirs.data(), theirs.size())) << n;
  }
}

}  // namespace
}  // namespace kvrouter
