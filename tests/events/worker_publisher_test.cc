#include "events/worker_publisher.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "events/msgpack_reader.h"

namespace kvrouter {
namespace {

constexpr std::uint64_t kWorker = 7;
constexpr std::uint32_t kRank = 1;

StoredBlock Block(BlockHash h) { return {h, h + 1000000}; }  // tokens_hash derived from the id

// A chain of blocks first, first+1, ..., first+n-1 under `parent`.
KvStored Chain(std::optional<BlockHash> parent, BlockHash first, std::size_t n) {
  KvStored s{.parent_hash = parent};
  for (std::size_t i = 0; i < n; ++i) s.blocks.push_back(Block(first + i));
  return s;
}

std::vector<BlockHash> HeldHashes(const KvEventPublisher& p) {
  std::vector<BlockHash> out;
  for (const HeldBlock& b : p.HeldBlocks()) out.push_back(b.block_hash);
  return out;
}

// Every chain of a dump hangs below a block an earlier chain (or the start) stored.
void ExpectParentsBeforeChildren(const RecoveryReply& dump) {
  std::set<BlockHash> seen;
  for (const KvEventBatch& b : dump.events) {
    const KvStored& s = std::get<KvStored>(b.ops.at(0).data);
    if (s.parent_hash) {
      EXPECT_TRUE(seen.contains(*s.parent_hash)) << *s.parent_hash;
    }
    for (const StoredBlock& blk : s.blocks) EXPECT_TRUE(seen.insert(blk.block_hash).second);
  }
}

// A fresh publisher fed the dump holds what `p` holds.
void ExpectDumpRebuilds(const KvEventPublisher& p) {
  const RecoveryReply dump = p.Recover(std::nullopt, std::nullopt);
  ASSERT_EQ(dump.kind, "tree_dump");
  ExpectParentsBeforeChildren(dump);
  KvEventPublisher fresh({});
  for (const KvEventBatch& b : dump.events) fresh.Publish(b.ops.at(0).data);
  EXPECT_EQ(fresh.HeldBlocks(), p.HeldBlocks());
}

// ---- Numbering and the buffer ----

TEST(KvEventPublisher, EventIdsStartAtOneAndGrowByOnePerEvent) {
  KvEventPublisher p({.worker_id = kWorker, .dp_rank = kRank});
  EXPECT_EQ(p.last_event_id(), 0u);
  const KvEventBatch a = p.Publish(Chain(std::nullopt, 1, 2));
  const KvEventBatch b = p.Publish(KvRemoved{{2}}, StorageTier::kHostPinned);
  const KvEventBatch c = p.Publish(KvCleared{});
  EXPECT_EQ(a.sequence, (EventSequence{SequenceKind::kEventId, 1}));
  EXPECT_EQ(b.sequence, (EventSequence{SequenceKind::kEventId, 2}));
  EXPECT_EQ(c.sequence, (EventSequence{SequenceKind::kEventId, 3}));
  for (const KvEventBatch& e : {a, b, c}) {
    EXPECT_EQ(e.worker_id, kWorker);
    EXPECT_EQ(e.dp_rank, kRank);
    EXPECT_EQ(e.ops.size(), 1u);
  }
  EXPECT_EQ(b.ops[0].tier, StorageTier::kHostPinned);
  EXPECT_EQ(p.last_event_id(), 3u);
}

class KvEventPublisherRecovery : public ::testing::Test {
 protected:
  // 9 events, 4 buffered: 6 one-block sequences, 2 removals, one chain under block 6.
  void SetUp() override {
    for (BlockHash h = 1; h <= 6; ++h) published_.push_back(p_.Publish(Chain(std::nullopt, h * 100, 1)));
    published_.push_back(p_.Publish(KvRemoved{{100}}));
    published_.push_back(p_.Publish(KvRemoved{{200}}));
    published_.push_back(p_.Publish(Chain(600, 601, 3)));
    ASSERT_EQ(p_.last_event_id(), 9u);
  }
  KvEventPublisher p_{{.worker_id = kWorker, .dp_rank = kRank, .event_buffer = 4}};
  std::vector<KvEventBatch> published_;
};

TEST_F(KvEventPublisherRecovery, RangesInsideTheBufferAreTheEventsAsPublished) {
  auto r = p_.Recover(7, 8);
  EXPECT_EQ(r.kind, "events");
  EXPECT_EQ(r.last_event_id, 9u);
  EXPECT_EQ(r.events, (std::vector<KvEventBatch>{published_[6], published_[7]}));
  auto open = p_.Recover(6, std::nullopt);  // the oldest buffered id
  EXPECT_EQ(open.kind, "events");
  EXPECT_EQ(open.events, std::vector<KvEventBatch>(published_.begin() + 5, published_.end()));
  auto clamped = p_.Recover(9, 100);
  EXPECT_EQ(clamped.kind, "events");
  EXPECT_EQ(clamped.events, std::vector<KvEventBatch>{published_.back()});
}

TEST_F(KvEventPublisherRecovery, StartOlderThanTheBufferOrNilGetsATreeDump) {
  for (const std::optional<std::uint64_t>& start :
       {std::optional<std::uint64_t>(5), std::optional<std::uint64_t>(0), std::optional<std::uint64_t>()}) {
    auto r = p_.Recover(start, std::nullopt);
    EXPECT_EQ(r.kind, "tree_dump");
    EXPECT_EQ(r.last_event_id, 9u);
    std::size_t blocks = 0;
    for (const KvEventBatch& b : r.events) {
      EXPECT_EQ(b.sequence, (EventSequence{SequenceKind::kEventId, 9}));
      EXPECT_EQ(b.worker_id, kWorker);
      EXPECT_EQ(b.dp_rank, kRank);
      blocks += std::get<KvStored>(b.ops.at(0).data).blocks.size();
    }
    EXPECT_EQ(blocks, 7u);  // 300, 400, 500, 600 601 602 603
    EXPECT_EQ(r.events.size(), 4u);
  }
  ExpectDumpRebuilds(p_);
}

TEST_F(KvEventPublisherRecovery, StartBeyondTheLastEventIsTooNew) {
  auto r = p_.Recover(10, std::nullopt);
  EXPECT_EQ(r.kind, "too_new");
  EXPECT_EQ(r.last_event_id, 9u);
  EXPECT_TRUE(r.events.empty());
  EXPECT_EQ(r.message, "start_event_id 10 > last_event_id 9");
}

TEST_F(KvEventPublisherRecovery, EndBeforeStartIsAnInvalidRange) {
  auto r = p_.Recover(5, 4);
  EXPECT_EQ(r.kind, "invalid_range");
  EXPECT_TRUE(r.events.empty());
  EXPECT_EQ(r.message, "end_event_id 4 < start_event_id 5");
}

TEST_F(KvEventPublisherRecovery, AnswerRecoversOrReportsABadQuery) {
  EXPECT_EQ(p_.Answer(RecoveryQuery{.start_event_id = 7, .end_event_id = 8}), p_.Recover(7, 8));
  EXPECT_EQ(p_.Answer(RecoveryQuery{}), p_.Recover(std::nullopt, std::nullopt));
  const RecoveryReply bad = p_.Answer(RecoveryQuery::Decode(AsBytes(std::string_view("\x91\x01", 2))));
  EXPECT_EQ(bad.kind, "error");
  EXPECT_EQ(bad.last_event_id, 9u);
  EXPECT_TRUE(bad.events.empty());
  EXPECT_NE(bad.message.find("must be a map"), std::string::npos) << bad.message;
}

TEST(KvEventPublisher, WithoutABufferEveryRecoveryIsADump) {
  KvEventPublisher p({.event_buffer = 0});
  p.Publish(Chain(std::nullopt, 1, 3));
  EXPECT_EQ(p.Recover(1, 1).kind, "tree_dump");
  KvEventPublisher empty({});
  auto r = empty.Recover(std::nullopt, std::nullopt);
  EXPECT_EQ(r.kind, "tree_dump");
  EXPECT_TRUE(r.events.empty());
  EXPECT_EQ(r.last_event_id, 0u);
}

TEST(KvEventPublisher, TheBufferKeepsTheLast1024EventsByDefault) {
  KvEventPublisher p({});
  for (BlockHash h = 1; h <= 1500; ++h) p.Publish(Chain(std::nullopt, h, 1));
  EXPECT_EQ(p.Recover(1500 - 1023, std::nullopt).events.size(), 1024u);
  EXPECT_EQ(p.Recover(1500 - 1024, std::nullopt).kind, "tree_dump");
}

// ---- The index ----

TEST(KvEventPublisherIndex, StoredChainUnderAnUnknownParentIsNotIndexed) {
  KvEventPublisher p({});
  p.Publish(Chain(99, 1, 3));
  EXPECT_EQ(p.held_blocks(), 0u);
  p.Publish(Chain(std::nullopt, 99, 1));
  p.Publish(Chain(99, 1, 3));
  EXPECT_EQ(HeldHashes(p), (std::vector<BlockHash>{1, 2, 3, 99}));
}

TEST(KvEventPublisherIndex, StoringAKnownBlockAgainIsANoOp) {
  KvEventPublisher p({});
  p.Publish(Chain(std::nullopt, 1, 3));
  p.Publish(Chain(std::nullopt, 1, 2));
  p.Publish(Chain(1, 2, 1));
  EXPECT_EQ(HeldHashes(p), (std::vector<BlockHash>{1, 2, 3}));
  EXPECT_EQ(p.Recover(std::nullopt, std::nullopt).events.size(), 1u);
}

TEST(KvEventPublisherIndex, RemovingAnInteriorBlockDropsItsDescendantsAndKeepsTheDumpValid) {
  KvEventPublisher p({});
  p.Publish(Chain(std::nullopt, 1, 4));  // 1 2 3 4
  p.Publish(Chain(2, 10, 2));            // 1 2 {3 4, 10 11}
  p.Publish(Chain(std::nullopt, 20, 1));
  p.Publish(KvRemoved{{3, 12345}});  // an unknown hash does not stop the rest
  EXPECT_EQ(HeldHashes(p), (std::vector<BlockHash>{1, 2, 10, 11, 20}));
  ExpectDumpRebuilds(p);
  p.Publish(KvRemoved{{1}});
  EXPECT_EQ(HeldHashes(p), (std::vector<BlockHash>{20}));
  ExpectDumpRebuilds(p);
}

TEST(KvEventPublisherIndex, AKnownBlockStoredElsewhereMovesAndItsOldDescendantsGo) {
  KvEventPublisher p({});
  p.Publish(Chain(std::nullopt, 1, 3));  // 1 2 3
  p.Publish(Chain(std::nullopt, 50, 1));
  p.Publish(KvStored{50, {Block(2), Block(60)}});  // 2 moves below 50; 3 hung below the old 2
  const std::vector<HeldBlock> want = {{1, std::nullopt, Block(1).tokens_hash},
                                       {2, 50, Block(2).tokens_hash},
                                       {50, std::nullopt, Block(50).tokens_hash},
                                       {60, 2, Block(60).tokens_hash}};
  EXPECT_EQ(p.HeldBlocks(), want);
  // Below its own descendant: the move drops the new parent, and the rest of the chain with it.
  p.Publish(KvStored{60, {Block(50), Block(70)}});
  EXPECT_EQ(HeldHashes(p), (std::vector<BlockHash>{1}));
  ExpectDumpRebuilds(p);
}

TEST(KvEventPublisherIndex, ClearedEmptiesTheIndexAndOtherTiersAreNotIndexed) {
  KvEventPublisher p({});
  p.Publish(Chain(std::nullopt, 1, 3));
  p.Publish(Chain(std::nullopt, 10, 3), StorageTier::kDisk);
  p.Publish(KvRemoved{{1}}, StorageTier::kHostPinned);
  EXPECT_EQ(HeldHashes(p), (std::vector<BlockHash>{1, 2, 3}));
  p.Publish(KvCleared{}, StorageTier::kDisk);
  EXPECT_EQ(p.held_blocks(), 0u);
  EXPECT_TRUE(p.Recover(std::nullopt, std::nullopt).events.empty());
  p.Publish(Chain(std::nullopt, 1, 2));  // slots are reused after a clear
  EXPECT_EQ(HeldHashes(p), (std::vector<BlockHash>{1, 2}));
}

TEST(KvEventPublisherIndex, TreeDumpHasOneChainPerLeafParentsFirst) {
  KvEventPublisher p({});
  // A branching tree: 1 2 {3 4, 5, 6 7 8}, and 9.
  p.Publish(Chain(std::nullopt, 1, 4));
  p.Publish(Chain(2, 5, 1));
  p.Publish(Chain(2, 6, 3));
  p.Publish(Chain(std::nullopt, 9, 1));
  auto dump = p.Recover(std::nullopt, std::nullopt);
  EXPECT_EQ(dump.events.size(), 4u);  // leaves 4, 5, 8, 9
  ExpectParentsBeforeChildren(dump);
  std::size_t blocks = 0;
  for (const auto& b : dump.events) blocks += std::get<KvStored>(b.ops[0].data).blocks.size();
  EXPECT_EQ(blocks, 9u);
  ExpectDumpRebuilds(p);
}

// A naive model of the index semantics: held block -> (parent, tokens); a removal sweeps the
// whole map until no orphan is left.
class ModelIndex {
 public:
  void Apply(const KvEventData& data) {
    if (std::holds_alternative<KvCleared>(data)) {
      held_.clear();
    } else if (const auto* s = std::get_if<KvStored>(&data)) {
      std::optional<BlockHash> parent = s->parent_hash;
      if (parent && !held_.contains(*parent)) return;
      for (const StoredBlock& b : s->blocks) {
        auto it = held_.find(b.block_hash);
        if (it != held_.end()) {
          if (it->second.parent_hash == parent && it->second.tokens_hash == b.tokens_hash) {
            parent = b.block_hash;
            continue;
          }
          Remove(b.block_hash);
          if (parent && !held_.contains(*parent)) return;
        }
        held_[b.block_hash] = {b.block_hash, parent, b.tokens_hash};
        parent = b.block_hash;
      }
    } else {
      for (BlockHash h : std::get<KvRemoved>(data).block_hashes) Remove(h);
    }
  }
  std::vector<HeldBlock> Held() const {
    std::vector<HeldBlock> out;
    for (const auto& [h, b] : held_) out.push_back(b);
    return out;  // std::map: ascending block_hash
  }

 private:
  void Remove(BlockHash h) {
    if (held_.erase(h) == 0) return;
    for (bool changed = true; changed;) {
      changed = false;
      for (auto it = held_.begin(); it != held_.end();) {
        if (it->second.parent_hash && !held_.contains(*it->second.parent_hash)) {
          it = held_.erase(it);
          changed = true;
        } else {
          ++it;
        }
      }
    }
  }
  std::map<BlockHash, HeldBlock> held_;
};

TEST(KvEventPublisherIndex, AgreesWithANaiveModelAndItsDumpsRebuildItUnderRandomEvents) {
  std::mt19937_64 rng(20240611);
  KvEventPublisher p({.event_buffer = 8});
  ModelIndex model;
  BlockHash fresh = 1000;
  auto some_hash = [&] { return static_cast<BlockHash>(rng() % 1000); };  // held or not
  std::size_t most_held = 0;
  for (int step = 0; step < 3000; ++step) {
    KvEventData data;
    const auto kind = rng() % 1000;
    const std::vector<HeldBlock> held = p.HeldBlocks();
    auto held_hash = [&] { return held.empty() ? some_hash() : held[rng() % held.size()].block_hash; };
    if (kind < 3) {
      data = KvCleared{};
    } else if (kind < 120) {
      KvRemoved r;
      for (auto n = rng() % 3 + 1; n > 0; --n) r.block_hashes.push_back(rng() % 4 ? held_hash() : some_hash());
      data = r;
    } else {
      KvStored s;
      if (rng() % 4 != 0) s.parent_hash = rng() % 10 ? held_hash() : some_hash();
      for (auto n = rng() % 6 + 1; n > 0; --n) {
        const auto pick = rng() % 10;
        const BlockHash h = pick < 8 ? fresh++ : pick == 8 ? held_hash() : some_hash();
        s.blocks.push_back({h, rng() % 8 == 0 ? h + 7 : h + 1000000});  // sometimes other tokens
      }
      data = s;
    }
    model.Apply(data);
    p.Publish(data);
    ASSERT_EQ(p.HeldBlocks(), model.Held()) << "step " << step;
    if (step % 50 == 0) ExpectDumpRebuilds(p);
    most_held = std::max(most_held, p.held_blocks());
  }
  EXPECT_GT(most_held, 100u);  // the workload builds real trees
}

TEST(KvEventPublisherIndex, MillionBlockDumpIsMadeOfFewChains) {
  // 1,000 sequences of 1,090 blocks, in groups of 10 sharing a 100-block prefix.
  KvEventPublisher p({});
  BlockHash next = 1;
  std::size_t stored = 0;
  for (int group = 0; group < 100; ++group) {
    const BlockHash prefix = next;
    p.Publish(Chain(std::nullopt, prefix, 100));
    next += 100;
    stored += 100;
    for (int s = 0; s < 10; ++s) {
      p.Publish(Chain(prefix + 99, next, 990));
      next += 990;
      stored += 990;
    }
  }
  ASSERT_EQ(p.held_blocks(), 1000000u);
  ASSERT_EQ(stored, 1000000u);

  // How fast is a benchmark's question (tests/bench/recovery_bench.cc), not this test's.
  const RecoveryReply dump = p.Recover(std::nullopt, std::nullopt);
  EXPECT_EQ(dump.events.size(), 1000u);  // one chain per leaf

  std::size_t blocks = 0;
  for (const auto& b : dump.events) blocks += std::get<KvStored>(b.ops[0].data).blocks.size();
  EXPECT_EQ(blocks, 1000000u);
  KvEventPublisher fresh({});
  for (const KvEventBatch& b : dump.events) fresh.Publish(b.ops.at(0).data);
  EXPECT_EQ(fresh.held_blocks(), 1000000u);
  EXPECT_EQ(fresh.HeldBlocks(), p.HeldBlocks());
}

TEST(KvEventPublisherIndex, MillionBlockDumpTravelsInPartsUnderTheMaxPayload) {
  // One long sequence of 1,000,000 blocks: a single chain that must be cut to travel.
  KvEventPublisher p({});
  p.Publish(Chain(std::nullopt, 1, 1000000));
  const RecoveryReply dump = p.Recover(std::nullopt, std::nullopt);
  ASSERT_EQ(dump.events.size(), 1u);
  constexpr std::size_t kMax = 1 << 20;
  auto parts = EncodeRecoveryReplyParts(dump, kMax);
  ASSERT_TRUE(parts.ok()) << parts.status().ToString();
  ASSERT_GT(parts->size(), 20u);  // ~34 MB of chains
  KvEventPublisher fresh({});
  for (std::size_t i = 0; i < parts->size(); ++i) {
    EXPECT_LE((*parts)[i].size(), kMax);
    auto part = DecodeRecoveryReply(AsBytes((*parts)[i]), 0);
    ASSERT_TRUE(part.ok()) << part.status().ToString();
    EXPECT_EQ(part->kind, "tree_dump");
    EXPECT_EQ(part->last_event_id, dump.last_event_id);
    EXPECT_EQ(part->more, i + 1 < parts->size());
    for (const KvEventBatch& b : part->events) fresh.Publish(b.ops.at(0).data);
  }
  EXPECT_EQ(fresh.held_blocks(), 1000000u);
  EXPECT_EQ(fresh.HeldBlocks(), p.HeldBlocks());
}

}  // namespace
}  // namespace kvrouter
