// MapWriter: packs a msgpack map whose size is counted from the fields written, so no encoder
// states a map size by hand. Fields go into a body buffer; Finish() writes the map header and
// appends the body (one copy). Values are anything msgpack-c packs, or raw bytes already packed
// (a nested map or array). Not thread-safe (a local builder).
//
//   MapWriter w;  w.Field("worker_id", id);  if (dp_rank) w.Field("dp_rank", *dp_rank);
//   msgpack::sbuffer body = std::move(w).Finish();
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <utility>

#include <msgpack.hpp>

#include "events/msgpack_reader.h"

namespace kvrouter {

class MapWriter {
  using Packer = msgpack::packer<msgpack::sbuffer>;

 public:
  MapWriter() = default;
  MapWriter(MapWriter&&) = default;
  MapWriter& operator=(MapWriter&&) = default;

  template <typename T>
  MapWriter& Field(std::string_view key, const T& value) {
    Packer pk(body_);
    PackKey(pk, key);
    pk.pack(value);
    ++fields_;
    return *this;
  }
  // A value packed elsewhere (exactly one msgpack value).
  MapWriter& Packed(std::string_view key, std::span<const std::byte> value) {
    Packer pk(body_);
    PackKey(pk, key);
    body_.write(reinterpret_cast<const char*>(value.data()), value.size());
    ++fields_;
    return *this;
  }
  // A value packed by `pack(packer)`.
  template <typename F>
  MapWriter& With(std::string_view key, F&& pack) {
    Packer pk(body_);
    PackKey(pk, key);
    std::forward<F>(pack)(pk);
    ++fields_;
    return *this;
  }

  std::uint32_t fields() const { return fields_; }
  std::size_t body_size() const { return body_.size(); }

  msgpack::sbuffer Finish() && {
    msgpack::sbuffer out(body_.size() + 5);
    Packer(out).pack_map(fields_);
    out.write(body_.data(), body_.size());
    return out;
  }

 private:
  msgpack::sbuffer body_;
  std::uint32_t fields_ = 0;
};

// Bytes of msgpack's header for a map or array of n elements.
inline std::size_t ContainerHeaderBytes(std::uint64_t n) { return n < 16 ? 1 : n < 65536 ? 3 : 5; }

}  // namespace kvrouter
