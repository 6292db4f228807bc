#include "events/message_codec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/events/test_packer.h"

namespace kvrouter {
namespace {

// Packs a map of `n` entries; `pack_fields` writes them.
template <typename PackFields>
std::string MapOf(std::uint32_t n, PackFields pack_fields) {
  TestPacker p;
  p.pk.pack_map(n);
  pack_fields(p);
  return p.str();
}

// A route request map: token_ids [1, 2] followed by `n` more entries written by pack_fields.
template <typename PackFields>
std::string RouteRequestWith(std::uint32_t n, PackFields pack_fields) {
  return MapOf(n + 1, [&](TestPacker& p) {
    p.Key("token_ids");
    p.pk.pack(std::vector<std::uint32_t>{1, 2});
    pack_fields(p);
  });
}

// ---- Worker registration ----

TEST(WorkerRegistrationCodec, RegistrationRoundTrips) {
  WorkerRegistration reg{.worker_id = 0xfedcba9876543210ull,
                         .dp_start = 2,
                         .dp_size = 4,
                         .block_size = 32,
                         .total_kv_blocks = 100000,
                         .max_num_seqs = 64,
                         .max_num_batched_tokens = 4096,
                         .device = "cpu",
                         .lease_ms = 1500,
                         .leaving = true};
  auto r = DecodeWorkerRegistration(AsBytes(EncodeWorkerRegistration(reg)));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(*r, reg);

  reg.block_size.reset();
  reg.leaving = false;
  r = DecodeWorkerRegistration(AsBytes(EncodeWorkerRegistration(reg)));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(*r, reg);
}

TEST(WorkerRegistrationCodec, HttpUrlAndModelsRoundTripAndATrailingSlashIsDropped) {
  WorkerRegistration reg{.worker_id = 3, .http_url = "http://10.0.0.7:8000/", .models = {"llama", "qwen"}};
  auto r = DecodeWorkerRegistration(AsBytes(EncodeWorkerRegistration(reg)));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->http_url, "http://10.0.0.7:8000");
  EXPECT_EQ(r->models, (std::vector<std::string>{"llama", "qwen"}));
  reg = {.worker_id = 3};
  r = DecodeWorkerRegistration(AsBytes(EncodeWorkerRegistration(reg)));
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->http_url.empty());
  EXPECT_TRUE(r->models.empty());
}

TEST(WorkerRegistrationCodec, AnHttpUrlOrModelListOutOfBoundsIsInvalidArgument) {
  auto decode = [](WorkerRegistration reg) { return DecodeWorkerRegistration(AsBytes(EncodeWorkerRegistration(reg))); };
  EXPECT_EQ(decode({.worker_id = 1, .http_url = "ftp://x"}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(decode({.worker_id = 1, .http_url = "http://" + std::string(kMaxUrlBytes, 'a')}).status().code(),
            StatusCode::kInvalidArgument);
  WorkerRegistration many{.worker_id = 1};
  many.models.assign(kMaxModels + 1, "m");
  EXPECT_EQ(decode(many).status().code(), StatusCode::kInvalidArgument);
  many.models.assign(kMaxModels, "m");
  EXPECT_TRUE(decode(many).ok());
  EXPECT_EQ(decode({.worker_id = 1, .models = {std::string(kMaxNameBytes + 1, 'm')}}).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(WorkerRegistrationCodec, DefaultsApplyToAbsentFields) {
  auto body = MapOf(2, [](TestPacker& p) {
    p.Key("worker_id");
    p.pk.pack_fix_uint8(7);
    p.Key("unknown");
    p.pk.pack_array(0);
  });
  auto r = DecodeWorkerRegistration(AsBytes(body));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(*r, WorkerRegistration{.worker_id = 7});
}

TEST(WorkerRegistrationCodec, NilFieldsTakeTheirDefaults) {
  auto body = MapOf(3, [](TestPacker& p) {
    p.Key("worker_id");
    p.pk.pack(7);
    p.Key("dp_size");
    p.pk.pack_nil();
    p.Key("status");
    p.pk.pack_nil();
  });
  auto r = DecodeWorkerRegistration(AsBytes(body));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->dp_size, 1u);
  EXPECT_FALSE(r->leaving);
}

TEST(WorkerRegistrationCodec, MissingWorkerIdIsInvalidArgument) {
  auto body = MapOf(1, [](TestPacker& p) {
    p.Key("dp_size");
    p.pk.pack(1);
  });
  ExpectInvalid(DecodeWorkerRegistration(AsBytes(body)), "missing field 'worker_id'");
}

TEST(WorkerRegistrationCodec, ZeroDpSizeIsInvalidArgument) {
  auto body = MapOf(2, [](TestPacker& p) {
    p.Key("worker_id");
    p.pk.pack(1);
    p.Key("dp_size");
    p.pk.pack(0);
  });
  ExpectInvalid(DecodeWorkerRegistration(AsBytes(body)), "'dp_size'");
}

TEST(WorkerRegistrationCodec, DpRangeBeyondU32IsInvalidArgument) {
  auto body = MapOf(3, [](TestPacker& p) {
    p.Key("worker_id");
    p.pk.pack(1);
    p.Key("dp_start");
    p.pk.pack(0xffffffffu);
    p.Key("dp_size");
    p.pk.pack(2);
  });
  ExpectInvalid(DecodeWorkerRegistration(AsBytes(body)), "'dp_start'");
}

TEST(WorkerRegistrationCodec, DpRangeEndingAtTwoToThe32IsInvalidArgument) {
  // dp_start + dp_size must fit in a u32: rank 2^32-1 can never be registered.
  auto body = MapOf(3, [](TestPacker& p) {
    p.Key("worker_id");
    p.pk.pack(1);
    p.Key("dp_start");
    p.pk.pack(0xfffffffeu);
    p.Key("dp_size");
    p.pk.pack(2);
  });
  ExpectInvalid(DecodeWorkerRegistration(AsBytes(body)), "'dp_start'");
}

TEST(WorkerRegistrationCodec, LeaseIsClampedToItsBounds) {
  auto with_lease = [](std::uint64_t lease_ms) {
    return MapOf(2, [&](TestPacker& p) {
      p.Key("worker_id");
      p.pk.pack(1);
      p.Key("lease_ms");
      p.pk.pack(lease_ms);
    });
  };
  auto zero = DecodeWorkerRegistration(AsBytes(with_lease(0)));
  ASSERT_TRUE(zero.ok()) << zero.status().ToString();
  EXPECT_EQ(zero->lease_ms, kMinLeaseMs);
  auto huge = DecodeWorkerRegistration(AsBytes(with_lease(std::uint64_t{1} << 63)));
  ASSERT_TRUE(huge.ok()) << huge.status().ToString();
  EXPECT_EQ(huge->lease_ms, kMaxLeaseMs);
  auto usual = DecodeWorkerRegistration(AsBytes(with_lease(1500)));
  ASSERT_TRUE(usual.ok());
  EXPECT_EQ(usual->lease_ms, 1500u);
}

TEST(WorkerRegistrationCodec, OverlongDeviceNameIsInvalidArgument) {
  auto body = MapOf(2, [](TestPacker& p) {
    p.Key("worker_id");
    p.pk.pack(1);
    p.Key("device");
    p.pk.pack(std::string(kMaxNameBytes + 1, 'g'));
  });
  ExpectInvalid(DecodeWorkerRegistration(AsBytes(body)), "'device'");
}

TEST(WorkerRegistrationCodec, UnknownStatusIsInvalidArgument) {
  auto body = MapOf(2, [](TestPacker& p) {
    p.Key("worker_id");
    p.pk.pack(1);
    p.Key("status");
    p.pk.pack("down");
  });
  ExpectInvalid(DecodeWorkerRegistration(AsBytes(body)), "'status'");
}

TEST(WorkerRegistrationCodec, WrongTypesAreNamed) {
  auto negative_lease = MapOf(2, [](TestPacker& p) {
    p.Key("worker_id");
    p.pk.pack(1);
    p.Key("lease_ms");
    p.pk.pack(-5);
  });
  ExpectInvalid(DecodeWorkerRegistration(AsBytes(negative_lease)), "'lease_ms'");
  auto numeric_device = MapOf(2, [](TestPacker& p) {
    p.Key("worker_id");
    p.pk.pack(1);
    p.Key("device");
    p.pk.pack(0);
  });
  ExpectInvalid(DecodeWorkerRegistration(AsBytes(numeric_device)), "'device'");
}

TEST(WorkerRegistrationCodec, TruncatedBodyIsAnError) {
  auto body = EncodeWorkerRegistration({.worker_id = 1, .block_size = 16});
  ExpectEveryTruncationFails(AsBytes(body), DecodeWorkerRegistration);
}

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
                   .overlap_by_tier = {.device = 3, .host_pinned = 4, .disk = 5},
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

}  // namespace
}  // namespace kvrouter

namespace kvrouter {
namespace {

TEST(LifecycleCodec, AFreeCarriesTheEnginesTimingAndAPlainOneDoesNot) {
  const ResponseTiming t{.ttfb_ms = 12.5, .chunks = 17, .inter_chunk_ms_mean = 3.25, .inter_chunk_ms_max = 9};
  const auto body = EncodeLifecycleRequest("r1", t);
  EXPECT_EQ(*DecodeLifecycleRequest(AsBytes(body)), "r1");
  EXPECT_EQ(DecodeResponseTiming(AsBytes(body)), t);
  EXPECT_FALSE(DecodeResponseTiming(AsBytes(EncodeLifecycleRequest("r1"))));
  EXPECT_FALSE(DecodeResponseTiming(AsBytes(EncodeLifecycleRequest("r1", {.ttfb_ms = -1}))));  // not a time
}

TEST(ActiveSequenceCodec, RoundTripsEveryKind) {
  for (auto kind :
       {ActiveSequenceEvent::Kind::kAdd, ActiveSequenceEvent::Kind::kPrefillDone, ActiveSequenceEvent::Kind::kFree}) {
    ActiveSequenceEvent e{.router_id = 9,
                          .request_id = "r",
                          .worker_id = 3,
                          .dp_rank = 1,
                          .kind = kind,
                          .seq_hashes = {1, ~0ull},
                          .isl = 100,
                          .overlap_blocks = 2,
                          .epoch = 7,
                          .session_id = kind == ActiveSequenceEvent::Kind::kAdd ? "chat-7" : ""};
    auto back = DecodeActiveSequenceEvent(AsBytes(EncodeActiveSequenceEvent(e)));
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(*back, e);
  }
}

TEST(ActiveSequenceCodec, UnknownKindAndMissingFieldsAreInvalidArgument) {
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk(buf);
  pk.pack_map(4);
  PackKey(pk, "router_id");
  pk.pack(1);
  PackKey(pk, "request_id");
  pk.pack("r");
  PackKey(pk, "worker_id");
  pk.pack(2);
  PackKey(pk, "kind");
  pk.pack("teleport");
  auto r = DecodeActiveSequenceEvent(AsBytes(buf));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("kind"), std::string::npos);
  msgpack::sbuffer empty;
  msgpack::packer<msgpack::sbuffer> pk2(empty);
  pk2.pack_map(0);
  EXPECT_EQ(DecodeActiveSequenceEvent(AsBytes(empty)).status().code(), StatusCode::kInvalidArgument);
}

TEST(RouterHeartbeatCodec, RoundTripsAndNeedsARouterId) {
  const RouterHeartbeat h{.router_id = ~0ull, .interval_ms = 250, .epoch = 0xFFFFFFFFu};
  auto back = DecodeRouterHeartbeat(AsBytes(EncodeRouterHeartbeat(h)));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, h);
  {  // a replica without epochs (older kvrouter) is at epoch 0
    msgpack::sbuffer old;
    msgpack::packer<msgpack::sbuffer> pk(old);
    pk.pack_map(2);
    PackKey(pk, "router_id");
    pk.pack(5);
    PackKey(pk, "interval_ms");
    pk.pack(1000);
    auto r = DecodeRouterHeartbeat(AsBytes(old));
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(*r, (RouterHeartbeat{.router_id = 5, .interval_ms = 1000, .epoch = 0}));
  }
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk(buf);
  pk.pack_map(1);
  PackKey(pk, "interval_ms");
  pk.pack(1000);
  auto r = DecodeRouterHeartbeat(AsBytes(buf));
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("router_id"), std::string::npos);
}

// ---- kv_metrics ----

TEST(KvMetricsCodec, RoundTripsAtEveryIntegerWidth) {
  for (const KvMetrics& m :
       {KvMetrics{.worker_id = 7},
        KvMetrics{
            .worker_id = ~0ull, .dp_rank = 3, .active_decode_blocks = 70000, .active_prefill_tokens = 1ull << 40}}) {
    auto back = DecodeKvMetrics(AsBytes(EncodeKvMetrics(m)));
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(*back, m);
  }
}

TEST(KvMetricsCodec, DpRankDefaultsToZeroAndUnknownKeysAreIgnored) {
  auto body = MapOf(4, [](TestPacker& p) {
    p.Key("worker_id");
    p.pk.pack_fix_uint8(2);
    p.Key("active_decode_blocks");
    p.pk.pack_fix_uint16(300);
    p.Key("active_prefill_tokens");
    p.pk.pack(0);
    p.Key("extra");
    p.pk.pack_array(0);
  });
  auto r = DecodeKvMetrics(AsBytes(body));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(*r, (KvMetrics{.worker_id = 2, .active_decode_blocks = 300}));
}

TEST(KvMetricsCodec, MissingGaugesNegativeValuesAndTruncationsAreInvalidArgument) {
  auto no_gauge = MapOf(2, [](TestPacker& p) {
    p.Key("worker_id");
    p.pk.pack(2);
    p.Key("active_decode_blocks");
    p.pk.pack(1);
  });
  ExpectInvalid(DecodeKvMetrics(AsBytes(no_gauge)), "active_prefill_tokens");
  auto negative = MapOf(3, [](TestPacker& p) {
    p.Key("worker_id");
    p.pk.pack(2);
    p.Key("active_decode_blocks");
    p.pk.pack(-1);
    p.Key("active_prefill_tokens");
    p.pk.pack(1);
  });
  ExpectInvalid(DecodeKvMetrics(AsBytes(negative)), "active_decode_blocks");
  ExpectInvalid(DecodeKvMetrics(AsBytes(std::string_view("\x93\x01\x02\x03", 4))), "must be a map");
  const auto body = EncodeKvMetrics({.worker_id = 1, .dp_rank = 2, .active_decode_blocks = 3});
  ExpectEveryTruncationFails(AsBytes(body), [](auto b) { return DecodeKvMetrics(b); });
}

}  // namespace
}  // namespace kvrouter

namespace kvrouter {
namespace {

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
