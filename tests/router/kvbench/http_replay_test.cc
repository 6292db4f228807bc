#include "router/kvbench/http_replay.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace kvrouter::bench {
namespace {

std::vector<std::string> FeedAll(SseDataReader& r, const std::vector<std::string>& pieces) {
  std::vector<std::string> out;
  for (const auto& p : pieces) r.Feed(p, [&](std::string_view d) { out.emplace_back(d); });
  return out;
}

TEST(SseDataReader, EventsSplitAnywhereComeOutWholeAndInOrder) {
  const std::string stream = "data: {\"a\":1}\n\ndata: {\"b\":2}\n\n: a comment\n\ndata: [DONE]\n\n";
  for (std::size_t cut = 0; cut <= stream.size(); ++cut) {
    SseDataReader r;
    EXPECT_EQ(FeedAll(r, {stream.substr(0, cut), stream.substr(cut)}),
              (std::vector<std::string>{"{\"a\":1}", "{\"b\":2}", "[DONE]"}))
        << "cut at " << cut;
    EXPECT_EQ(r.pending(), 0u);
  }
}

TEST(SseDataReader, CrLfLinesOtherFieldsAndAnUnfinishedEvent) {
  SseDataReader r;
  const auto out = FeedAll(r, {"event: chunk\r\ndata:x\r\nid: 3\r\ndata: y\r\n\r\n", "data: half"});
  EXPECT_EQ(out, (std::vector<std::string>{"x", "y"}));  // no space after the colon is kept as is
  EXPECT_EQ(r.pending(), std::string("data: half").size());
  EXPECT_EQ(FeedAll(r, {"\n\n"}), std::vector<std::string>{"half"});
}

}  // namespace
}  // namespace kvrouter::bench
