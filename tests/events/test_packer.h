// Hand-built msgpack for the codec tests: the non-canonical inputs the encoders never write
// (negative ints, u8/u16 widths, bin hashes, extra keys, short arrays), plus checks that a decode
// failed with InvalidArgument and that every truncation of a valid body is refused. Test-only.
//
//   TestPacker p;
//   p.pk.pack_map(1);  p.Key("worker_id");  p.pk.pack_fix_uint8(7);
//   auto reg = DecodeWorkerRegistration(p.bytes());
#pragma once

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <msgpack.hpp>

#include "events/msgpack_reader.h"

namespace kvrouter {

struct TestPacker {
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk{buf};

  void Key(std::string_view key) { PackKey(pk, key); }
  // A bin of `bytes` (e.g. a vLLM hash).
  void Bin(std::string_view bytes) {
    pk.pack_bin(static_cast<std::uint32_t>(bytes.size()));
    pk.pack_bin_body(bytes.data(), static_cast<std::uint32_t>(bytes.size()));
  }
  // Copies of the bytes so far, to embed (e.g. as an envelope payload) or to cut.
  std::string str() const { return {buf.data(), buf.size()}; }
  std::span<const std::byte> bytes() const { return AsBytes(buf); }
};

// A decode that failed with InvalidArgument whose message contains `message_part`.
template <typename T>
void ExpectInvalid(const Result<T>& r, std::string_view message_part) {
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_THAT(r.status().message(), ::testing::HasSubstr(std::string(message_part)));
}

// Every proper prefix of `body` must fail to decode with InvalidArgument.
template <typename Decode>
void ExpectEveryTruncationFails(std::span<const std::byte> body, Decode decode) {
  for (std::size_t len = 0; len < body.size(); ++len) {
    auto r = decode(body.first(len));
    EXPECT_FALSE(r.ok()) << "prefix of " << len << " bytes decoded";
    if (!r.ok()) {
      EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << r.status().ToString();
    }
  }
}

// "\xdd" + 0xffffffff: an array header declaring 2^32-1 elements, with nothing after it.
inline constexpr std::string_view kHugeArrayHeader = "\xdd\xff\xff\xff\xff";

// Packs a map of `n` entries; `pack_fields` writes them.
template <typename PackFields>
std::string MapOf(std::uint32_t n, PackFields pack_fields) {
  TestPacker p;
  p.pk.pack_map(n);
  pack_fields(p);
  return p.str();
}

// A route request map: token_ids [1, 2] followed by `n` more entries written by pack_fields.
template <typename PackFields>
std::string RouteRequestWith(std::uint32_t n, PackFields pack_fields) {
  return MapOf(n + 1, [&](TestPacker& p) {
    p.Key("token_ids");
    p.pk.pack(std::vector<std::uint32_t>{1, 2});
    pack_fields(p);
  });
}

}  // namespace kvrouter
