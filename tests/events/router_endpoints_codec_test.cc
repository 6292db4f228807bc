#include "events/router_endpoints_codec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/events/test_packer.h"

namespace kvrouter {
namespace {

// ---- Route request ----

TEST(RouteRequestCodec, TokenRequestRoundTrips) {
  RouteRequest req{.request_id = "req-1",
                   .token_ids = {1, 2, 3, 0xffffffffu},
                   .has_token_ids = true,
                   .isl = 4,
                   .lora_name = "my-adapter",
                   .update_states = false,
                   .priority = -3,
                   .expected_output_tokens = 128,
                   .worker_id = 0xffffffffffffffffull,
                   .dp_rank = 2,
                   .allowed_worker_ids = std::vector<std::uint64_t>{5, 6},
                   .config_override = {.overlap_score_credit = 1.5, .router_temperature = 0},
                   .timeout_ms = 2500,
                   .max_tokens = 64,
                   .session_id = "chat-7",
                   .excluded_worker_ids = std::vector<std::uint64_t>{9}};
  auto r = DecodeRouteRequest(AsBytes(EncodeRouteRequest(req)));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(*r, req);
}

TEST(RouteRequestCodec, BlockHashRequestRoundTrips) {
  RouteRequest req{.block_hashes = {0xffffffffffffffffull, 2}, .isl = 130};
  auto r = DecodeRouteRequest(AsBytes(EncodeRouteRequest(req)));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(*r, req);
  EXPECT_FALSE(r->has_token_ids);
}

TEST(RouteRequestCodec, MinimalRequestTakesDefaults) {
  auto r = DecodeRouteRequest(AsBytes(RouteRequestWith(0, [](TestPacker&) {})));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(*r, (RouteRequest{.token_ids = {1, 2}, .has_token_ids = true, .isl = 2}));
  EXPECT_TRUE(r->update_states);
  EXPECT_EQ(r->priority, 0);
}

TEST(RouteRequestCodec, TokenIdsWinOverBlockHashes) {
  auto body = RouteRequestWith(2, [](TestPacker& p) {
    p.Key("block_hashes");
    p.pk.pack("not even an array");  // not read when token_ids come
    p.Key("isl");
    p.pk.pack(999);
  });
  auto r = DecodeRouteRequest(AsBytes(body));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->has_token_ids);
  EXPECT_EQ(r->isl, 2u);
  EXPECT_TRUE(r->block_hashes.empty());
}

TEST(RouteRequestCodec, NegativeBlockHashIsReinterpreted) {
  auto body = MapOf(2, [](TestPacker& p) {
    p.Key("block_hashes");
    p.pk.pack_array(1);
    p.pk.pack_fix_int64(-1);
    p.Key("isl");
    p.pk.pack_fix_uint16(64);
  });
  auto r = DecodeRouteRequest(AsBytes(body));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->block_hashes, std::vector<std::uint64_t>{0xffffffffffffffffull});
  EXPECT_EQ(r->isl, 64u);
}

TEST(RouteRequestCodec, MissingPromptIsInvalidArgument) {
  auto body = MapOf(1, [](TestPacker& p) {
    p.Key("request_id");
    p.pk.pack("r");
  });
  ExpectInvalid(DecodeRouteRequest(AsBytes(body)), "'token_ids' or 'block_hashes'");
}

TEST(RouteRequestCodec, BlockHashesWithoutIslIsInvalidArgument) {
  auto body = MapOf(1, [](TestPacker& p) {
    p.Key("block_hashes");
    p.pk.pack(std::vector<std::uint64_t>{1});
  });
  ExpectInvalid(DecodeRouteRequest(AsBytes(body)), "missing field 'isl'");
}

TEST(RouteRequestCodec, PriorityFromAgentHints) {
  auto body = RouteRequestWith(1, [](TestPacker& p) {
    p.Key("nvext");
    p.pk.pack_map(2);
    p.Key("other");
    p.pk.pack(1);
    p.Key("agent_hints");
    p.pk.pack_map(2);
    p.Key("priority");
    p.pk.pack_fix_int8(-4);
    p.Key("osl");
    p.pk.pack(300);
  });
  auto r = DecodeRouteRequest(AsBytes(body));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->priority, -4);
  EXPECT_EQ(r->expected_output_tokens, 300u);
}

TEST(RouteRequestCodec, TopLevelPriorityWinsOverAgentHints) {
  auto body = RouteRequestWith(3, [](TestPacker& p) {
    p.Key("priority");
    p.pk.pack(9);
    p.Key("nvext");
    p.pk.pack_map(1);
    p.Key("agent_hints");
    p.pk.pack_map(2);
    p.Key("priority");
    p.pk.pack(1);
    p.Key("osl");
    p.pk.pack(300);
    p.Key("expected_output_tokens");
    p.pk.pack(50);
  });
  auto r = DecodeRouteRequest(AsBytes(body));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->priority, 9);
  EXPECT_EQ(r->expected_output_tokens, 50u);
}

TEST(RouteRequestCodec, NvextThatIsNotAMapIsInvalidArgument) {
  auto body = RouteRequestWith(1, [](TestPacker& p) {
    p.Key("nvext");
    p.pk.pack(1);
  });
  ExpectInvalid(DecodeRouteRequest(AsBytes(body)), "'nvext'");
  auto hints = RouteRequestWith(1, [](TestPacker& p) {
    p.Key("nvext");
    p.pk.pack_map(1);
    p.Key("agent_hints");
    p.pk.pack("x");
  });
  ExpectInvalid(DecodeRouteRequest(AsBytes(hints)), "'agent_hints'");
  auto osl = RouteRequestWith(1, [](TestPacker& p) {
    p.Key("nvext");
    p.pk.pack_map(1);
    p.Key("agent_hints");
    p.pk.pack_map(1);
    p.Key("osl");
    p.pk.pack(-1);
  });
  ExpectInvalid(DecodeRouteRequest(AsBytes(osl)), "'nvext.agent_hints.osl'");
}

TEST(RouteRequestCodec, ConfigOverrideAcceptsIntsAndFloats) {
  auto body = RouteRequestWith(1, [](TestPacker& p) {
    p.Key("router_config_override");
    p.pk.pack_map(3);
    p.Key("overlap_score_credit");
    p.pk.pack_fix_uint8(2);
    p.Key("prefill_load_scale");
    p.pk.pack_float(0.5f);
    p.Key("router_temperature");
    p.pk.pack_double(0.25);
  });
  auto r = DecodeRouteRequest(AsBytes(body));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->config_override, (RouterConfigOverride{2.0, 0.5, 0.25}));
}

TEST(RouteRequestCodec, NegativeConfigOverrideIsInvalidArgument) {
  for (std::string_view field : {"overlap_score_credit", "prefill_load_scale", "router_temperature"}) {
    auto body = RouteRequestWith(1, [&](TestPacker& p) {
      p.Key("router_config_override");
      p.pk.pack_map(1);
      p.Key(field);
      p.pk.pack_double(-0.5);
    });
    ExpectInvalid(DecodeRouteRequest(AsBytes(body)), "'" + std::string(field) + "'");
  }
  auto negative_int = RouteRequestWith(1, [](TestPacker& p) {
    p.Key("router_config_override");
    p.pk.pack_map(1);
    p.Key("router_temperature");
    p.pk.pack(-1);
  });
  ExpectInvalid(DecodeRouteRequest(AsBytes(negative_int)), "'router_temperature'");
  auto nan = RouteRequestWith(1, [](TestPacker& p) {
    p.Key("router_config_override");
    p.pk.pack_map(1);
    p.Key("prefill_load_scale");
    p.pk.pack_double(std::numeric_limits<double>::quiet_NaN());
  });
  ExpectInvalid(DecodeRouteRequest(AsBytes(nan)), "'prefill_load_scale'");
}

TEST(RouteRequestCodec, WrongTypesAreNamed) {
  auto bad_allowed = RouteRequestWith(1, [](TestPacker& p) {
    p.Key("allowed_worker_ids");
    p.pk.pack_array(2);
    p.pk.pack(1);
    p.pk.pack("two");
  });
  ExpectInvalid(DecodeRouteRequest(AsBytes(bad_allowed)), "'allowed_worker_ids'");
  auto big_timeout = RouteRequestWith(1, [](TestPacker& p) {
    p.Key("timeout_ms");
    p.pk.pack_uint64(std::uint64_t{1} << 32);
  });
  ExpectInvalid(DecodeRouteRequest(AsBytes(big_timeout)), "'timeout_ms'");
  auto int_update = RouteRequestWith(1, [](TestPacker& p) {
    p.Key("update_states");
    p.pk.pack(0);
  });
  ExpectInvalid(DecodeRouteRequest(AsBytes(int_update)), "'update_states'");
  auto big_token = MapOf(1, [](TestPacker& p) {
    p.Key("token_ids");
    p.pk.pack_array(1);
    p.pk.pack_uint64(std::uint64_t{1} << 32);
  });
  ExpectInvalid(DecodeRouteRequest(AsBytes(big_token)), "'token_ids'");
}

// token_ids is read straight from the bytes when it is a well-formed array; the result must be
// what the general path gives, in every integer form, anywhere in the map, first key winning.
TEST(RouteRequestCodec, TokenIdsDecodeAlikeInEveryIntegerFormAndPlace) {
  auto tokens = [](TestPacker& p) {
    p.Key("token_ids");
    p.pk.pack_array(8);
    p.pk.pack_fix_uint8(5);       // 0xcc
    p.pk.pack_fix_uint16(300);    // 0xcd
    p.pk.pack_fix_uint32(70000);  // 0xce
    p.pk.pack_fix_uint64(9);      // 0xcf
    p.pk.pack_fix_int8(7);        // 0xd0, not negative
    p.pk.pack_fix_int32(123456);  // 0xd2
    p.pk.pack(3);                 // positive fixint
    p.pk.pack(4294967295u);       // the largest u32
  };
  const std::vector<std::uint32_t> want = {5, 300, 70000, 9, 7, 123456, 3, 4294967295u};
  auto others = [](TestPacker& p) {
    p.Key("request_id");
    p.pk.pack("r-1");
    p.Key("priority");
    p.pk.pack(-2);
  };
  const std::string first = MapOf(3, [&](TestPacker& p) {
    tokens(p);
    others(p);
  });
  const std::string last = MapOf(3, [&](TestPacker& p) {
    others(p);
    tokens(p);
  });
  const std::string twice = MapOf(4, [&](TestPacker& p) {  // a second token_ids is ignored
    tokens(p);
    others(p);
    p.Key("token_ids");
    p.pk.pack_array(1);
    p.pk.pack(99);
  });
  const std::string int_key_first = MapOf(4, [&](TestPacker& p) {  // a key that is not a string
    p.pk.pack(17);
    p.pk.pack("ignored");
    tokens(p);
    others(p);
  });
  for (const std::string& body : {first, last, twice, int_key_first}) {
    auto r = DecodeRouteRequest(AsBytes(body));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->token_ids, want);
    EXPECT_TRUE(r->has_token_ids);
    EXPECT_EQ(r->isl, 8u);
    EXPECT_EQ(r->request_id, "r-1");
    EXPECT_EQ(r->priority, -2);
  }
  auto negative = MapOf(1, [](TestPacker& p) {
    p.Key("token_ids");
    p.pk.pack_array(2);
    p.pk.pack(1);
    p.pk.pack(-1);
  });
  ExpectInvalid(DecodeRouteRequest(AsBytes(negative)), "(element 1)");
  auto nil_tokens = MapOf(3, [](TestPacker& p) {  // nil token_ids: block_hashes are used
    p.Key("token_ids");
    p.pk.pack_nil();
    p.Key("block_hashes");
    p.pk.pack_array(1);
    p.pk.pack(42);
    p.Key("isl");
    p.pk.pack(16);
  });
  auto r = DecodeRouteRequest(AsBytes(nil_tokens));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_FALSE(r->has_token_ids);
  EXPECT_EQ(r->block_hashes, std::vector<std::uint64_t>{42});
  const std::string trailing = first + "x";  // bytes after the map are refused either way
  EXPECT_FALSE(DecodeRouteRequest(AsBytes(trailing)).ok());
}

TEST(RouteRequestCodec, UnknownKeysAreIgnored) {
  auto body = RouteRequestWith(3, [](TestPacker& p) {
    p.Key("model");
    p.pk.pack("llama");
    p.Key("stream");
    p.pk.pack(true);
    p.Key("router_config_override");
    p.pk.pack_map(1);
    p.Key("future_knob");
    p.pk.pack(-1);
  });
  auto r = DecodeRouteRequest(AsBytes(body));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->config_override, RouterConfigOverride{});
}

TEST(RouteRequestCodec, TruncatedBodyIsAnError) {
  RouteRequest req{.request_id = "r",
                   .token_ids = {1, 2, 3},
                   .has_token_ids = true,
                   .isl = 3,
                   .priority = 1,
                   .config_override = {.prefill_load_scale = 2}};
  ExpectEveryTruncationFails(AsBytes(EncodeRouteRequest(req)), DecodeRouteRequest);
}

TEST(RouteRequestCodec, HugeDeclaredArrayIsRefusedWithoutAllocating) {
  TestPacker p;
  p.pk.pack_map(1);
  p.Key("token_ids");
  std::string body = p.str() + std::string(kHugeArrayHeader);
  ExpectInvalid(DecodeRouteRequest(AsBytes(body)), "declares 4294967295 elements");
}

TEST(RouteRequestCodec, DeepNestingIsRefused) {
  auto body = RouteRequestWith(1, [](TestPacker& p) {
    p.Key("nvext");
    for (int i = 0; i < 20; ++i) {
      p.pk.pack_map(1);
      p.Key("agent_hints");
    }
    p.pk.pack_map(0);
  });
  ExpectInvalid(DecodeRouteRequest(AsBytes(body)), "nests deeper");
}

TEST(RouteRequestCodec, BodyThatIsNotAMapIsInvalidArgument) {
  TestPacker p;
  p.pk.pack_array(0);
  ExpectInvalid(DecodeRouteRequest(p.bytes()), "must be a map");
}

// ---- Route reply, error replies, lifecycle ----

TEST(RouteRequestCodec, MultimodalItemsRoundTripAndAreBounded) {
  RouteRequest req{.token_ids = {1, 2, 3, 4, 5, 6, 7, 8}, .has_token_ids = true, .isl = 8};
  req.mm_items = {{.hash = 0xfedcba9876543210ull, .offset = 2, .length = 4}, {.hash = 7, .offset = 0, .length = 1}};
  auto back = DecodeRouteRequest(AsBytes(EncodeRouteRequest(req)));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->mm_items, req.mm_items);
  req.mm_items.assign(kMaxMmItems + 1, MmItem{.hash = 1, .offset = 0, .length = 1});
  EXPECT_EQ(DecodeRouteRequest(AsBytes(EncodeRouteRequest(req))).status().code(), StatusCode::kInvalidArgument);
  auto no_length = MapOf(2, [](TestPacker& p) {
    p.Key("token_ids");
    p.pk.pack(std::vector<std::uint32_t>{1, 2, 3, 4});
    p.Key("mm_items");
    p.pk.pack_array(1);
    p.pk.pack_map(2);
    p.Key("hash");
    p.pk.pack(1);
    p.Key("offset");
    p.pk.pack(0);
  });
  auto bad = DecodeRouteRequest(AsBytes(no_length));
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("mm_items"), std::string::npos);
}

TEST(RouteReplyCodec, RouteReplyRoundTrips) {
  RouteReply reply{.worker_id = 0xffffffffffffffffull,
                   .dp_rank = 1,
                   .overlap_blocks = 3,
                   .overlap_by_tier = {.device = 3, .host_pinned = 4, .any_tier = 5},
                   .request_blocks = 5,
                   .cached_tokens = 192,
                   .queued_ms = 1.25};
  auto r = DecodeRouteReply(AsBytes(EncodeRouteReply(reply)));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(*r, reply);
  // The tiers are sent cumulative, never below overlap_blocks; absent, they read as it.
  RouteReply flat{.overlap_blocks = 2, .overlap_by_tier = {.host_pinned = 1}};
  r = DecodeRouteReply(AsBytes(EncodeRouteReply(flat)));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->overlap_by_tier, (OverlapByTier{2, 2, 2}));
  auto old = MapOf(6, [](TestPacker& p) {
    p.Key("worker_id");
    p.pk.pack(1);
    p.Key("dp_rank");
    p.pk.pack(0);
    p.Key("overlap_blocks");
    p.pk.pack(4);
    p.Key("request_blocks");
    p.pk.pack(6);
    p.Key("cached_tokens");
    p.pk.pack(16);
    p.Key("queued_ms");
    p.pk.pack(0.0);
  });
  r = DecodeRouteReply(AsBytes(old));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->overlap_by_tier, (OverlapByTier{4, 4, 4}));
  reply.http_url = "http://engine-3:8000";
  r = DecodeRouteReply(AsBytes(EncodeRouteReply(reply)));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(*r, reply);
  EXPECT_TRUE(DecodeErrorReply(AsBytes(EncodeRouteReply(reply))).ok());
}

// The bytes of a reply, key by key in the order of docs/protocol.md section 5, overlap_by_tier
// lifted and last.
TEST(RouteReplyCodec, RouteReplyIsWrittenInTheWiresOrder) {
  const RouteReply reply{.worker_id = 7,
                         .dp_rank = 1,
                         .overlap_blocks = 3,
                         .overlap_by_tier = {.device = 0, .host_pinned = 4, .any_tier = 2},
                         .request_blocks = 5,
                         .cached_tokens = 48,
                         .queued_ms = 0.5,
                         .http_url = "http://e:1"};
  const std::string want = MapOf(8, [](TestPacker& p) {
    p.Key("worker_id");
    p.pk.pack(std::uint64_t{7});
    p.Key("dp_rank");
    p.pk.pack(std::uint32_t{1});
    p.Key("overlap_blocks");
    p.pk.pack(std::uint32_t{3});
    p.Key("request_blocks");
    p.pk.pack(std::uint32_t{5});
    p.Key("cached_tokens");
    p.pk.pack(std::uint32_t{48});
    p.Key("queued_ms");
    p.pk.pack(0.5);
    p.Key("http_url");
    p.pk.pack(std::string("http://e:1"));
    p.Key("overlap_by_tier");
    p.pk.pack_map(3);
    p.Key("device");
    p.pk.pack(std::uint32_t{3});
    p.Key("host_pinned");
    p.pk.pack(std::uint32_t{4});
    p.Key("disk");
    p.pk.pack(std::uint32_t{4});
  });
  const msgpack::sbuffer got = EncodeRouteReply(reply);
  EXPECT_EQ(std::string(got.data(), got.size()), want);
}

// Section 13: a disaggregated reply adds its prefill rank after overlap_by_tier, and for SGLang
// the bootstrap fields; a reply that is not disaggregated carries none of them.
TEST(RouteReplyCodec, DisaggregatedRepliesRoundTripWithTheirFieldsLast) {
  RouteReply nixl{.worker_id = 3,
                  .request_blocks = 2,
                  .cached_tokens = 64,
                  .disaggregated = true,
                  .prefill_worker_id = 1,
                  .prefill_dp_rank = 2,
                  .prefill_http_url = "http://p:1",
                  .prefill_cached_tokens = 64,
                  .kv_connector = "nixl"};
  auto r = DecodeRouteReply(AsBytes(EncodeRouteReply(nixl)));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(*r, nixl);
  RouteReply sglang = nixl;
  sglang.kv_connector = "sglang";
  sglang.bootstrap_host = "p";
  sglang.bootstrap_port = 8998;
  sglang.bootstrap_room = (std::uint64_t{1} << 62) + 5;
  r = DecodeRouteReply(AsBytes(EncodeRouteReply(sglang)));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(*r, sglang);
  const msgpack::sbuffer body = EncodeRouteReply(sglang);
  const std::string bytes(body.data(), body.size());
  const std::vector<std::string> keys = {"overlap_by_tier",  "disaggregated",         "prefill_worker_id",
                                         "prefill_dp_rank",  "prefill_http_url",      "prefill_cached_tokens",
                                         "kv_connector",     "bootstrap_host",        "bootstrap_port",
                                         "bootstrap_room"};
  std::size_t at = 0;
  for (const std::string& k : keys) {
    const std::size_t found = bytes.find(k, at);
    ASSERT_NE(found, std::string::npos) << k;
    at = found + k.size();
  }
  // Not disaggregated: none of them, whatever the members hold.
  RouteReply whole = sglang;
  whole.disaggregated = false;
  const msgpack::sbuffer plain = EncodeRouteReply(whole);
  const std::string plain_bytes(plain.data(), plain.size());
  for (std::size_t i = 1; i < keys.size(); ++i) EXPECT_EQ(plain_bytes.find(keys[i]), std::string::npos) << keys[i];
  // A disaggregated reply without its prefill rank is refused.
  auto missing = MapOf(7, [](TestPacker& p) {
    p.Key("worker_id");
    p.pk.pack(1);
    p.Key("dp_rank");
    p.pk.pack(0);
    p.Key("overlap_blocks");
    p.pk.pack(0);
    p.Key("request_blocks");
    p.pk.pack(0);
    p.Key("cached_tokens");
    p.pk.pack(0);
    p.Key("queued_ms");
    p.pk.pack(0.0);
    p.Key("disaggregated");
    p.pk.pack(true);
  });
  ExpectInvalid(DecodeRouteReply(AsBytes(missing)), "missing field 'prefill_worker_id'");
}

TEST(RouteReplyCodec, RouteReplyMissingAFieldIsInvalidArgument) {
  auto body = MapOf(1, [](TestPacker& p) {
    p.Key("worker_id");
    p.pk.pack(1);
  });
  ExpectInvalid(DecodeRouteReply(AsBytes(body)), "missing field 'dp_rank'");
}

TEST(RouteReplyCodec, ErrorReplyRoundTrips) {
  for (StatusCode code : {StatusCode::kInvalidArgument, StatusCode::kNoWorkers, StatusCode::kOverloaded,
                          StatusCode::kTimeout, StatusCode::kNotFound, StatusCode::kInternal}) {
    const Status sent(code, "because");
    auto body = EncodeErrorReply(sent);
    Status got = DecodeErrorReply(AsBytes(body));
    EXPECT_EQ(got.code(), code);
    EXPECT_EQ(got.message(), "because");
    auto reply = DecodeRouteReply(AsBytes(body));
    ASSERT_FALSE(reply.ok());
    EXPECT_EQ(reply.status().code(), code);
    EXPECT_EQ(reply.status().message(), "because");
  }
}

TEST(RouteReplyCodec, UnknownOrOkErrorCodeReadsAsInternal) {
  for (std::string_view code : {"teapot", "ok"}) {
    auto body = MapOf(1, [&](TestPacker& p) {
      p.Key("error");
      p.pk.pack_map(1);
      p.Key("code");
      p.pk.pack(code);
    });
    Status got = DecodeErrorReply(AsBytes(body));
    EXPECT_EQ(got.code(), StatusCode::kInternal) << code;
    EXPECT_EQ(got.message(), "");
    EXPECT_EQ(DecodeRouteReply(AsBytes(body)).status().code(), StatusCode::kInternal);
  }
}

TEST(RouteReplyCodec, MalformedErrorReplyIsInternal) {
  auto not_map = MapOf(1, [](TestPacker& p) {
    p.Key("error");
    p.pk.pack("boom");
  });
  EXPECT_EQ(DecodeErrorReply(AsBytes(not_map)).code(), StatusCode::kInternal);
  auto no_code = MapOf(1, [](TestPacker& p) {
    p.Key("error");
    p.pk.pack_map(1);
    p.Key("message");
    p.pk.pack("m");
  });
  EXPECT_EQ(DecodeRouteReply(AsBytes(no_code)).status().code(), StatusCode::kInternal);
}

TEST(RouteReplyCodec, OkReplyIsNotAnError) {
  auto body = EncodeOkReply();
  EXPECT_TRUE(DecodeErrorReply(AsBytes(body)).ok());
  auto doc = ParseMsgpack(AsBytes(body));
  ASSERT_TRUE(doc.ok());
  EXPECT_EQ(*ReadBool(FindKey(doc->get(), "ok"), "ok"), true);
}

TEST(RouteReplyCodec, UndecodableReplyIsInvalidArgument) {
  EXPECT_EQ(DecodeErrorReply(AsBytes(std::string_view("\x92\x01", 2))).code(), StatusCode::kInvalidArgument);
  ExpectEveryTruncationFails(AsBytes(EncodeRouteReply({})), DecodeRouteReply);
}

TEST(LifecycleCodec, LifecycleRequestRoundTrips) {
  auto r = DecodeLifecycleRequest(AsBytes(EncodeLifecycleRequest("req-9")));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(*r, "req-9");
}

TEST(LifecycleCodec, MissingOrEmptyRequestIdIsInvalidArgument) {
  ExpectInvalid(DecodeLifecycleRequest(AsBytes(EncodeLifecycleRequest(""))), "'request_id'");
  auto body = MapOf(1, [](TestPacker& p) {
    p.Key("id");
    p.pk.pack("x");
  });
  ExpectInvalid(DecodeLifecycleRequest(AsBytes(body)), "missing field 'request_id'");
  auto numeric = MapOf(1, [](TestPacker& p) {
    p.Key("request_id");
    p.pk.pack(5);
  });
  ExpectInvalid(DecodeLifecycleRequest(AsBytes(numeric)), "'request_id'");
}

TEST(LifecycleCodec, TruncatedBodyIsAnError) {
  ExpectEveryTruncationFails(AsBytes(EncodeLifecycleRequest("abc")), DecodeLifecycleRequest);
}

TEST(LifecycleCodec, AFreeCarriesTheEnginesTimingAndAPlainOneDoesNot) {
  const ResponseTiming t{.ttfb_ms = 12.5, .chunks = 17, .inter_chunk_ms_mean = 3.25, .inter_chunk_ms_max = 9};
  const auto body = EncodeLifecycleRequest("r1", t);
  EXPECT_EQ(*DecodeLifecycleRequest(AsBytes(body)), "r1");
  EXPECT_EQ(DecodeResponseTiming(AsBytes(body)), t);
  EXPECT_FALSE(DecodeResponseTiming(AsBytes(EncodeLifecycleRequest("r1"))));
  EXPECT_FALSE(DecodeResponseTiming(AsBytes(EncodeLifecycleRequest("r1", {.ttfb_ms = -1}))));  // not a time
}

// ---- stats ----

StatsReply SampleStats(std::size_t ranks) {
  StatsReply r;
  for (std::size_t i = 0; i < ranks; ++i) {
    r.workers.push_back({.worker_id = 1000 + i,
                         .dp_rank = static_cast<std::uint32_t>(i % 3),
                         .blocks = i,
                         .active_blocks = 2 * i,
                         .active_prefill_tokens = 3 * i,
                         .active_requests = static_cast<std::uint32_t>(i),
                         .device = "gpu",
                         .routed_requests = 5 * i});
  }
  r.workers_total = ranks;
  r.counters = {{"queue_length", 4}, {"events_applied", 99}};
  r.breakdowns = {{"events_dropped", {{"decode_error", 2}, {"duplicate", 0}}}, {"routed", {{"kv", 7}}}};
  return r;
}

TEST(StatsCodec, ReplyRoundTrips) {
  StatsReply r = SampleStats(3);
  const StatsReply sent = r;
  auto body = EncodeStatsReply(r, 1 << 20);
  ASSERT_TRUE(body.ok()) << body.status().ToString();
  EXPECT_EQ(r, sent);  // everything fit: nothing trimmed, no next page
  auto back = DecodeStatsReply(AsBytes(*body));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, sent);
}

TEST(StatsCodec, PageIsTrimmedToFitAndPointsAtTheNextRank) {
  StatsReply r = SampleStats(1000);
  r.offset = 5000;
  r.workers_total = 9000;
  auto body = EncodeStatsReply(r, 4096);
  ASSERT_TRUE(body.ok()) << body.status().ToString();
  EXPECT_LE(body->size(), 4096u);
  auto back = DecodeStatsReply(AsBytes(*body));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ASSERT_GT(back->workers.size(), 0u);
  ASSERT_LT(back->workers.size(), 1000u);
  EXPECT_EQ(back->workers.front().worker_id, 1000u);  // the page's head is kept, in order
  ASSERT_TRUE(back->next_offset.has_value());
  EXPECT_EQ(*back->next_offset, 5000 + back->workers.size());
  EXPECT_EQ(back->counters.at("queue_length"), 4u);
}

TEST(StatsCodec, LastPageHasNoNextOffset) {
  StatsReply r = SampleStats(2);
  r.offset = 8;
  r.workers_total = 10;
  auto body = EncodeStatsReply(r, 1 << 20);
  ASSERT_TRUE(body.ok());
  auto back = DecodeStatsReply(AsBytes(*body));
  ASSERT_TRUE(back.ok());
  EXPECT_FALSE(back->next_offset.has_value());
  EXPECT_EQ(back->offset, 8u);
}

TEST(StatsCodec, ReplyThatCannotFitIsInternal) {
  StatsReply r = SampleStats(1);
  auto body = EncodeStatsReply(r, 16);
  ASSERT_FALSE(body.ok());
  EXPECT_EQ(body.status().code(), StatusCode::kInternal);
}

TEST(StatsCodec, ErrorReplyDecodesToItsStatus) {
  auto body = EncodeErrorReply(Status(StatusCode::kOverloaded, "busy"));
  auto back = DecodeStatsReply(AsBytes(body));
  ASSERT_FALSE(back.ok());
  EXPECT_EQ(back.status().code(), StatusCode::kOverloaded);
}

TEST(StatsCodec, RequestDefaultsAndLimitClamp) {
  auto empty = DecodeStatsRequest({});
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(*empty, StatsRequest{});
  auto empty_map = DecodeStatsRequest(AsBytes(std::string_view("\x80", 1)));
  ASSERT_TRUE(empty_map.ok());
  EXPECT_EQ(empty_map->limit, StatsRequest::kDefaultLimit);
  auto page = DecodeStatsRequest(AsBytes(EncodeStatsRequest({.offset = 7, .limit = 3})));
  ASSERT_TRUE(page.ok());
  EXPECT_EQ(*page, (StatsRequest{.offset = 7, .limit = 3}));
  auto huge = MapOf(1, [](TestPacker& p) {
    p.Key("limit");
    p.pk.pack(std::uint64_t{1} << 40);
  });
  auto clamped = DecodeStatsRequest(AsBytes(huge));
  ASSERT_TRUE(clamped.ok());
  EXPECT_EQ(clamped->limit, StatsRequest::kMaxLimit);
  auto negative = MapOf(1, [](TestPacker& p) {
    p.Key("offset");
    p.pk.pack(-1);
  });
  ExpectInvalid(DecodeStatsRequest(AsBytes(negative)), "'offset'");
}

}  // namespace
}  // namespace kvrouter
