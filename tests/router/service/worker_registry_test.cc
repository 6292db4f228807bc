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
