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

}  // namespace
}  // namespace kvrouter
