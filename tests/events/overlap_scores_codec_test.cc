#include "events/overlap_scores_codec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/events/test_packer.h"

namespace kvrouter {
namespace {

TEST(OverlapScoresCodec, RequestRoundTripsWithEitherPromptForm) {
  OverlapScoresRequest tokens;
  tokens.prompt.token_ids = {1, 2, 3, 4, 5};
  tokens.prompt.has_token_ids = true;
  tokens.prompt.isl = 5;
  tokens.prompt.lora_name = "adapter";
  tokens.offset = 20;
  tokens.limit = 7;
  auto back = DecodeOverlapScoresRequest(AsBytes(EncodeOverlapScoresRequest(tokens)));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->prompt.token_ids, tokens.prompt.token_ids);
  EXPECT_EQ(back->prompt.lora_name, "adapter");
  EXPECT_EQ(back->offset, 20u);
  EXPECT_EQ(back->limit, 7u);
  OverlapScoresRequest hashes;
  hashes.prompt.block_hashes = {11, 12};
  hashes.prompt.isl = 8;
  back = DecodeOverlapScoresRequest(AsBytes(EncodeOverlapScoresRequest(hashes)));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_FALSE(back->prompt.has_token_ids);
  EXPECT_EQ(back->prompt.block_hashes, hashes.prompt.block_hashes);
  EXPECT_EQ(back->prompt.isl, 8u);
  EXPECT_EQ(back->offset, 0u);
  EXPECT_EQ(back->limit, StatsRequest::kDefaultLimit);
  auto huge = MapOf(2, [](TestPacker& p) {
    p.Key("token_ids");
    p.pk.pack(std::vector<std::uint32_t>{1});
    p.Key("limit");
    p.pk.pack(std::uint64_t{1} << 40);
  });
  back = DecodeOverlapScoresRequest(AsBytes(huge));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->limit, StatsRequest::kMaxLimit);
  // No prompt: refused, as a route request would be.
  auto none = DecodeOverlapScoresRequest(AsBytes(MapOf(1, [](TestPacker& p) {
    p.Key("offset");
    p.pk.pack(1);
  })));
  EXPECT_EQ(none.status().code(), StatusCode::kInvalidArgument);
}

TEST(OverlapScoresCodec, ReplyRoundTripsAndPagesUnderTheLimit) {
  OverlapScoresReply r;
  r.offset = 100;
  r.workers_total = 5000;
  for (std::uint64_t i = 0; i < 1000; ++i) {
    const auto n = static_cast<std::uint32_t>(i % 7);
    r.scores.push_back({.worker_id = 100 + i, .dp_rank = 1, .overlap_blocks = n, .overlap_by_tier = {n, n + 1, n + 2}});
  }
  OverlapScoresReply whole = r;
  auto body = EncodeOverlapScoresReply(whole, 1 << 20);
  ASSERT_TRUE(body.ok()) << body.status().ToString();
  auto back = DecodeOverlapScoresReply(AsBytes(*body));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->scores, r.scores);
  ASSERT_TRUE(back->next_offset.has_value());
  EXPECT_EQ(*back->next_offset, 1100u);  // ranks after this page exist
  EXPECT_EQ(back->workers_total, 5000u);

  OverlapScoresReply trimmed = r;
  body = EncodeOverlapScoresReply(trimmed, 4096);
  ASSERT_TRUE(body.ok());
  EXPECT_LE(body->size(), 4096u);
  back = DecodeOverlapScoresReply(AsBytes(*body));
  ASSERT_TRUE(back.ok());
  ASSERT_GT(back->scores.size(), 0u);
  ASSERT_LT(back->scores.size(), 1000u);
  EXPECT_EQ(back->scores.front(), r.scores.front());
  EXPECT_EQ(*back->next_offset, 100 + back->scores.size());

  OverlapScoresReply last{.scores = {r.scores[0]}, .workers_total = 101, .offset = 100};
  body = EncodeOverlapScoresReply(last, 1 << 20);
  back = DecodeOverlapScoresReply(AsBytes(*body));
  ASSERT_TRUE(back.ok());
  EXPECT_FALSE(back->next_offset.has_value());
  EXPECT_EQ(DecodeOverlapScoresReply(AsBytes(EncodeErrorReply(InvalidArgument("no")))).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvrouter
