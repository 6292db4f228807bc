#include "events/msgpack_writer.h"

#include <memory>

namespace kvrouter {

namespace {

// Writes `tag` and the low `bytes` bytes of `v`, big-endian, at `p`; returns the end.
char* Put(char* p, unsigned char tag, std::uint32_t v, int bytes) {
  *p++ = static_cast<char>(tag);
  for (int i = bytes - 1; i >= 0; --i) *p++ = static_cast<char>((v >> (8 * i)) & 0xff);
  return p;
}

}  // namespace

void PackU32Array(msgpack::sbuffer& out, std::span<const std::uint32_t> values) {
  // The longest form of each: a 5-byte header and 5 bytes a value.
  const auto buffer = std::make_unique_for_overwrite<char[]>(5 + 5 * values.size());
  char* p = buffer.get();
  const std::size_t n = values.size();
  if (n < 16) {
    *p++ = static_cast<char>(0x90 | n);  // fixarray
  } else if (n < 65536) {
    p = Put(p, 0xdc, static_cast<std::uint32_t>(n), 2);
  } else {
    p = Put(p, 0xdd, static_cast<std::uint32_t>(n), 4);
  }
  for (std::uint32_t v : values) {
    if (v < 128) {
      *p++ = static_cast<char>(v);  // positive fixint
    } else if (v < 256) {
      p = Put(p, 0xcc, v, 1);
    } else if (v < 65536) {
      p = Put(p, 0xcd, v, 2);
    } else {
      p = Put(p, 0xce, v, 4);
    }
  }
  out.write(buffer.get(), static_cast<std::size_t>(p - buffer.get()));
}

}  // namespace kvrouter
