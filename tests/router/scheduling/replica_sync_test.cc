#include "router/scheduling/replica_sync.h"

#include <gtest/gtest.h>

#include <span>

namespace kvrouter {
namespace {

constexpr WorkerKey kA{1, 0};
constexpr WorkerKey kB{2, 1};
const SteadyTime kT0{};

ActiveSequenceEvent Decode(const msgpack::sbuffer& b) {
  auto e = DecodeActiveSequenceEvent(std::as_bytes(std::span(b.data(), b.size())));
  EXPECT_TRUE(e.ok()) << e.status().message();
  return *e;
}

TEST(ReplicaSync, OffItSendsNothing) {
  ReplicaSync sync(ReplicaSync::Mode::kOff, 9);
  ActiveLoad load;
  ASSERT_TRUE(load.Book("r", kA, std::vector<SequenceHash>{1}, 10, kT0));
  sync.Send(ActiveSequenceEvent::Kind::kAdd, "r", kA, std::vector<SequenceHash>{1}, 10, 0);
  sync.NextEpoch(load);
  EXPECT_TRUE(sync.TakeMessages().empty());
}

TEST(ReplicaSync, MessagesCarryThisRouterAndItsEpochInOrder) {
  ReplicaSync sync(ReplicaSync::Mode::kOn, 9);
  const std::vector<SequenceHash> seq = {5, 6};
  sync.Send(ActiveSequenceEvent::Kind::kAdd, "r", kB, seq, 100, 1);
  sync.Send(ActiveSequenceEvent::Kind::kFree, "r", kB);
  auto messages = sync.TakeMessages();
  ASSERT_EQ(messages.size(), 2u);
  const ActiveSequenceEvent add = Decode(messages[0]);
  EXPECT_EQ(add.router_id, 9u);
  EXPECT_EQ(add.epoch, sync.epoch());
  EXPECT_EQ(add.kind, ActiveSequenceEvent::Kind::kAdd);
  EXPECT_EQ(add.worker_id, kB.worker_id);
  EXPECT_EQ(add.dp_rank, kB.dp_rank);
  EXPECT_EQ(add.seq_hashes, (std::vector<std::uint64_t>{5, 6}));
  EXPECT_EQ(add.isl, 100u);
  EXPECT_EQ(add.overlap_blocks, 1u);
  EXPECT_EQ(Decode(messages[1]).kind, ActiveSequenceEvent::Kind::kFree);
  EXPECT_TRUE(sync.TakeMessages().empty());  // taken once
}

TEST(ReplicaSync, TheNextEpochSendsThisRoutersBookingsAgainButNotThePeers) {
  ReplicaSync sync(ReplicaSync::Mode::kOn, 9);
  ActiveLoad load;
  ASSERT_TRUE(load.Book("ours", kA, std::vector<SequenceHash>{1, 2}, 70, kT0));
  ASSERT_TRUE(load.Book("theirs", kB, std::vector<SequenceHash>{3}, 10, kT0));
  sync.peers().Booked(4, "theirs", kT0);
  const std::uint32_t before = sync.epoch();
  sync.NextEpoch(load);
  EXPECT_EQ(sync.epoch(), before + 1);
  auto messages = sync.TakeMessages();
  ASSERT_EQ(messages.size(), 1u);
  const ActiveSequenceEvent e = Decode(messages[0]);
  EXPECT_EQ(e.request_id, "ours");
  EXPECT_EQ(e.epoch, before + 1);
  EXPECT_EQ(e.isl, 70u);  // what is left to prefill, as a prompt with nothing cached
  EXPECT_EQ(e.overlap_blocks, 0u);
}

TEST(ReplicaSync, ReleaseFreesTheNamedBookingsAndReportsTheirWorkers) {
  ReplicaSync sync(ReplicaSync::Mode::kOn, 9);
  ActiveLoad load;
  ASSERT_TRUE(load.Book("p1", kA, std::vector<SequenceHash>{1}, 10, kT0));
  ASSERT_TRUE(load.Book("p2", kB, std::vector<SequenceHash>{2}, 10, kT0));
  std::vector<WorkerKey> changed;
  sync.Release({"p1", "unknown"}, load, changed);
  EXPECT_EQ(changed, std::vector<WorkerKey>{kA});
  EXPECT_EQ(sync.released(), 1u);
  EXPECT_EQ(load.WorkerOf("p1"), nullptr);
  EXPECT_NE(load.WorkerOf("p2"), nullptr);
  sync.Refused("too_long");
  sync.Refused("too_long");
  EXPECT_EQ(sync.refused().at("too_long"), 2u);
}

}  // namespace
}  // namespace kvrouter
