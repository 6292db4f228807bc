#include "events/replica_sync_codec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/events/test_packer.h"

namespace kvrouter {
namespace {

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

// The bytes of a kv_metrics and of a heartbeat: every field, in the order of docs/protocol.md section 8.
TEST(KvMetricsCodec, KvMetricsAndHeartbeatsAreWrittenInTheWiresOrder) {
  const msgpack::sbuffer metrics =
      EncodeKvMetrics({.worker_id = 7, .dp_rank = 1, .active_decode_blocks = 300, .active_prefill_tokens = 2});
  EXPECT_EQ(std::string(metrics.data(), metrics.size()), MapOf(4, [](TestPacker& p) {
              p.Key("worker_id");
              p.pk.pack(std::uint64_t{7});
              p.Key("dp_rank");
              p.pk.pack(std::uint32_t{1});
              p.Key("active_decode_blocks");
              p.pk.pack(std::uint64_t{300});
              p.Key("active_prefill_tokens");
              p.pk.pack(std::uint64_t{2});
            }));
  const msgpack::sbuffer heartbeat = EncodeRouterHeartbeat({.router_id = 9, .interval_ms = 1000, .epoch = 3});
  EXPECT_EQ(std::string(heartbeat.data(), heartbeat.size()), MapOf(3, [](TestPacker& p) {
              p.Key("router_id");
              p.pk.pack(std::uint64_t{9});
              p.Key("interval_ms");
              p.pk.pack(std::uint32_t{1000});
              p.Key("epoch");
              p.pk.pack(std::uint32_t{3});
            }));
}

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
