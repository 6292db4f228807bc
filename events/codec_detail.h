// What the section 5 and 12 codecs share (the reply maps, paging, overlap_by_tier): internal to
// events/, defined in router_endpoints_codec.cc. Pure functions, thread-safe.
//   if (Status e = codec_detail::ErrorOfReply(root); !e.ok()) return e;
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <msgpack.hpp>

#include "events/base/status.h"
#include "events/block_hash.h"
#include "events/msgpack_writer.h"
#include "events/router_endpoints_codec.h"

namespace kvrouter::codec_detail {

// The map under `key`, or nullptr when absent or nil; a non-map is an error.
Result<const msgpack::object*> ReadOptionalMap(const msgpack::object& parent, std::string_view key);
// The Status of an error reply `root`, or OK when root has no "error" key.
Status ErrorOfReply(const msgpack::object& root);
// [{hash, offset, length}...] of a prompt's multimodal items.
msgpack::sbuffer EncodeMmItems(std::span<const MmItem> items);
// {device, host_pinned, disk}, as given (no lifting).
msgpack::sbuffer EncodeOverlapByTier(const OverlapByTier& t);
// m's overlap_by_tier, when present, into `to`.
Status ReadOverlapByTier(const msgpack::object& m, OverlapByTier& to);
// A paged request's offset and limit (a larger limit reads as StatsRequest::kMaxLimit).
Status ReadPage(const msgpack::object& m, std::uint64_t& offset, std::uint32_t& limit);

// One page of a paged reply: its head (head() reads the reply's next_offset) and, under `key`,
// as many of `entries` (encoded, in order) as fit in max_bytes. Sets next_offset to the first
// rank left out, or resets it when the page reaches the last rank; `keep` is how many went in.
template <typename Head>
Result<msgpack::sbuffer> EncodePage(std::string_view what, std::string_view key,
                                    const std::vector<msgpack::sbuffer>& entries, std::uint64_t offset,
                                    std::uint64_t total, std::optional<std::uint64_t>& next_offset,
                                    std::size_t max_bytes, const Head& head_of, std::size_t& keep) {
  // Worst case for the fixed part: next_offset present, the map header at its widest.
  if (!next_offset && !entries.empty()) next_offset = offset + entries.size();
  const std::size_t head = head_of().body_size() + 5 /* map header */ + key.size() + 2 + 5 /* array header */;
  if (head > max_bytes) {
    return Internal(fmt::format("the {} reply needs {} bytes without {}; the limit is {}", what, head, key, max_bytes));
  }
  std::size_t used = head;
  keep = 0;
  while (keep < entries.size() && used + entries[keep].size() <= max_bytes) used += entries[keep++].size();
  if (offset + keep >= total) {
    next_offset.reset();
  } else {
    next_offset = offset + keep;
  }
  msgpack::sbuffer array(used - head + 5);
  msgpack::packer<msgpack::sbuffer>(array).pack_array(static_cast<std::uint32_t>(keep));
  for (std::size_t i = 0; i < keep; ++i) array.write(entries[i].data(), entries[i].size());
  MapWriter w = head_of();
  w.Packed(key, AsBytes(array));
  return std::move(w).Finish();
}

}  // namespace kvrouter::codec_detail
