#include "events/peer_dump_codec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "events/router_endpoints_codec.h"
#include "tests/events/test_packer.h"

namespace kvrouter {
namespace {

TEST(DumpCodec, RequestRoundTripsAndNeedsTheAskersId) {
  const DumpRequest req{.router_id = 7, .offset = 3, .chain_offset = 12, .max_parts = 16};
  auto back = DecodeDumpRequest(AsBytes(EncodeDumpRequest(req)));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, req);
  auto bare = DecodeDumpRequest(AsBytes(MapOf(0, [](TestPacker&) {})));
  EXPECT_EQ(bare.status().code(), StatusCode::kInvalidArgument);
  auto greedy = DecodeDumpRequest(AsBytes(EncodeDumpRequest({.router_id = 7, .max_parts = 100000})));
  EXPECT_EQ(greedy->max_parts, kMaxDumpParts);
  auto zero = DecodeDumpRequest(AsBytes(EncodeDumpRequest({.router_id = 7, .max_parts = 0})));
  EXPECT_EQ(zero->max_parts, 1u);
}

// A rank of `chains` chains of `blocks` blocks each, alternating device and host.
std::vector<DumpedChain> Chains(std::size_t chains, std::size_t blocks) {
  std::vector<DumpedChain> out;
  for (std::size_t c = 0; c < chains; ++c) {
    DumpedChain& d = out.emplace_back();
    d.tier = c % 2 == 0 ? StorageTier::kDevice : StorageTier::kHostPinned;
    if (c > 0) d.stored.parent_hash = 1000 * c - 1;
    for (std::size_t b = 0; b < blocks; ++b) d.stored.blocks.push_back({1000 * c + b, ~(1000 * c + b)});
  }
  return out;
}

TEST(DumpCodec, ARankSplitAcrossPagesComesBackWholeAndEveryPageFitsTheLimit) {
  const std::vector<DumpedChain> big = Chains(40, 30);
  const std::vector<DumpedChain> small = Chains(2, 1);
  constexpr std::size_t kLimit = 16 * 1024;
  std::vector<DumpedChain> got;
  std::size_t next = 0;
  int pages = 0;
  while (next < big.size()) {
    DumpReplyWriter w(99, kLimit);
    if (next == 0) {
      auto n = w.Add(4, 0, 17, SequenceKind::kEventId, small);
      ASSERT_TRUE(n.ok());
      ASSERT_EQ(*n, small.size());
    }
    auto n = w.Add(5, 1, 23, SequenceKind::kVllmSeq, std::span(big).subspan(next));
    ASSERT_TRUE(n.ok()) << n.status().ToString();
    ASSERT_GT(*n, 0u);
    next += *n;
    const bool more = next < big.size();
    const msgpack::sbuffer body = std::move(w).Finish(more, 1, next);
    ASSERT_LE(body.size(), kLimit);
    auto r = DecodeDumpReply(AsBytes(body));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->router_id, 99u);
    EXPECT_EQ(r->more, more);
    if (more) {
      EXPECT_EQ(r->next_chain, next);
    }
    const DumpedRank& d = r->workers.back();
    EXPECT_EQ(d.worker_id, 5u);
    EXPECT_EQ(d.dp_rank, 1u);
    EXPECT_EQ(d.last_event_id, 23u);
    EXPECT_EQ(d.numbering, SequenceKind::kVllmSeq);
    EXPECT_EQ(d.partial, more);
    if (pages == 0) {
      EXPECT_EQ(r->workers.front().chains, small);
    }
    got.insert(got.end(), d.chains.begin(), d.chains.end());
    ++pages;
  }
  EXPECT_GT(pages, 2);
  EXPECT_EQ(got, big);
  // A page already holding a rank leaves out a rank whose first chain no longer fits; a chain
  // that fits no page is an error.
  DumpReplyWriter w(1, 2048);
  ASSERT_EQ(*w.Add(1, 0, 0, SequenceKind::kNone, Chains(1, 20)), 1u);
  EXPECT_EQ(*w.Add(2, 0, 0, SequenceKind::kNone, Chains(1, 30)), 0u);
  EXPECT_EQ(w.ranks(), 1u);
  DumpReplyWriter tiny(1, 2048);
  EXPECT_EQ(tiny.Add(1, 0, 0, SequenceKind::kNone, Chains(1, 100)).status().code(), StatusCode::kInvalidArgument);
}

TEST(DumpCodec, AChainThatIsNotAStoredEventIsRefused) {
  auto body = MapOf(2, [](TestPacker& p) {
    p.Key("more");
    p.pk.pack(false);
    p.Key("workers");
    p.pk.pack_array(1);
    p.pk.pack_map(3);
    p.Key("worker_id");
    p.pk.pack(1);
    p.Key("dp_rank");
    p.pk.pack(0);
    p.Key("chains");
    p.pk.pack_array(1);
    p.pk.pack_map(2);
    p.Key("event_id");
    p.pk.pack(1);
    p.Key("data");
    p.pk.pack("cleared");
  });
  EXPECT_EQ(DecodeDumpReply(AsBytes(body)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeDumpReply(AsBytes(EncodeErrorReply(Internal("no")))).status().code(), StatusCode::kInternal);
}

}  // namespace
}  // namespace kvrouter
