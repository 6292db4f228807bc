// The headers kvgateway passes between clients and engines (router/kvgateway/headers.h).
#include "router/kvgateway/headers.h"

#include <gtest/gtest.h>

namespace kvrouter {
namespace {

std::vector<std::string> Names(const HttpHeaders& h) {
  std::vector<std::string> n;
  for (const auto& [k, v] : h) n.push_back(k);
  return n;
}

TEST(ForwardRequestHeaders, PassesEndToEndHeadersAndDropsHopByHopAndTheGatewaysOwn) {
  const HttpHeaders client = {{"host", "gw:8000"},
                              {"content-length", "12"},
                              {"content-type", "application/json"},
                              {"x-request-id", "r1"},
                              {"authorization", "Bearer k"},
                              {"traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
                              {"tracestate", "congo=t61rcWkgMzE"},
                              {"baggage", "userId=alice"},
                              {"connection", "keep-alive, X-Hop"},
                              {"connection", "close"},
                              {"x-hop", "1"},
                              {"keep-alive", "timeout=5"},
                              {"te", "trailers"},
                              {"trailer", "x-t"},
                              {"transfer-encoding", "chunked"},
                              {"upgrade", "h2c"},
                              {"proxy-authorization", "Basic x"},
                              {"expect", "100-continue"},
                              {"accept-encoding", "gzip"},
                              {"accept", "text/event-stream"},
                              {"x-custom", "a"},
                              {"x-custom", "b"}};
  HttpHeaders to = {{"content-type", "application/json"}};
  ForwardRequestHeaders(client, to);
  EXPECT_EQ(Names(to), (std::vector<std::string>{"content-type", "authorization", "traceparent", "tracestate",
                                                  "baggage", "accept", "x-custom", "x-custom"}));
  EXPECT_EQ(to[2].second, "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01");
}

TEST(ForwardResponseHeaders, PassesRetryAfterAndDropsFramingAndTheGatewaysOwn) {
  const HttpHeaders engine = {{"content-type", "application/json"},
                              {"content-length", "20"},
                              {"transfer-encoding", "chunked"},
                              {"connection", "x-engine-hop"},
                              {"x-engine-hop", "1"},
                              {"server", "uvicorn"},
                              {"date", "Sun, 06 Dec 2026 12:00:00 GMT"},
                              {"retry-after", "7"},
                              {"x-request-id", "theirs"},
                              {"x-kvrouter-worker-id", "9"},
                              {"cache-control", "no-cache"}};
  HttpHeaders to;
  ForwardResponseHeaders(engine, to);
  EXPECT_EQ(Names(to), (std::vector<std::string>{"content-type", "date", "retry-after", "cache-control"}));
}

TEST(IsHopByHop, ReadsEveryConnectionHeaderAndItsTokensInAnyCaseAndSpacing) {
  const HttpHeaders h = {{"connection", "  Foo ,\tBAR"}, {"connection", "baz"}};
  EXPECT_TRUE(IsHopByHop("foo", h));
  EXPECT_TRUE(IsHopByHop("bar", h));
  EXPECT_TRUE(IsHopByHop("baz", h));
  EXPECT_TRUE(IsHopByHop("proxy-connection", h));
  EXPECT_FALSE(IsHopByHop("fo", h));
  EXPECT_FALSE(IsHopByHop("traceparent", h));
  EXPECT_FALSE(IsHopByHop("x", {{"connection", ""}}));
}

}  // namespace
}  // namespace kvrouter
