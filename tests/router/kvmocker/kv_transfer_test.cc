// kv_transfer_params and SGLang's bootstrap fields as kvmocker parses and builds them
// (router/kvmocker/kv_transfer.h, docs/protocol.md section 13 "kvmocker's roles"), and the face
// handing them to the fleet.
#include "router/kvmocker/kv_transfer.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "router/kvmocker/openai_face.h"

namespace kvrouter {
namespace {

using Json = nlohmann::json;

KvTransferParams Sample() {
  return {.remote_engine = {.worker_id = 281474976710655, .dp_rank = 3},
          .remote_block_ids = {0, 1, 18446744073709551615ull},
          .remote_host = "10.0.0.7",
          .remote_port = 8001,
          .remote_request_id = "42"};
}

Json DecodeParams() { return Json::parse(KvTransferParamsJson(Sample())); }

LegFields Legs(const Json& body) {
  auto legs = ParseLegFields(body.dump());
  EXPECT_TRUE(legs.ok()) << body.dump() << ": " << legs.status().message();
  return legs.ok() ? std::move(legs).value() : LegFields{};
}

TEST(KvTransferTest, PrefillAnswerHasVllmFieldsAndBlockIdsAsUnsigned64) {
  const Json j = DecodeParams();
  EXPECT_EQ(j["do_remote_prefill"], true);
  EXPECT_EQ(j["do_remote_decode"], false);
  EXPECT_EQ(j["remote_engine_id"], "281474976710655_dp3");
  EXPECT_EQ(j["remote_block_ids"], Json::array({0, 1, 18446744073709551615ull}));
  EXPECT_TRUE(j["remote_block_ids"][2].is_number_unsigned());
  EXPECT_EQ(j["remote_host"], "10.0.0.7");
  EXPECT_EQ(j["remote_port"], 8001);
  EXPECT_EQ(j["remote_request_id"], "42");
  EXPECT_EQ(j["tp_size"], 1);
}

TEST(KvTransferTest, ParamsRoundTrip) {
  auto back = ParseKvTransferParams(KvTransferParamsJson(Sample()));
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_EQ(back->remote_engine, Sample().remote_engine);
  EXPECT_EQ(back->remote_block_ids, Sample().remote_block_ids);
  EXPECT_EQ(back->remote_host, "10.0.0.7");
  EXPECT_EQ(back->remote_port, 8001);
  EXPECT_EQ(back->remote_request_id, "42");
}

TEST(KvTransferTest, RemoteEngineIdNamesWorkerAndRank) {
  EXPECT_EQ(FormatRemoteEngineId({.worker_id = 7, .dp_rank = 0}), "7_dp0");
  auto e = ParseRemoteEngineId("7_dp2");
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->worker_id, 7u);
  EXPECT_EQ(e->dp_rank, 2u);
  for (const char* bad : {"", "7", "_dp1", "7_dp", "x_dp1", "7_dp1x", "7_dp-1", "99999999999999999999_dp0"}) {
    EXPECT_FALSE(ParseRemoteEngineId(bad).ok()) << bad;
  }
}

TEST(KvTransferTest, NoParamsOrNeitherFlagIsAWholeRequest) {
  EXPECT_EQ(Legs(Json::object()).nixl, LegFields::Nixl::kNone);
  EXPECT_EQ(Legs({{"kv_transfer_params", nullptr}}).nixl, LegFields::Nixl::kNone);
  EXPECT_EQ(Legs({{"kv_transfer_params", {{"do_remote_decode", false}}}}).nixl, LegFields::Nixl::kNone);
  EXPECT_FALSE(Legs(Json::object()).bootstrap);
}

TEST(KvTransferTest, GatewayPrefillLegIsAPrefill) {
  // The gateway's prefill body (protocol.md section 13, "Gateway legs").
  const Json body = {{"kv_transfer_params",
                      {{"do_remote_decode", true},
                       {"do_remote_prefill", false},
                       {"remote_engine_id", nullptr},
                       {"remote_block_ids", nullptr},
                       {"remote_host", nullptr},
                       {"remote_port", nullptr}}}};
  EXPECT_EQ(Legs(body).nixl, LegFields::Nixl::kPrefill);
}

TEST(KvTransferTest, ValidDecodeParamsAreADecode) {
  const LegFields legs = Legs({{"kv_transfer_params", DecodeParams()}});
  ASSERT_EQ(legs.nixl, LegFields::Nixl::kDecode);
  ASSERT_TRUE(legs.params);
  EXPECT_EQ(legs.params->remote_block_ids, Sample().remote_block_ids);
}

TEST(KvTransferTest, EachBadDecodeFieldIsAnInvalidDecodeNamingIt) {
  const std::vector<std::pair<std::string, Json>> cases = {{"remote_engine_id", nullptr},
                                                           {"remote_engine_id", "engine-uuid"},
                                                           {"remote_block_ids", nullptr},
                                                           {"remote_block_ids", Json::array({1, -2})},
                                                           {"remote_block_ids", "1,2"},
                                                           {"remote_host", 5},
                                                           {"remote_host", ""},
                                                           {"remote_port", 0},
                                                           {"remote_port", 70000},
                                                           {"remote_port", "8000"},
                                                           {"remote_request_id", nullptr},
                                                           {"remote_request_id", 42}};
  for (const auto& [field, value] : cases) {
    Json params = DecodeParams();
    params[field] = value;
    const LegFields legs = Legs({{"kv_transfer_params", params}});
    EXPECT_EQ(legs.nixl, LegFields::Nixl::kInvalidDecode) << field << " = " << value.dump();
    EXPECT_NE(legs.invalid.find(field), std::string::npos) << legs.invalid;
    EXPECT_FALSE(legs.params);
  }
  Json missing = DecodeParams();
  missing.erase("remote_port");
  EXPECT_EQ(Legs({{"kv_transfer_params", missing}}).nixl, LegFields::Nixl::kInvalidDecode);
}

TEST(KvTransferTest, ParamsThatAreNotAnObjectAreRefused) {
  EXPECT_FALSE(ParseLegFields(R"({"kv_transfer_params": [1]})").ok());
  EXPECT_FALSE(ParseLegFields(R"({"kv_transfer_params": "x"})").ok());
  EXPECT_FALSE(ParseLegFields("not json").ok());
  EXPECT_FALSE(ParseKvTransferParams("[]").ok());
  EXPECT_FALSE(ParseKvTransferParams(R"({"do_remote_prefill": false})").ok());
}

TEST(KvTransferTest, BootstrapFieldsNeedAllThree) {
  const LegFields legs =
      Legs({{"bootstrap_host", "10.0.0.9"}, {"bootstrap_port", 8998}, {"bootstrap_room", 18446744073709551615ull}});
  ASSERT_TRUE(legs.bootstrap);
  EXPECT_EQ(legs.bootstrap->host, "10.0.0.9");
  EXPECT_EQ(legs.bootstrap->port, 8998);
  EXPECT_EQ(legs.bootstrap->room, 18446744073709551615ull);
  EXPECT_FALSE(ParseLegFields(R"({"bootstrap_host": "h", "bootstrap_port": 8998})").ok());
  EXPECT_FALSE(ParseLegFields(R"({"bootstrap_host": "h", "bootstrap_port": 0, "bootstrap_room": 1})").ok());
  EXPECT_FALSE(ParseLegFields(R"({"bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": -1})").ok());
  EXPECT_FALSE(ParseLegFields(R"({"bootstrap_host": "", "bootstrap_port": 1, "bootstrap_room": 1})").ok());
}

TEST(KvTransferTest, KvPulledRoundTripAndRefusesBadBodies) {
  auto p = ParseKvPulled(KvPulledJson({.worker_id = 9, .dp_rank = 1}, "r-1"));
  ASSERT_TRUE(p.ok()) << p.status().message();
  EXPECT_EQ(p->engine, (RemoteEngine{.worker_id = 9, .dp_rank = 1}));
  EXPECT_EQ(p->remote_request_id, "r-1");
  EXPECT_FALSE(ParseKvPulled("{}").ok());
  EXPECT_FALSE(ParseKvPulled(R"({"remote_engine_id": "9", "remote_request_id": "r"})").ok());
  EXPECT_FALSE(ParseKvPulled(R"({"remote_engine_id": "9_dp0"})").ok());
}

TEST(KvTransferTest, FaceHandsTheLegFieldsOverAndRefusesBadOnes) {
  OpenAiFace face({.model = "m"});
  Json body = {{"prompt", "hello"}, {"kv_transfer_params", DecodeParams()}};
  auto r = face.Handle("POST", "/v1/completions", body.dump(), "");
  ASSERT_TRUE(std::holds_alternative<OpenAiGeneration>(r));
  EXPECT_EQ(std::get<OpenAiGeneration>(r).legs.nixl, LegFields::Nixl::kDecode);

  body["kv_transfer_params"] = 3;
  auto refused = face.Handle("POST", "/v1/completions", body.dump(), "");
  ASSERT_TRUE(std::holds_alternative<FaceResponse>(refused));
  EXPECT_EQ(std::get<FaceResponse>(refused).status, 400);
}

TEST(KvTransferTest, PrefillAnswerBodyCarriesTopLevelParams) {
  const OpenAiAnswer answer(OpenAiApi::kChat, "chatcmpl-1", 0, "m", OpenAiAnswer::Delivery::kWhole, false);
  const KvTransferParams params = Sample();
  const Json with = Json::parse(answer.Body({.prompt_tokens = 9, .completion_tokens = 1}, &params));
  EXPECT_EQ(with["kv_transfer_params"], DecodeParams());
  EXPECT_EQ(with["choices"][0]["message"]["content"], "a");
  const Json without = Json::parse(answer.Body({.prompt_tokens = 9, .completion_tokens = 1}));
  EXPECT_FALSE(without.contains("kv_transfer_params"));
}

}  // namespace
}  // namespace kvrouter
