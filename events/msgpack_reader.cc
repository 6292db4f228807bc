#include "events/msgpack_reader.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

namespace kvrouter {
namespace {

bool ReferenceAll(msgpack::type::object_type, std::size_t, void*) { return true; }

Status TypeError(std::string_view field, std::string_view want) {
  return InvalidArgument(fmt::format("field '{}' must be {}", field, want));
}

Status Missing(std::string_view field) { return InvalidArgument(fmt::format("missing field '{}'", field)); }

std::uint64_t LoadBigEndian(const unsigned char* p, std::size_t width) {
  switch (width) {
    case 2: return (std::uint64_t{p[0]} << 8) | p[1];
    case 4: {
      std::uint32_t v;
      std::memcpy(&v, p, sizeof v);
      return std::endian::native == std::endian::little ? __builtin_bswap32(v) : v;
    }
    case 8: {
      std::uint64_t v;
      std::memcpy(&v, p, sizeof v);
      return std::endian::native == std::endian::little ? __builtin_bswap64(v) : v;
    }
    default: {
      std::uint64_t v = 0;
      for (std::size_t i = 0; i < width; ++i) v = (v << 8) | p[i];
      return v;
    }
  }
}

// What one msgpack header announces: its own size, then `payload` raw bytes or `children`
// nested values (a map of n pairs has 2n children).
struct Head {
  std::size_t header = 1;
  std::uint64_t payload = 0;
  std::uint64_t children = 0;
};

// Decodes the header starting at p[0] (avail >= 1 bytes are readable from p).
Result<Head> ReadHead(const unsigned char* p, std::size_t avail) {
  const unsigned b = p[0];
  Head h;
  std::size_t len_width = 0;  // bytes of the big-endian length that follows the type byte
  enum { kPayload, kChildren, kPairs } len_is = kPayload;
  std::size_t ext_type_byte = 0;
  // clang-format off: one row per msgpack type byte, as the spec's table has them
  if (b <= 0x7f || b >= 0xe0) return h;  // fixint
  if (b <= 0x8f) {
    h.children = 2u * (b & 0x0f);
    return h;
  }  // fixmap
  if (b <= 0x9f) {
    h.children = b & 0x0f;
    return h;
  }  // fixarray
  if (b <= 0xbf) {
    h.payload = b & 0x1f;
    return h;
  }  // fixstr
  switch (b) {
    case 0xc0:
    case 0xc2:
    case 0xc3: return h;  // nil, false, true
    case 0xc4:
    case 0xd9: len_width = 1; break;  // bin8, str8
    case 0xc5:
    case 0xda: len_width = 2; break;  // bin16, str16
    case 0xc6:
    case 0xdb: len_width = 4; break;  // bin32, str32
    case 0xc7:
      len_width = 1;
      ext_type_byte = 1;
      break;  // ext8
    case 0xc8:
      len_width = 2;
      ext_type_byte = 1;
      break;  // ext16
    case 0xc9:
      len_width = 4;
      ext_type_byte = 1;
      break;                             // ext32
    case 0xca: h.payload = 4; return h;  // float32
    case 0xcb: h.payload = 8; return h;  // float64
    case 0xcc:
    case 0xd0: h.payload = 1; return h;  // (u)int8
    case 0xcd:
    case 0xd1: h.payload = 2; return h;  // (u)int16
    case 0xce:
    case 0xd2: h.payload = 4; return h;  // (u)int32
    case 0xcf:
    case 0xd3: h.payload = 8; return h;  // (u)int64
    case 0xd4:
    case 0xd5:
    case 0xd6:
    case 0xd7:
    case 0xd8:  // fixext 1..16
      h.header = 2;
      h.payload = std::uint64_t{1} << (b - 0xd4);
      return h;
    case 0xdc:
      len_width = 2;
      len_is = kChildren;
      break;  // array16
    case 0xdd:
      len_width = 4;
      len_is = kChildren;
      break;  // array32
    case 0xde:
      len_width = 2;
      len_is = kPairs;
      break;  // map16
    case 0xdf:
      len_width = 4;
      len_is = kPairs;
      break;  // map32
    default: return InvalidArgument(fmt::format("malformed msgpack: reserved byte 0x{:02x}", b));
  }
  // clang-format on
  h.header = 1 + len_width + ext_type_byte;
  if (h.header > avail) return InvalidArgument("truncated msgpack");
  const std::uint64_t len = LoadBigEndian(p + 1, len_width);
  switch (len_is) {
    case kPayload: h.payload = len; break;
    case kChildren: h.children = len; break;
    case kPairs: h.children = 2 * len; break;
  }
  return h;
}

// Walks the encoding without building anything: every declared length must fit in the bytes
// left, containers nest at most kMaxDepth deep and exactly one value spans `bytes`.
Status CheckShape(std::span<const std::byte> bytes) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  const std::size_t n = bytes.size();
  std::uint64_t unread[kMaxDepth];  // values still to read in each open container
  std::size_t depth = 0;
  std::size_t off = 0;
  do {
    if (off >= n) return InvalidArgument("truncated msgpack");
    Result<Head> h = ReadHead(p + off, n - off);
    if (!h.ok()) return h.status();
    if (h->header > n - off) return InvalidArgument("truncated msgpack");
    off += h->header;
    const std::size_t left = n - off;
    if (h->payload > left || h->children > left) {
      return InvalidArgument(fmt::format("msgpack declares {} {} but only {} bytes remain",
                                         h->payload > left ? h->payload : h->children,
                                         h->payload > left ? "bytes" : "elements", left));
    }
    off += static_cast<std::size_t>(h->payload);
    if (h->children > 0) {
      if (depth == kMaxDepth) {
        return InvalidArgument(fmt::format("msgpack nests deeper than {} levels", kMaxDepth));
      }
      unread[depth++] = h->children;
      continue;
    }
    // A complete value: close every container it completes.
    while (depth > 0 && --unread[depth - 1] == 0) --depth;
  } while (depth > 0);
  if (off != n) {
    return InvalidArgument(fmt::format("{} trailing bytes after the msgpack value", n - off));
  }
  return Status::Ok();
}

template <typename T>
Result<std::vector<T>> ReadEach(const msgpack::object* o, std::string_view field, FieldReader<T> read_one) {
  auto items = ReadArray(o, field);
  if (!items.ok()) return items.status();
  std::vector<T> out;
  out.reserve(items->size());
  for (std::size_t i = 0; i < items->size(); ++i) {
    Result<T> v = read_one(&(*items)[i], field);
    if (!v.ok()) {
      return InvalidArgument(fmt::format("{} (element {})", v.status().message(), i));
    }
    out.push_back(*v);
  }
  return out;
}

}  // namespace

Result<msgpack::object> ParseMsgpackIn(msgpack::zone& zone, std::span<const std::byte> bytes) {
  if (bytes.empty()) return InvalidArgument("empty message");
  if (bytes.size() > kMaxMessageBytes) {
    return InvalidArgument(fmt::format("message of {} bytes exceeds {}", bytes.size(), kMaxMessageBytes));
  }
  if (Status shape = CheckShape(bytes); !shape.ok()) return shape;
  const std::size_t n = bytes.size();
  // Second line behind CheckShape: an element needs at least one byte, a map pair two.
  msgpack::unpack_limit limit(n, n / 2, n, n, n, kMaxDepth);
  try {
    std::size_t off = 0;
    msgpack::object obj =
        msgpack::unpack(zone, reinterpret_cast<const char*>(bytes.data()), n, off, &ReferenceAll, nullptr, limit);
    if (off != n) {
      return InvalidArgument(fmt::format("{} trailing bytes after the msgpack value", n - off));
    }
    return obj;
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

Result<msgpack::object_handle> ParseMsgpack(std::span<const std::byte> bytes) {
  auto zone = std::make_unique<msgpack::zone>();
  auto obj = ParseMsgpackIn(*zone, bytes);
  if (!obj.ok()) return obj.status();
  return msgpack::object_handle(*obj, std::move(zone));
}

Result<msgpack::object_handle> ParseMsgpackMap(std::span<const std::byte> bytes, std::string_view what) {
  auto doc = ParseMsgpack(bytes);
  if (!doc.ok()) return doc.status();
  if (!IsMap(doc->get())) return InvalidArgument(fmt::format("{} must be a map", what));
  return doc;
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

Result<double> ReadNonNegative(const msgpack::object* o, std::string_view field) {
  auto v = ReadF64(o, field);
  if (!v.ok()) return v.status();
  if (!std::isfinite(*v) || *v < 0) {
    return InvalidArgument(fmt::format("field '{}' must be a finite non-negative number", field));
  }
  return *v;
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

Result<std::string_view> ReadName(const msgpack::object* o, std::string_view field) {
  auto s = ReadStr(o, field);
  if (s.ok() && s->size() > kMaxNameBytes) {
    return InvalidArgument(fmt::format("field '{}' is longer than {} bytes", field, kMaxNameBytes));
  }
  return s;
}

Result<std::span<const msgpack::object>> ReadArray(const msgpack::object* o, std::string_view field) {
  if (o == nullptr) return Missing(field);
  if (o->type != msgpack::type::ARRAY) return TypeError(field, "an array");
  return std::span<const msgpack::object>(o->via.array.ptr, o->via.array.size);
}

Result<std::uint64_t> ReadHashIntOrBin(const msgpack::object* o, std::string_view field) {
  if (o != nullptr && o->type == msgpack::type::BIN) {
    const std::size_t size = o->via.bin.size;
    if (size == 0) return TypeError(field, "an integer or a non-empty bin");
    const std::size_t width = std::min<std::size_t>(size, 8);
    return LoadBigEndian(reinterpret_cast<const unsigned char*>(o->via.bin.ptr) + size - width, width);
  }
  if (o != nullptr && o->type != msgpack::type::POSITIVE_INTEGER && o->type != msgpack::type::NEGATIVE_INTEGER) {
    return TypeError(field, "an integer or a bin");
  }
  return ReadU64Bits(o, field);
}

Result<std::vector<std::uint32_t>> ReadU32Array(const msgpack::object* o, std::string_view field) {
  return ReadEach<std::uint32_t>(o, field, ReadU32);
}

Result<std::vector<std::uint64_t>> ReadU64Array(const msgpack::object* o, std::string_view field) {
  return ReadEach<std::uint64_t>(o, field, ReadU64);
}

Result<std::vector<std::uint64_t>> ReadU64BitsArray(const msgpack::object* o, std::string_view field) {
  return ReadEach<std::uint64_t>(o, field, ReadU64Bits);
}

Result<std::vector<std::uint64_t>> ReadHashIntOrBinArray(const msgpack::object* o, std::string_view field) {
  return ReadEach<std::uint64_t>(o, field, ReadHashIntOrBin);
}

Result<std::uint64_t> ReadU64Or(const msgpack::object* o, std::string_view field, std::uint64_t fallback) {
  return IsNil(o) ? Result<std::uint64_t>(fallback) : ReadU64(o, field);
}

Result<std::uint32_t> ReadU32Or(const msgpack::object* o, std::string_view field, std::uint32_t fallback) {
  return IsNil(o) ? Result<std::uint32_t>(fallback) : ReadU32(o, field);
}

Result<std::string_view> ReadStrOr(const msgpack::object* o, std::string_view field, std::string_view fallback) {
  return IsNil(o) ? Result<std::string_view>(fallback) : ReadStr(o, field);
}

}  // namespace kvrouter

namespace kvrouter {

// fix_lo..fix_lo+15: the fix form; wide, wide+1: the 16- and 32-bit forms. Each of the n
// entries needs at least `min_bytes` more bytes.
bool MsgpackPull::Container(unsigned fix_lo, unsigned wide, std::size_t min_bytes, std::uint32_t& n) {
  if (p_ == end_) return false;
  const unsigned b = *p_;
  std::size_t width = 0;
  if (b >= fix_lo && b <= fix_lo + 0x0f) {
    n = b & 0x0f;
  } else if (b == wide || b == wide + 1) {
    width = b == wide ? 2 : 4;
    if (Left() < 1 + width) return false;
    n = static_cast<std::uint32_t>(LoadBigEndian(p_ + 1, width));
  } else {
    return false;
  }
  if (n > (Left() - 1 - width) / min_bytes) return false;
  p_ += 1 + width;
  return true;
}

bool MsgpackPull::ArrayHeader(std::uint32_t& size) { return Container(0x90, 0xdc, 1, size); }

bool MsgpackPull::WideStr(std::string_view& s) {
  if (p_ == end_) return false;
  const unsigned b = *p_;
  std::size_t width = 0, len = 0;
  if (b >= 0xa0 && b <= 0xbf) {
    len = b & 0x1f;
  } else if (b >= 0xd9 && b <= 0xdb) {
    width = std::size_t{1} << (b - 0xd9);
    if (Left() < 1 + width) return false;
    len = static_cast<std::size_t>(LoadBigEndian(p_ + 1, width));
  } else {
    return false;
  }
  if (len > Left() - 1 - width) return false;
  s = std::string_view(reinterpret_cast<const char*>(p_ + 1 + width), len);
  p_ += 1 + width + len;
  return true;
}

bool MsgpackPull::Bin(std::span<const std::byte>& bytes) {
  if (p_ == end_ || *p_ < 0xc4 || *p_ > 0xc6) return false;
  const std::size_t width = std::size_t{1} << (*p_ - 0xc4);
  if (Left() < 1 + width) return false;
  const std::size_t len = static_cast<std::size_t>(LoadBigEndian(p_ + 1, width));
  if (len > Left() - 1 - width) return false;
  bytes = {reinterpret_cast<const std::byte*>(p_ + 1 + width), len};
  p_ += 1 + width + len;
  return true;
}

bool MsgpackPull::Int(std::int64_t& i, std::uint64_t& u, bool& negative) {
  if (p_ == end_) return false;
  const unsigned b = *p_;
  negative = false;
  if (b <= 0x7f) {
    u = b;
    ++p_;
    return true;
  }
  if (b >= 0xe0) {
    i = static_cast<std::int8_t>(b);
    negative = true;
    ++p_;
    return true;
  }
  if (b < 0xcc || b > 0xd3) return false;
  const std::size_t width = std::size_t{1} << ((b - 0xcc) & 3);
  if (Left() < 1 + width) return false;
  const std::uint64_t raw = LoadBigEndian(p_ + 1, width);
  p_ += 1 + width;
  if (b <= 0xcf) {
    u = raw;
    return true;
  }
  // int8..int64: sign-extend from `width` bytes.
  const unsigned shift = static_cast<unsigned>(64 - 8 * width);
  i = static_cast<std::int64_t>(raw << shift) >> shift;
  if (i >= 0) {
    u = static_cast<std::uint64_t>(i);
  } else {
    negative = true;
  }
  return true;
}

bool MsgpackPull::U64(std::uint64_t& v) {
  const unsigned char* at = p_;
  std::int64_t i = 0;
  bool negative = false;
  if (!Int(i, v, negative)) return false;
  if (negative) p_ = at;
  return !negative;
}

bool MsgpackPull::U32(std::uint32_t& v) {
  // Token ids: the unsigned forms first, without the general integer path.
  if (p_ != end_) {
    const unsigned b = *p_;
    if (b <= 0x7f) {
      v = b;
      ++p_;
      return true;
    }
    if (b == 0xce && Left() >= 5) {
      v = (std::uint32_t{p_[1]} << 24) | (std::uint32_t{p_[2]} << 16) | (std::uint32_t{p_[3]} << 8) | p_[4];
      p_ += 5;
      return true;
    }
    if (b == 0xcd && Left() >= 3) {
      v = (std::uint32_t{p_[1]} << 8) | p_[2];
      p_ += 3;
      return true;
    }
  }
  const unsigned char* at = p_;
  std::uint64_t u = 0;
  if (!U64(u) || u > std::numeric_limits<std::uint32_t>::max()) {
    p_ = at;
    return false;
  }
  v = static_cast<std::uint32_t>(u);
  return true;
}

bool MsgpackPull::AnyU64Bits(std::uint64_t& v) {
  std::int64_t i = 0;
  bool negative = false;
  if (!Int(i, v, negative)) return false;
  if (negative) v = static_cast<std::uint64_t>(i);
  return true;
}

bool MsgpackPull::TakeNil() {
  if (p_ == end_ || *p_ != 0xc0) return false;
  ++p_;
  return true;
}

bool MsgpackPull::Skip() {
  // Scalars without a payload to measure (an envelope's header fields) skip without ReadHead.
  if (p_ != end_) {
    const unsigned b = *p_;
    std::size_t size = 0;
    if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) {
      size = 1;  // fixint, nil, bool (0xc1 is no value)
    } else if (b >= 0xcc && b <= 0xd3) {
      size = 1 + (std::size_t{1} << ((b - 0xcc) & 3));  // uint8..64, int8..64
    } else if ((b & 0xe0) == 0xa0) {
      size = 1 + (b & 0x1fu);  // fixstr
    }
    if (size > 0) {
      if (size > Left()) return false;
      p_ += size;
      return true;
    }
  }
  return SkipN(1, 0);
}

bool MsgpackPull::SkipN(std::uint64_t values, std::size_t depth) {
  for (; values > 0; --values) {
    if (p_ == end_) return false;
    Result<Head> h = ReadHead(p_, Left());
    if (!h.ok() || h->header > Left()) return false;
    const std::size_t left = Left() - h->header;
    if (h->payload > left || h->children > left) return false;
    p_ += h->header + static_cast<std::size_t>(h->payload);
    if (h->children > 0 && (depth + 1 >= kMaxPullDepth || !SkipN(h->children, depth + 1))) return false;
  }
  return true;
}

}  // namespace kvrouter
