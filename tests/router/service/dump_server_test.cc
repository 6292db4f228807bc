// DumpServer on an in-memory bus (docs/protocol.md section 12): what a replica answers to a
// router.dump ask, apart from the service: its own asks and every ask before it is warm go
// unanswered, an ask it cannot read gets an error reply, and a dump larger than the bus's max
// payload comes in pages that together hold every rank whole.
#include "router/service/dump_server.h"

#include <gtest/gtest.h>

#include <vector>

#include "events/msgpack_reader.h"
#include "events/peer_dump_codec.h"
#include "events/router_endpoints_codec.h"
#include "transport/memory_bus.h"

namespace kvrouter {
namespace {

constexpr std::uint64_t kSelf = 1001;

class DumpServerTest : public ::testing::Test {
 protected:
  DumpServerTest()
      : dumps_(index_, bus_, kSelf, log_, [this](const BusMessage& m, const Status& s) {
          errors_.push_back(s);
          (void)bus_.Publish(m.reply, AsBytes(EncodeErrorReply(s)));
        }) {}

  // `worker` holds a chain of `blocks` blocks from the root, the `chain`-th of its own.
  void Hold(std::uint64_t worker, std::uint32_t blocks, std::uint64_t chain = 0) {
    KvEventBatch b;
    b.worker_id = worker;
    KvStored st;
    for (std::uint32_t i = 0; i < blocks; ++i) {
      const std::uint64_t h = (worker * 1000 + chain) * 1000 + i;
      st.blocks.push_back({h, h});
    }
    b.ops.push_back({StorageTier::kDevice, std::move(st)});
    ASSERT_TRUE(index_.Submit(std::move(b)));
    index_.Flush();
  }
  // Every page answering one ask (the bus is synchronous: they come inside Serve).
  std::vector<DumpReply> Ask(std::span<const std::byte> body, Warmth warmth) {
    std::vector<DumpReply> pages;
    auto sub = bus_.Subscribe("_TEST.dump", "", [&](const BusMessage& m) {
      auto r = DecodeDumpReply(m.data);
      if (r.ok()) pages.push_back(std::move(r).value());
    });
    EXPECT_TRUE(sub.ok());
    const std::vector<std::byte> bytes(body.begin(), body.end());
    dumps_.Serve(BusMessage{.subject = "namespace.dynamo.router.dump", .data = bytes, .reply = "_TEST.dump"}, warmth);
    return pages;
  }
  std::vector<DumpReply> Ask(const DumpRequest& req, Warmth warmth = Warmth::kWarm) {
    return Ask(AsBytes(EncodeDumpRequest(req)), warmth);
  }

  InMemoryBus bus_;
  ShardedIndex index_{{.num_shards = 2}};
  RateLimitedLog log_;
  std::vector<Status> errors_;
  DumpServer dumps_;
};

TEST_F(DumpServerTest, ItsOwnAskAndEveryAskBeforeItIsWarmGoUnanswered) {
  Hold(1, 4);
  EXPECT_TRUE(Ask({.router_id = kSelf, .max_parts = 1}).empty());
  EXPECT_TRUE(Ask({.router_id = 7, .max_parts = 1}, Warmth::kWarming).empty());
  EXPECT_EQ(dumps_.pages_served(), 0u);
  const auto pages = Ask({.router_id = 7, .max_parts = 1});
  ASSERT_EQ(pages.size(), 1u);
  ASSERT_EQ(pages[0].workers.size(), 1u);
  EXPECT_EQ(pages[0].workers[0].worker_id, 1u);
  EXPECT_EQ(pages[0].router_id, kSelf);
  EXPECT_FALSE(pages[0].more);
  EXPECT_EQ(dumps_.pages_served(), 1u);
}

TEST_F(DumpServerTest, AnAskItCannotReadGetsAnErrorReply) {
  const std::byte junk[] = {std::byte{0xc1}, std::byte{0x00}};
  EXPECT_TRUE(Ask(junk, Warmth::kWarm).empty());
  ASSERT_EQ(errors_.size(), 1u);
  EXPECT_EQ(errors_[0].code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(dumps_.pages_served(), 0u);
}

TEST_F(DumpServerTest, ADumpPastTheMaxPayloadComesInPagesOfWholeRanks) {
  for (std::uint64_t w = 1; w <= 6; ++w) Hold(w, 40);
  bus_.set_max_payload(2048);
  const auto pages = Ask({.router_id = 7, .max_parts = 100});
  ASSERT_GT(pages.size(), 1u);
  std::vector<std::uint64_t> blocks_of(7, 0);
  for (std::size_t i = 0; i < pages.size(); ++i) {
    EXPECT_EQ(pages[i].more, i + 1 < pages.size()) << i;
    for (const DumpedRank& r : pages[i].workers) {
      for (const DumpedChain& c : r.chains) blocks_of[r.worker_id] += c.stored.blocks.size();
    }
  }
  for (std::uint64_t w = 1; w <= 6; ++w) EXPECT_EQ(blocks_of[w], 40u) << "worker " << w;
  EXPECT_EQ(dumps_.pages_served(), pages.size());
}

// An asker of several parts gets whole ranks: past max_parts the pages go on to the end of the
// rank under way, so the ask ends at a rank's end (the next ask starts at the next rank's first
// chain).
TEST_F(DumpServerTest, AnAskOfSeveralPartsEndsAtARanksEnd) {
  for (std::uint64_t w = 1; w <= 3; ++w) {
    for (std::uint64_t chain = 0; chain < 30; ++chain) Hold(w, 4, chain);
  }
  bus_.set_max_payload(1024);
  const auto pages = Ask({.router_id = 7, .max_parts = 2});
  ASSERT_GT(pages.size(), 2u);  // a rank spans more pages than were asked
  ASSERT_TRUE(pages.back().more);
  EXPECT_EQ(pages.back().next_chain, 0u);
  for (std::size_t i = 0; i + 1 < pages.size(); ++i) EXPECT_TRUE(pages[i].more) << i;
  // The whole ranks sent hold every chain of theirs.
  std::vector<std::uint64_t> chains_of(4, 0);
  for (const DumpReply& p : pages) {
    for (const DumpedRank& r : p.workers) chains_of[r.worker_id] += r.chains.size();
  }
  EXPECT_EQ(chains_of[1], 30u);
}

}  // namespace
}  // namespace kvrouter
