#include "events/msgpack_writer.h"

#include <string>

namespace kvrouter {

namespace {

void Put(std::string& b, unsigned char tag, std::uint32_t v, int bytes) {
  b.push_back(static_cast<char>(tag));
  for (int i = bytes - 1; i >= 0; --i) b.push_back(static_cast<char>((v >> (8 * i)) & 0xff));  // big-endian
}

}  // namespace

void PackU32Array(msgpack::sbuffer& out, std::span<const std::uint32_t> values) {
  std::string b;
  b.reserve(5 + 5 * values.size());
  const std::size_t n = values.size();
  if (n < 16) {
    b.push_back(static_cast<char>(0x90 | n));  // fixarray
  } else if (n < 65536) {
    Put(b, 0xdc, static_cast<std::uint32_t>(n), 2);
  } else {
    Put(b, 0xdd, static_cast<std::uint32_t>(n), 4);
  }
  for (std::uint32_t v : values) {
    if (v < 128) {
      b.push_back(static_cast<char>(v));  // positive fixint
    } else if (v < 256) {
      Put(b, 0xcc, v, 1);
    } else if (v < 65536) {
      Put(b, 0xcd, v, 2);
    } else {
      Put(b, 0xce, v, 4);
    }
  }
  out.write(b.data(), b.size());
}

}  // namespace kvrouter
