// MapWriter: packs a msgpack map whose size is counted from the fields written, so no encoder
// states a map size by hand. Fields go into a body buffer; Finish() writes the map header and
// appends the body (one copy), AppendTo() does the same at the end of another buffer (a map
// inside an array or another map). Values are anything msgpack-c packs, raw bytes already packed,
// a nested MapWriter, or what a callback packs. Not thread-safe (a local builder).
//
//   MapWriter w;  w.Field("worker_id", id);  if (dp_rank) w.Field("dp_rank", *dp_rank);
//   msgpack::sbuffer body = std::move(w).Finish();
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>

#include <msgpack.hpp>

#include "events/msgpack_reader.h"

namespace kvrouter {

class MapWriter {
 public:
  using Packer = msgpack::packer<msgpack::sbuffer>;

  MapWriter() = default;
  MapWriter(MapWriter&&) = default;
  MapWriter& operator=(MapWriter&&) = default;

  template <typename T>
  MapWriter& Field(std::string_view key, const T& value) {
    Packer(Key(key)).pack(value);
    return *this;
  }
  // A value packed elsewhere (exactly one msgpack value).
  MapWriter& Packed(std::string_view key, std::span<const std::byte> value) {
    Key(key).write(reinterpret_cast<const char*>(value.data()), value.size());
    return *this;
  }
  // A nested map.
  MapWriter& Map(std::string_view key, const MapWriter& inner) {
    inner.AppendTo(Key(key));
    return *this;
  }
  // Exactly one value written by `pack`, called with a Packer& (scalars, arrays) or, when it does
  // not take one, with the msgpack::sbuffer& to append to (arrays of maps: MapWriter::AppendTo).
  template <typename F>
  MapWriter& With(std::string_view key, F&& pack) {
    msgpack::sbuffer& out = Key(key);
    if constexpr (std::is_invocable_v<F, Packer&>) {
      Packer pk(out);
      std::forward<F>(pack)(pk);
    } else {
      std::forward<F>(pack)(out);
    }
    return *this;
  }

  std::uint32_t fields() const { return fields_; }
  std::size_t body_size() const { return body_.size(); }
  // Forgets every field, keeping the buffer (one writer for each element of a long array).
  void Clear() {
    body_.clear();
    fields_ = 0;
  }

  // Packs the map at the end of `out`.
  void AppendTo(msgpack::sbuffer& out) const {
    Packer(out).pack_map(fields_);
    out.write(body_.data(), body_.size());
  }
  msgpack::sbuffer Finish() && {
    msgpack::sbuffer out(body_.size() + 5);
    AppendTo(out);
    return out;
  }

 private:
  static constexpr std::size_t kInitialBytes = 128;  // grows by doubling

  // Writes the key of a new field and returns the buffer its value goes to.
  msgpack::sbuffer& Key(std::string_view key) {
    Packer pk(body_);
    PackKey(pk, key);
    ++fields_;
    return body_;
  }

  msgpack::sbuffer body_{kInitialBytes};
  std::uint32_t fields_ = 0;
};

// Packs `values` as a msgpack array of unsigned integers, each in its shortest form, as
// msgpack-c's packer does, in one write to `out` (the packer calls the buffer once per byte
// group: a prompt's token ids are thousands of calls).
void PackU32Array(msgpack::sbuffer& out, std::span<const std::uint32_t> values);

// Bytes of msgpack's header for a map or array of n elements.
inline std::size_t ContainerHeaderBytes(std::uint64_t n) { return n < 16 ? 1 : n < 65536 ? 3 : 5; }

}  // namespace kvrouter
