// WorkerRegistry's admission of events: a thread remembers the ranks it admitted, and forgets
// them whenever a worker is forgotten or registers again, so no rank it can no longer serve
// is admitted from memory.
#include "router/service/worker_registry.h"

#include <gtest/gtest.h>

#include <chrono>

namespace kvrouter {
namespace {

using namespace std::chrono_literals;

const SteadyTime kT0{};

WorkerRegistration Reg(std::uint64_t id, std::uint32_t dp_size = 1) {
  return {.worker_id = id, .dp_size = dp_size, .lease_ms = 1000};
}

// AllRanks is Ranks without filters, one list shared until a registration, an event-only worker
// or a departure changes the ranks; a heartbeat that repeats its registration keeps it.
TEST(WorkerRegistryAllRanks, IsTheUnfilteredRanksSharedUntilTheRanksChange) {
  WorkerRegistry reg({.block_size = 64});
  auto unfiltered = [&] { return reg.Ranks(std::nullopt, std::nullopt, std::nullopt).value(); };
  auto keys = [](const std::vector<RankInfo>& v) {
    std::vector<WorkerKey> k;
    for (const RankInfo& r : v) k.push_back(r.worker);
    return k;
  };
  ASSERT_TRUE(reg.AllRanks()->empty());
  ASSERT_EQ(reg.Register(Reg(7, 2), kT0).outcome, WorkerRegistry::Outcome::kNew);
  const auto first = reg.AllRanks();
  EXPECT_EQ(keys(*first), keys(unfiltered()));
  EXPECT_EQ(first->size(), 2u);
  ASSERT_EQ(reg.Register(Reg(7, 2), kT0).outcome, WorkerRegistry::Outcome::kRenewed);
  EXPECT_EQ(reg.AllRanks(), first);  // the same list, not a copy
  WorkerRegistration bigger = Reg(7, 2);
  bigger.max_num_batched_tokens = 4096;
  ASSERT_EQ(reg.Register(bigger, kT0).outcome, WorkerRegistry::Outcome::kUpdated);
  EXPECT_EQ(reg.AllRanks()->at(0).max_num_batched_tokens, 4096u);
  EXPECT_EQ(reg.AdmitEvent(9, 1, kT0), nullptr);  // an event-only worker of ranks 0 and 1
  EXPECT_EQ(keys(*reg.AllRanks()), keys(unfiltered()));
  EXPECT_EQ(reg.AllRanks()->size(), 4u);
  ASSERT_TRUE(reg.Forget(7, kT0));
  EXPECT_EQ(keys(*reg.AllRanks()), (std::vector<WorkerKey>{{9, 0}, {9, 1}}));
  EXPECT_EQ(first->size(), 2u);  // a list handed out earlier stays as it was
}

// Section 13: a prefill worker serves prefill legs only, so it is never a request's worker: not
// among the ranks a request may go to, nor pinned; its events are still admitted (its cache is
// indexed) and its stats name its role.
TEST(WorkerRegistryRoles, APrefillWorkerIsNeverARequestsWorker) {
  WorkerRegistry reg({.block_size = 64});
  WorkerRegistration prefill = Reg(1);
  prefill.role = WorkerRole::kPrefill;
  WorkerRegistration decode = Reg(2);
  decode.role = WorkerRole::kDecode;
  ASSERT_EQ(reg.Register(prefill, kT0).outcome, WorkerRegistry::Outcome::kNew);
  ASSERT_EQ(reg.Register(decode, kT0).outcome, WorkerRegistry::Outcome::kNew);
  ASSERT_EQ(reg.Register(Reg(3), kT0).outcome, WorkerRegistry::Outcome::kNew);
  auto keys = [](const std::vector<RankInfo>& v) {
    std::vector<std::uint64_t> k;
    for (const RankInfo& r : v) k.push_back(r.worker.worker_id);
    return k;
  };
  const std::vector<std::uint64_t> servable{2, 3};
  EXPECT_EQ(keys(*reg.AllRanks()), servable);
  EXPECT_EQ(keys(reg.Ranks(std::nullopt, std::nullopt, std::nullopt).value()), servable);
  EXPECT_EQ(keys(reg.Ranks(std::nullopt, std::nullopt, std::vector<std::uint64_t>{1, 2}).value()),
            std::vector<std::uint64_t>{2});
  const auto pinned = reg.Ranks(1, std::nullopt, std::nullopt);
  ASSERT_FALSE(pinned.ok());
  EXPECT_EQ(pinned.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(reg.AdmitEvent(1, 0, kT0), nullptr);
  std::uint64_t total = 0;
  const auto page = reg.Page(0, 10, &total);
  ASSERT_EQ(page.size(), 3u);
  EXPECT_EQ(total, 3u);
  EXPECT_EQ(page[0].role, WorkerRole::kPrefill);
  EXPECT_EQ(page[1].role, WorkerRole::kDecode);
  EXPECT_EQ(page[2].role, WorkerRole::kBoth);
}

TEST(WorkerRegistryAdmission, AnAdmittedRankIsRefusedOnceItsWorkerLeaves) {
  WorkerRegistry reg({});
  ASSERT_EQ(reg.Register(Reg(7, 2), kT0).outcome, WorkerRegistry::Outcome::kNew);
  EXPECT_EQ(reg.AdmitEvent(7, 1, kT0), nullptr);
  EXPECT_EQ(reg.AdmitEvent(7, 1, kT0), nullptr);  // again: remembered
  WorkerRegistration leaving = Reg(7, 2);
  leaving.leaving = true;
  ASSERT_EQ(reg.Register(leaving, kT0).outcome, WorkerRegistry::Outcome::kLeaving);
  EXPECT_STREQ(reg.AdmitEvent(7, 1, kT0), "worker_left");
}

TEST(WorkerRegistryAdmission, ARegistrationWithFewerRanksRefusesTheRanksItDropped) {
  WorkerRegistry reg({});
  ASSERT_EQ(reg.Register(Reg(7, 4), kT0).outcome, WorkerRegistry::Outcome::kNew);
  EXPECT_EQ(reg.AdmitEvent(7, 3, kT0), nullptr);
  ASSERT_EQ(reg.Register(Reg(7, 2), kT0).outcome, WorkerRegistry::Outcome::kUpdated);
  EXPECT_STREQ(reg.AdmitEvent(7, 3, kT0), "dp_rank_out_of_range");
  EXPECT_EQ(reg.AdmitEvent(7, 1, kT0), nullptr);
}

TEST(WorkerRegistryAdmission, AnAdmittedRankIsRefusedOnceItsLeaseExpires) {
  WorkerRegistry reg({});
  ASSERT_EQ(reg.Register(Reg(7), kT0).outcome, WorkerRegistry::Outcome::kNew);
  EXPECT_EQ(reg.AdmitEvent(7, 0, kT0), nullptr);
  EXPECT_EQ(reg.ExpireLeases(kT0 + 2s), std::vector<std::uint64_t>{7});
  EXPECT_STREQ(reg.AdmitEvent(7, 0, kT0 + 2s), "worker_left");
}

TEST(WorkerRegistrySilence, ARegisteredWorkerWithoutEventsIsMarkedOnceAfterTheQuietTime) {
  WorkerRegistry reg({});
  ASSERT_EQ(reg.Register(Reg(7), kT0).outcome, WorkerRegistry::Outcome::kNew);
  ASSERT_EQ(reg.Register(Reg(8), kT0).outcome, WorkerRegistry::Outcome::kNew);
  EXPECT_EQ(reg.AdmitEvent(8, 0, kT0), nullptr);  // 8 sends events
  EXPECT_EQ(reg.AdmitEvent(9, 0, kT0), nullptr);  // 9 is only seen through events
  EXPECT_TRUE(reg.Unheard(kT0 + 29s, 30s).empty());  // too early to say
  EXPECT_EQ(reg.Unheard(kT0 + 30s, 30s), std::vector<std::uint64_t>{7});
  EXPECT_EQ(reg.SetSilent({7}), std::vector<std::uint64_t>{7});
  EXPECT_EQ(reg.silent_workers(), 1u);
  EXPECT_TRUE(reg.SetSilent({7}).empty());  // said once
  std::uint64_t total = 0;
  const auto page = reg.Page(0, 10, &total);
  ASSERT_EQ(page.size(), 3u);
  EXPECT_TRUE(page[0].without_events);
  EXPECT_FALSE(page[1].without_events);
  EXPECT_FALSE(page[2].without_events);
  // A heartbeat does not make it heard; its first event does.
  ASSERT_EQ(reg.Register(Reg(7), kT0 + 31s).outcome, WorkerRegistry::Outcome::kRenewed);
  EXPECT_EQ(reg.Unheard(kT0 + 32s, 30s), std::vector<std::uint64_t>{7});
  EXPECT_EQ(reg.AdmitEvent(7, 0, kT0 + 32s), nullptr);
  EXPECT_TRUE(reg.Unheard(kT0 + 33s, 30s).empty());
  // An event between Unheard and SetSilent wins.
  EXPECT_TRUE(reg.SetSilent({7}).empty());
  EXPECT_EQ(reg.silent_workers(), 0u);
}

TEST(WorkerRegistrySilence, AForgottenSilentWorkerIsNoLongerCounted) {
  WorkerRegistry reg({});
  ASSERT_EQ(reg.Register(Reg(7), kT0).outcome, WorkerRegistry::Outcome::kNew);
  EXPECT_EQ(reg.SetSilent(reg.Unheard(kT0 + 30s, 30s)), std::vector<std::uint64_t>{7});
  EXPECT_TRUE(reg.Forget(7, kT0 + 30s));
  EXPECT_EQ(reg.silent_workers(), 0u);
}

TEST(WorkerRegistryAdmission, WhatOneRegistryAdmittedIsNotAdmittedByAnother) {
  WorkerRegistry first({});
  WorkerRegistry full({.max_workers = 0});          // takes no event-only worker
  EXPECT_EQ(first.AdmitEvent(7, 0, kT0), nullptr);  // an event-only worker
  EXPECT_STREQ(full.AdmitEvent(7, 0, kT0), "too_many_workers");
  EXPECT_EQ(first.AdmitEvent(7, 0, kT0), nullptr);
}

TEST(WorkerRegistryAdmission, TheClockIsReadOnlyWhenTheRankIsNotRemembered) {
  WorkerRegistry reg({});
  ASSERT_EQ(reg.Register(Reg(7), kT0).outcome, WorkerRegistry::Outcome::kNew);
  int reads = 0;
  auto clock = [&] {
    ++reads;
    return kT0;
  };
  EXPECT_EQ(reg.AdmitEvent(7, 0, clock), nullptr);
  EXPECT_EQ(reads, 1);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(reg.AdmitEvent(7, 0, clock), nullptr);
  EXPECT_EQ(reads, 1);  // remembered: no clock per event
  ASSERT_TRUE(reg.Forget(7, kT0));
  EXPECT_STREQ(reg.AdmitEvent(7, 0, clock), "worker_left");  // forgotten: asked, with the time
  EXPECT_EQ(reads, 2);
}

}  // namespace
}  // namespace kvrouter
