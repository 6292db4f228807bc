#include "events/registration_codec.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/events/test_packer.h"

namespace kvrouter {
namespace {

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

// Section 13: a worker's role, connector and bootstrap port travel, and are left out at their
// defaults (an aggregated engine's registration is written as before).
TEST(WorkerRegistrationCodec, RoleConnectorAndBootstrapPortRoundTripAndDefaultsAreLeftOut) {
  const WorkerRegistration prefill{.worker_id = 3,
                                   .role = WorkerRole::kPrefill,
                                   .kv_connector = KvConnector::kSglang,
                                   .bootstrap_port = 9000};
  auto back = DecodeWorkerRegistration(AsBytes(EncodeWorkerRegistration(prefill)));
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, prefill);
  const WorkerRegistration decode{.worker_id = 4, .role = WorkerRole::kDecode};
  back = DecodeWorkerRegistration(AsBytes(EncodeWorkerRegistration(decode)));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->role, WorkerRole::kDecode);
  EXPECT_EQ(back->kv_connector, KvConnector::kNixl);
  EXPECT_EQ(back->bootstrap_port, kDefaultBootstrapPort);
  const WorkerRegistration both{.worker_id = 5};
  const auto bytes = EncodeWorkerRegistration(both);
  const std::string_view written(bytes.data(), bytes.size());
  for (const char* key : {"role", "kv_connector", "bootstrap_port"}) {
    EXPECT_EQ(written.find(key), std::string_view::npos) << key;
  }
  EXPECT_EQ(WorkerRoleName(WorkerRole::kBoth), "both");
  EXPECT_EQ(KvConnectorName(KvConnector::kSglang), "sglang");
}

TEST(WorkerRegistrationCodec, AnotherRoleOrConnectorOrAPortAbove65535IsInvalidArgument) {
  auto with = [](const char* key, auto value) {
    return MapOf(2, [&](TestPacker& p) {
      p.Key("worker_id");
      p.pk.pack(1);
      p.Key(key);
      p.pk.pack(value);
    });
  };
  ExpectInvalid(DecodeWorkerRegistration(AsBytes(with("role", "encode"))), "'role'");
  ExpectInvalid(DecodeWorkerRegistration(AsBytes(with("kv_connector", "mooncake"))), "'kv_connector'");
  ExpectInvalid(DecodeWorkerRegistration(AsBytes(with("bootstrap_port", 65536))), "'bootstrap_port'");
  auto ok = DecodeWorkerRegistration(AsBytes(with("bootstrap_port", 65535)));
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->bootstrap_port, 65535u);
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

}  // namespace
}  // namespace kvrouter
