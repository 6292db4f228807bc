// Bounded msgpack parsing and typed field access for the codecs.
//
// ParseMsgpack never throws and never trusts declared sizes: every array/map/str/bin length is
// capped by the bytes actually present (an element needs at least one byte), nesting is capped
// at kMaxDepth, and msgpack-c exceptions become Status values. Strings and bins reference the
// input buffer, so a parsed object must not outlive the bytes it came from.
// The typed accessors accept any msgpack integer width, signed or unsigned, and report the
// field name on a type mismatch. Thread-compatible (no shared state).
//
//   auto doc = ParseMsgpack(bytes);  if (!doc.ok()) return doc.status();
//   auto id = ReadU64(FindKey(doc->get(), "worker_id"), "worker_id");
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

#include <msgpack.hpp>

#include "events/status.h"

namespace kvrouter {

inline constexpr std::size_t kMaxDepth = 16;
inline constexpr std::size_t kMaxMessageBytes = 64 << 20;  // larger messages are refused

// Parses exactly one msgpack value that must span all of `bytes`.
Result<msgpack::object_handle> ParseMsgpack(std::span<const std::byte> bytes);

// Value of `key` in a map, or nullptr when the object is not a map or has no such key.
const msgpack::object* FindKey(const msgpack::object& map, std::string_view key);

bool IsNil(const msgpack::object* o);  // absent or nil
bool IsMap(const msgpack::object& o);
bool IsArray(const msgpack::object& o);

// Integers of any width. ReadU64Bits reinterprets a negative value as its u64 bit pattern
// (hashes); ReadU64 refuses negatives; ReadU32 also refuses values above 2^32-1.
Result<std::uint64_t> ReadU64Bits(const msgpack::object* o, std::string_view field);
Result<std::uint64_t> ReadU64(const msgpack::object* o, std::string_view field);
Result<std::uint32_t> ReadU32(const msgpack::object* o, std::string_view field);
Result<std::int64_t> ReadI64(const msgpack::object* o, std::string_view field);
Result<double> ReadF64(const msgpack::object* o, std::string_view field);  // float or int
Result<bool> ReadBool(const msgpack::object* o, std::string_view field);
Result<std::string_view> ReadStr(const msgpack::object* o, std::string_view field);
// Array elements; an error when o is missing or not an array.
Result<std::span<const msgpack::object>> ReadArray(const msgpack::object* o,
                                                   std::string_view field);

// Optional variants: absent or nil -> fallback.
Result<std::uint64_t> ReadU64Or(const msgpack::object* o, std::string_view field,
                                std::uint64_t fallback);
Result<std::uint32_t> ReadU32Or(const msgpack::object* o, std::string_view field,
                                std::uint32_t fallback);
Result<std::string_view> ReadStrOr(const msgpack::object* o, std::string_view field,
                                   std::string_view fallback);

// The body of a packed buffer as bytes (for tests and publishers).
inline std::span<const std::byte> AsBytes(const msgpack::sbuffer& buf) {
  return {reinterpret_cast<const std::byte*>(buf.data()), buf.size()};
}
inline std::span<const std::byte> AsBytes(std::string_view s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

// Packs a string key; codecs write maps as pk.pack_map(n) then PackKey + value pairs.
inline void PackKey(msgpack::packer<msgpack::sbuffer>& pk, std::string_view key) {
  pk.pack_str(static_cast<std::uint32_t>(key.size()));
  pk.pack_str_body(key.data(), static_cast<std::uint32_t>(key.size()));
}

}  // namespace kvrouter
