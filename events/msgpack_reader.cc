#include "events/msgpack_reader.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

namespace kvrouter {
namespace {

bool ReferenceAll(msgpack::type::object_type, std::size_t, void*) { return true; }

Status TypeError(std::string_view field, std::string_view want) {
  return InvalidArgument(fmt::format("field '{}' must be {}", field, want));
}

Status Missing(std::string_view field) {
  return InvalidArgument(fmt::format("missing field '{}'", field));
}

}  // namespace

Result<msgpack::object_handle> ParseMsgpack(std::span<const std::byte> bytes) {
  if (bytes.empty()) return InvalidArgument("empty message");
  if (bytes.size() > kMaxMessageBytes) {
    return InvalidArgument(fmt::format("message of {} bytes exceeds {}", bytes.size(),
                                       kMaxMessageBytes));
  }
  const std::size_t n = bytes.size();
  // Every element and every map pair needs at least one (two) bytes of input.
  msgpack::unpack_limit limit(n, n / 2, n, n, n, kMaxDepth);
  try {
    std::size_t off = 0;
    msgpack::object_handle oh = msgpack::unpack(reinterpret_cast<const char*>(bytes.data()), n,
                                                off, &ReferenceAll, nullptr, limit);
    if (off != n) {
      return InvalidArgument(fmt::format("{} trailing bytes after the msgpack value", n - off));
    }
    return oh;
  } catch (const msgpack::insufficient_bytes&) {
    return InvalidArgument("truncated msgpack");
  } catch (const msgpack::size_overflow& e) {
    return InvalidArgument(fmt::format("msgpack size limit: {}", e.what()));
  } catch (const msgpack::parse_error& e) {
    return InvalidArgument(fmt::format("malformed msgpack: {}", e.what()));
  } catch (const std::exception& e) {
    return InvalidArgument(fmt::format("undecodable msgpack: {}", e.what()));
  }
}

const msgpack::object* FindKey(const msgpack::object& map, std::string_view key) {
  if (map.type != msgpack::type::MAP) return nullptr;
  for (std::uint32_t i = 0; i < map.via.map.size; ++i) {
    const msgpack::object& k = map.via.map.ptr[i].key;
    if (k.type == msgpack::type::STR && std::string_view(k.via.str.ptr, k.via.str.size) == key) {
      return &map.via.map.ptr[i].val;
    }
  }
  return nullptr;
}

bool IsNil(const msgpack::object* o) { return o == nullptr || o->type == msgpack::type::NIL; }
bool IsMap(const msgpack::object& o) { return o.type == msgpack::type::MAP; }
bool IsArray(const msgpack::object& o) { return o.type == msgpack::type::ARRAY; }

Result<std::uint64_t> ReadU64Bits(const msgpack::object* o, std::string_view field) {
  if (o == nullptr) return Missing(field);
  if (o->type == msgpack::type::POSITIVE_INTEGER) return o->via.u64;
  if (o->type == msgpack::type::NEGATIVE_INTEGER) return static_cast<std::uint64_t>(o->via.i64);
  return TypeError(field, "an integer");
}

Result<std::uint64_t> ReadU64(const msgpack::object* o, std::string_view field) {
  if (o != nullptr && o->type == msgpack::type::NEGATIVE_INTEGER) {
    return TypeError(field, "a non-negative integer");
  }
  return ReadU64Bits(o, field);
}

Result<std::uint32_t> ReadU32(const msgpack::object* o, std::string_view field) {
  auto v = ReadU64(o, field);
  if (!v.ok()) return v.status();
  if (*v > std::numeric_limits<std::uint32_t>::max()) return TypeError(field, "a u32");
  return static_cast<std::uint32_t>(*v);
}

Result<std::int64_t> ReadI64(const msgpack::object* o, std::string_view field) {
  if (o == nullptr) return Missing(field);
  if (o->type == msgpack::type::NEGATIVE_INTEGER) return o->via.i64;
  if (o->type == msgpack::type::POSITIVE_INTEGER) {
    if (o->via.u64 > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      return TypeError(field, "an i64");
    }
    return static_cast<std::int64_t>(o->via.u64);
  }
  return TypeError(field, "an integer");
}

Result<double> ReadF64(const msgpack::object* o, std::string_view field) {
  if (o == nullptr) return Missing(field);
  switch (o->type) {
    case msgpack::type::FLOAT32:
    case msgpack::type::FLOAT64: return o->via.f64;
    case msgpack::type::POSITIVE_INTEGER: return static_cast<double>(o->via.u64);
    case msgpack::type::NEGATIVE_INTEGER: return static_cast<double>(o->via.i64);
    default: return TypeError(field, "a number");
  }
}

Result<bool> ReadBool(const msgpack::object* o, std::string_view field) {
  if (o == nullptr) return Missing(field);
  if (o->type != msgpack::type::BOOLEAN) return TypeError(field, "a boolean");
  return o->via.boolean;
}

Result<std::string_view> ReadStr(const msgpack::object* o, std::string_view field) {
  if (o == nullptr) return Missing(field);
  if (o->type != msgpack::type::STR) return TypeError(field, "a string");
  return std::string_view(o->via.str.ptr, o->via.str.size);
}

Result<std::span<const msgpack::object>> ReadArray(const msgpack::object* o,
                                                   std::string_view field) {
  if (o == nullptr) return Missing(field);
  if (o->type != msgpack::type::ARRAY) return TypeError(field, "an array");
  return std::span<const msgpack::object>(o->via.array.ptr, o->via.array.size);
}

Result<std::uint64_t> ReadU64Or(const msgpack::object* o, std::string_view field,
                                std::uint64_t fallback) {
  return IsNil(o) ? Result<std::uint64_t>(fallback) : ReadU64(o, field);
}

Result<std::uint32_t> ReadU32Or(const msgpack::object* o, std::string_view field,
                                std::uint32_t fallback) {
  return IsNil(o) ? Result<std::uint32_t>(fallback) : ReadU32(o, field);
}

Result<std::string_view> ReadStrOr(const msgpack::object* o, std::string_view field,
                                   std::string_view fallback) {
  return IsNil(o) ? Result<std::string_view>(fallback) : ReadStr(o, field);
}

}  // namespace kvrouter
