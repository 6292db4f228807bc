// The two walkers of a message's field list (docs/design.md "Glossary"; a ForEach...Field next to the message's
// struct): FieldEncoder writes each field into a MapWriter, FieldDecoder reads each from a
// decoded map. Internal to the codecs in events/. A field list calls, in encoded order:
//   v.Required(key, member)          always written; a decode without it fails
//   v.Optional(key, member)          always written; absent or nil on decode leaves the default
//   v.OmittedWhenEmpty(key, member)  written when not empty; absent on decode leaves it empty
//   v.OmittedWhenFalse(key, member)  a bool written when true; absent on decode leaves it false
// Members are u64, u32, f64, bool or strings. Both walkers are inline templates: a field list costs what
// the hand-written Field / Required calls cost.
//
//   FieldEncoder enc{w};  ForEachKvMetricsField(metrics, enc);
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include <msgpack.hpp>

#include "events/base/status.h"
#include "events/msgpack_reader.h"
#include "events/msgpack_writer.h"

namespace kvrouter {

struct FieldEncoder {
  MapWriter& w;
  template <typename T>
  void Required(std::string_view key, const T& value) {
    w.Field(key, value);
  }
  template <typename T>
  void Optional(std::string_view key, const T& value) {
    w.Field(key, value);
  }
  void OmittedWhenEmpty(std::string_view key, const std::string& value) {
    if (!value.empty()) w.Field(key, value);
  }
  void OmittedWhenFalse(std::string_view key, bool value) {
    if (value) w.Field(key, value);
  }
};

// The reader of a member's type.
inline Result<std::uint64_t> ReadWireField(const msgpack::object* o, std::string_view key, const std::uint64_t&) {
  return ReadU64(o, key);
}
inline Result<std::uint32_t> ReadWireField(const msgpack::object* o, std::string_view key, const std::uint32_t&) {
  return ReadU32(o, key);
}
inline Result<double> ReadWireField(const msgpack::object* o, std::string_view key, const double&) {
  return ReadF64(o, key);
}
inline Result<std::string_view> ReadWireField(const msgpack::object* o, std::string_view key, const std::string&) {
  return ReadStr(o, key);
}
inline Result<bool> ReadWireField(const msgpack::object* o, std::string_view key, const bool&) {
  return ReadBool(o, key);
}

// Reads into `reads` (the first failure is kept, later fields are then skipped as FieldReads does).
struct FieldDecoder {
  const msgpack::object& map;
  FieldReads& reads;
  template <typename T>
  void Required(std::string_view key, T& member) {
    Read(FindKey(map, key), key, member);
  }
  template <typename T>
  void Optional(std::string_view key, T& member) {
    if (const msgpack::object* o = FindKey(map, key); !IsNil(o)) Read(o, key, member);
  }
  void OmittedWhenEmpty(std::string_view key, std::string& member) { Optional(key, member); }
  void OmittedWhenFalse(std::string_view key, bool& member) { Optional(key, member); }

 private:
  template <typename T>
  void Read(const msgpack::object* o, std::string_view key, T& member) {
    if (!reads.ok()) return;
    auto r = ReadWireField(o, key, member);
    if (r.ok()) {
      member = std::move(r).value();
    } else {
      reads.Fail(r.status());
    }
  }
};

}  // namespace kvrouter
