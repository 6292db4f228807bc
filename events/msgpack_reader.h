// Bounded msgpack parsing and typed field access for the codecs.
//
// ParseMsgpack never throws and never trusts declared sizes: before msgpack-c builds anything,
// a scan checks that every array/map/str/bin/ext length fits in the bytes that remain (an
// element needs at least one byte), that nesting stays within kMaxDepth and that exactly one
// value spans the input, so msgpack-c never allocates for a bad message; its own limits and its
// exceptions (turned into Status values) stay as a second line. Strings and bins reference the
// input buffer, so a parsed object must not outlive the bytes it came from.
// The typed accessors accept any msgpack integer width, signed or unsigned, and report the
// field name on a type mismatch. Thread-compatible (no shared state).
//
//   auto doc = ParseMsgpack(bytes);  if (!doc.ok()) return doc.status();
//   auto id = ReadU64(FindKey(doc->get(), "worker_id"), "worker_id");
//   FieldReads reads;  reads.Required(doc->get(), "worker_id", ReadU64, reg.worker_id);
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include <msgpack.hpp>

#include "events/base/status.h"

namespace kvrouter {

inline constexpr std::size_t kMaxDepth = 16;
inline constexpr std::size_t kMaxMessageBytes = 64 << 20;  // larger messages are refused

// Parses exactly one msgpack value that must span all of `bytes`. Containers may nest
// kMaxDepth deep (empty containers do not count).
Result<msgpack::object_handle> ParseMsgpack(std::span<const std::byte> bytes);

// ParseMsgpack into a zone the caller owns and reuses (msgpack::zone::clear() between messages
// keeps its first chunk): no allocation per message on hot paths. The object lives until the
// zone is cleared or destroyed.
Result<msgpack::object> ParseMsgpackIn(msgpack::zone& zone, std::span<const std::byte> bytes);

// ParseMsgpack, then checks that the value is a map; `what` names the message in the error.
Result<msgpack::object_handle> ParseMsgpackMap(std::span<const std::byte> bytes, std::string_view what);

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
// A weight or a duration: a finite number at least 0 (float or int); NaN, infinities and
// negatives are refused.
Result<double> ReadNonNegative(const msgpack::object* o, std::string_view field);
Result<bool> ReadBool(const msgpack::object* o, std::string_view field);
Result<std::string_view> ReadStr(const msgpack::object* o, std::string_view field);
// A string the router keeps (request ids, device names): at most kMaxNameBytes bytes, so a peer
// cannot make every booking or worker it creates arbitrarily large.
inline constexpr std::size_t kMaxNameBytes = 256;
Result<std::string_view> ReadName(const msgpack::object* o, std::string_view field);
// Array elements; an error when o is missing or not an array.
Result<std::span<const msgpack::object>> ReadArray(const msgpack::object* o, std::string_view field);
// A block hash sent as an integer (its u64 bit pattern) or as bin: the last 8 bytes read
// big-endian; a bin shorter than 8 bytes is read big-endian as it is (zero-extended), an empty
// bin is an error.
Result<std::uint64_t> ReadHashIntOrBin(const msgpack::object* o, std::string_view field);

// Arrays whose elements are all read like the scalar reader of the same name; an error names
// the field and the index of the first bad element.
Result<std::vector<std::uint32_t>> ReadU32Array(const msgpack::object* o, std::string_view field);
Result<std::vector<std::uint64_t>> ReadU64Array(const msgpack::object* o, std::string_view field);
Result<std::vector<std::uint64_t>> ReadU64BitsArray(const msgpack::object* o, std::string_view field);
Result<std::vector<std::uint64_t>> ReadHashIntOrBinArray(const msgpack::object* o, std::string_view field);

// Optional variants: absent or nil -> fallback.
Result<std::uint64_t> ReadU64Or(const msgpack::object* o, std::string_view field, std::uint64_t fallback);
Result<std::uint32_t> ReadU32Or(const msgpack::object* o, std::string_view field, std::uint32_t fallback);
Result<std::string_view> ReadStrOr(const msgpack::object* o, std::string_view field, std::string_view fallback);

// Any of the readers above that take (object, field name).
template <typename T>
using FieldReader = Result<T> (*)(const msgpack::object*, std::string_view);

// A run of field reads that keeps the first failure, so a decoder lists its fields one per line
// and checks once. After a failure the remaining reads are skipped.
//   FieldReads reads;
//   reads.Required(map, "worker_id", ReadU64, reg.worker_id);
//   reads.Optional(map, "dp_size", ReadU32, reg.dp_size);   // absent or nil: keeps the default
//   if (!reads.ok()) return reads.status();
class FieldReads {
 public:
  // `o` is the field's value (nullptr when absent); a missing value is an error.
  template <typename T, typename Out>
  void Required(const msgpack::object* o, std::string_view field, FieldReader<T> read, Out& out) {
    if (!status_.ok()) return;
    Result<T> r = read(o, field);
    if (r.ok()) {
      out = std::move(r).value();
    } else {
      status_ = r.status();
    }
  }
  // Absent or nil leaves `out` as it is; `out` may be a std::optional.
  template <typename T, typename Out>
  void Optional(const msgpack::object* o, std::string_view field, FieldReader<T> read, Out& out) {
    if (!IsNil(o)) Required(o, field, read, out);
  }
  // The same, looking the field up in `map` by its name.
  template <typename T, typename Out>
  void Required(const msgpack::object& map, std::string_view key, FieldReader<T> read, Out& out) {
    Required(FindKey(map, key), key, read, out);
  }
  template <typename T, typename Out>
  void Optional(const msgpack::object& map, std::string_view key, FieldReader<T> read, Out& out) {
    Optional(FindKey(map, key), key, read, out);
  }
  // Records a failure found by the decoder itself (kept only if it is the first).
  void Fail(Status s) {
    if (status_.ok()) status_ = std::move(s);
  }

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }

 private:
  Status status_;
};

// A pull reader over msgpack bytes for hot decoders: no tree, no allocation. Every read checks
// the bytes left and returns false, consuming nothing useful, when the next value is not what
// was asked (the caller then gives up and decodes the slow, explaining way). Skip() passes over
// any value nested at most kMaxPullDepth deep. Not thread-safe; the bytes must outlive it.
//   MsgpackPull in(bytes);  std::uint32_t n;  if (!in.MapHeader(n)) return std::nullopt;
class MsgpackPull {
 public:
  static constexpr std::size_t kMaxPullDepth = 8;
  explicit MsgpackPull(std::span<const std::byte> bytes)
      : begin_(reinterpret_cast<const unsigned char*>(bytes.data())), p_(begin_), end_(p_ + bytes.size()) {}

  // The forms the router's own peers write (a fixmap, a fixstr key, a positive fixint or a
  // uint64 hash) are read inline; every other form takes the general out-of-line path.
  bool MapHeader(std::uint32_t& pairs) {
    if (p_ != end_ && (*p_ & 0xf0) == 0x80 && std::size_t{*p_ & 0x0fu} <= (Left() - 1) / 2) {
      pairs = *p_++ & 0x0fu;
      return true;
    }
    return Container(0x80, 0xde, 2, pairs);
  }
  bool ArrayHeader(std::uint32_t& size);
  bool Str(std::string_view& s) {
    if (p_ != end_ && (*p_ & 0xe0) == 0xa0 && std::size_t{*p_ & 0x1fu} < Left()) {
      const std::size_t len = *p_ & 0x1fu;
      s = std::string_view(reinterpret_cast<const char*>(p_ + 1), len);
      p_ += 1 + len;
      return true;
    }
    return WideStr(s);
  }
  bool Bin(std::span<const std::byte>& b);
  bool U64(std::uint64_t& v);  // any integer form with a value >= 0 (ReadU64)
  bool U32(std::uint32_t& v);  // ... and <= 2^32-1 (ReadU32)
  // Any integer; a negative one as its bit pattern (ReadU64Bits).
  bool U64Bits(std::uint64_t& v) {
    if (p_ != end_) {
      if (*p_ <= 0x7f) {
        v = *p_++;
        return true;
      }
      if (*p_ == 0xcf && Left() >= 9) {
        v = LoadU64BigEndian(p_ + 1);
        p_ += 9;
        return true;
      }
    }
    return AnyU64Bits(v);
  }
  bool TakeNil();  // true (and consumed) when the next value is nil
  bool Skip();     // one value of any kind
  bool AtEnd() const { return p_ == end_; }
  std::size_t Offset() const { return static_cast<std::size_t>(p_ - begin_); }  // bytes read so far

 private:
  static std::uint64_t LoadU64BigEndian(const unsigned char* p) {
    std::uint64_t v;
    std::memcpy(&v, p, sizeof v);
    if constexpr (std::endian::native == std::endian::little) v = __builtin_bswap64(v);
    return v;
  }
  bool Container(unsigned fix_lo, unsigned wide, std::size_t min_bytes, std::uint32_t& n);
  bool WideStr(std::string_view& s);
  bool AnyU64Bits(std::uint64_t& v);
  bool Int(std::int64_t& i, std::uint64_t& u, bool& negative);
  bool SkipN(std::uint64_t values, std::size_t depth);
  std::size_t Left() const { return static_cast<std::size_t>(end_ - p_); }

  const unsigned char* begin_;
  const unsigned char* p_;
  const unsigned char* end_;
};

// The body of a packed buffer as bytes (for tests and publishers).
inline std::span<const std::byte> AsBytes(const msgpack::sbuffer& buf) {
  return {reinterpret_cast<const std::byte*>(buf.data()), buf.size()};
}
inline std::span<const std::byte> AsBytes(std::string_view s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

// Packs a string key (MapWriter's keys, in events/msgpack_writer.h; hand-built test messages).
inline void PackKey(msgpack::packer<msgpack::sbuffer>& pk, std::string_view key) {
  pk.pack_str(static_cast<std::uint32_t>(key.size()));
  pk.pack_str_body(key.data(), static_cast<std::uint32_t>(key.size()));
}

}  // namespace kvrouter
