// Reading an index shard while its thread writes: the ReadGate's rules, and BlockIndex's
// FindMatches run against an owner that writes all the time (holder sets moving between inline
// and heap, the sequence-hash table rehashing, node chunks and slot keys growing). Run under
// TSan in CI: a plain write to anything FindMatches reads is a reported race.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <set>
#include <thread>
#include <vector>

#include "events/block_hash.h"
#include "router/index/block_index.h"
#include "router/index/read_gate.h"
#include "tests/await.h"

namespace kvrouter {
namespace {

using namespace std::chrono_literals;

TEST(ReadGate, AnEventWaitsForTheReaderInsideAndReadersBetweenEventsAreExact) {
  ReadGate gate;
  std::atomic<bool> passed{false};
  std::thread writer;
  {
    ReadGate::Reader r(gate, 1h);
    EXPECT_FALSE(r.tolerant());
    writer = std::thread([&] {
      gate.BeginWrite();
      passed.store(true);
      EXPECT_TRUE(gate.EndWrite());  // quiet: the reader left before the event began
    });
    AwaitTrue([&] { return gate.writing(); });  // the event has announced itself...
    EXPECT_FALSE(passed.load());                // ...and cannot start while we read
  }
  writer.join();
  EXPECT_TRUE(passed.load());
  EXPECT_EQ(gate.tolerant_reads(), 0u);
}

TEST(ReadGate, AReaderWaitsOutAnEventWithinItsPatience) {
  ReadGate gate;
  gate.BeginWrite();
  std::atomic<bool> tolerant{true};
  std::thread reader([&] {
    ReadGate::Reader r(gate, 1h);
    tolerant.store(r.tolerant());
  });
  gate.EndWrite();
  reader.join();
  EXPECT_FALSE(tolerant.load());
  EXPECT_EQ(gate.tolerant_reads(), 0u);
}

// A reader that waited out its patience reads around the stuck event and the ones after it:
// the writer does not wait for it, but nothing replaced meanwhile may be freed until it leaves.
TEST(ReadGate, AReaderReadsAroundAStuckEventAndTheNextEventsDoNotWaitForIt) {
  ReadGate gate;
  gate.BeginWrite();  // the writer "loses its CPU" here
  std::atomic<int> stage{0};
  std::thread reader([&] {
    ReadGate::Reader r(gate, 200us);
    EXPECT_TRUE(r.tolerant());
    stage.store(1);
    AwaitTrue([&] { return stage.load() == 2; });
  });
  AwaitTrue([&] { return stage.load() == 1; });
  EXPECT_EQ(gate.tolerant_reads(), 1u);
  EXPECT_FALSE(gate.EndWrite());  // a reader is inside: replaced memory must wait
  std::atomic<int> events{0};
  std::thread writer([&] {
    for (int i = 0; i < 3; ++i) {
      gate.BeginWrite();
      EXPECT_FALSE(gate.EndWrite());  // still not quiet
      events.fetch_add(1);
    }
  });
  // The three events run while the reader is inside; a writer that waited for it would still
  // be waiting 10 s later (the reader leaves only below).
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (events.load() < 3 && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  EXPECT_EQ(events.load(), 3) << "an event waited for a tolerant reader";
  EXPECT_FALSE(gate.Quiet());
  stage.store(2);
  reader.join();
  writer.join();
  EXPECT_TRUE(gate.Quiet());
}

// A stuck event costs the patience once: the readers after the first that waited it out go in
// at once. The next event is judged afresh.
TEST(ReadGate, OnlyTheFirstReaderWaitsOutAStuckEvent) {
  ReadGate gate;
  gate.BeginWrite();  // the writer "loses its CPU" here
  {
    ReadGate::Reader first(gate, 200us);
    EXPECT_TRUE(first.tolerant());
  }
  std::atomic<int> second{0};  // 1: exact, 2: tolerant
  std::thread t([&] {
    ReadGate::Reader r(gate, 1h);  // would wait for EndWrite if it waited at all
    second.store(r.tolerant() ? 2 : 1);
  });
  // It is in at once; one that waited would still be waiting 10 s later (the event only ends
  // below), so this bound cannot be met by a slow machine, only by a reader that waits.
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (second.load() == 0 && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  EXPECT_EQ(second.load(), 2) << "the second reader waited for an event a reader had already waited out";
  if (second.load() == 0) gate.EndWrite();  // lets it go, so that it can be joined
  t.join();
  if (second.load() != 2) return;
  EXPECT_EQ(gate.tolerant_reads(), 2u);
  EXPECT_TRUE(gate.EndWrite());

  gate.BeginWrite();  // a new event: a patient reader waits for it and then reads exactly
  std::atomic<int> third{0};
  std::thread u([&] {
    ReadGate::Reader r(gate, 1h);
    third.store(r.tolerant() ? 2 : 1);
  });
  AwaitTrue([&] { return gate.waiting_readers() == 1; });
  EXPECT_EQ(third.load(), 0);  // still waiting
  gate.EndWrite();
  u.join();
  EXPECT_EQ(third.load(), 1);
  EXPECT_EQ(gate.tolerant_reads(), 2u);
}

// The owner stores, removes, clears and forgets workers without pause (and never frees what it
// replaces, so every pointer a reader loads stays valid) while readers run FindMatches through
// a ReadGate that never waits: a read that meets an event reads tolerantly around it. Every
// result must name each worker once, only known workers, with 1..length blocks. (A tolerant
// read may span several events, a worker's removal and its return among them: it is named once
// because a removed worker's slot is not reused while readers may read (until FreeRetired), so
// it cannot come back under a second slot the read also reports.)
TEST(ConcurrentReads, TolerantFindMatchesStayInBoundsWhileTheOwnerWrites) {
  constexpr std::uint64_t kWorkers = 48;
  constexpr std::size_t kShared = 24;  // a prefix every worker stores: holder sets of 48
  BlockIndex idx;
  idx.SetConcurrentReaders(true);
  std::vector<LocalHash> shared;
  for (std::size_t i = 0; i < kShared; ++i) shared.push_back(1000 + i);
  const auto query = ComputeSequenceHashes(shared);

  ReadGate gate;
  // One event, as a shard thread applies it.
  auto event = [&](auto&& apply) {
    gate.BeginWrite();
    apply();
    gate.EndWrite();
  };
  std::atomic<bool> done{false};
  std::atomic<long> reads{0}, bad{0}, nonempty{0};
  std::vector<std::thread> readers;
  std::atomic<long> stale{0};
  // One reader reads scores, the other runs of slots and then, in a second read, their scores.
  for (int i = 0; i < 2; ++i) {
    readers.emplace_back([&, runs_reader = i == 1] {
      OverlapScores out;
      MatchRuns runs;
      while (!done.load(std::memory_order_relaxed)) {
        out.clear();
        if (runs_reader) {
          {
            ReadGate::Reader r(gate, 0ns);
            idx.FindMatches(query, runs, r.tolerant());
          }
          ReadGate::Reader r(gate, 0ns);
          if (!idx.TranslateMatches(runs, out, r.tolerant())) {
            stale.fetch_add(1);
            if (!out.empty()) bad.fetch_add(1);
          }
        } else {
          ReadGate::Reader r(gate, 0ns);
          idx.FindMatches(query, out, r.tolerant());
        }
        std::set<WorkerKey> seen;
        for (const auto& s : out) {
          if (!seen.insert(s.worker).second || s.worker.worker_id >= kWorkers || s.worker.dp_rank != 0 ||
              s.blocks == 0 || s.blocks > kShared) {
            bad.fetch_add(1);
          }
        }
        if (!out.empty()) nonempty.fetch_add(1);
        reads.fetch_add(1);
      }
    });
  }

  std::uint64_t next_id = 1;
  for (int round = 0; round < 6; ++round) {
    for (std::uint64_t w = 0; w < kWorkers; ++w) {
      const WorkerKey key{w, 0};
      // The shared prefix (canonical: engine hash = sequence hash), then a private tail long
      // enough that the tree passes one node chunk (65,536 nodes) over the rounds.
      std::vector<StoredBlock> chain;
      const auto seq = ComputeSequenceHashes(shared);
      for (std::size_t i = 0; i < kShared; ++i) chain.push_back({seq[i], shared[i]});
      bool parent_not_found = true;
      event([&] { parent_not_found = idx.ApplyStored(key, std::nullopt, chain).parent_not_found; });
      ASSERT_FALSE(parent_not_found);
      std::vector<StoredBlock> tail;
      for (std::size_t i = 0; i < 1500; ++i) tail.push_back({1'000'000 + next_id++, 5'000'000 + next_id});
      event([&] { idx.ApplyStored(key, seq.back(), tail); });
    }
    for (std::uint64_t w = 0; w < kWorkers; ++w) {
      const WorkerKey key{w, 0};
      switch ((w + round) % 3) {
        case 0: {  // the shared prefix's second half goes: the node keeps its children (orphan risk)
          std::vector<BlockHash> gone;
          const auto seq = ComputeSequenceHashes(shared);
          for (std::size_t i = kShared / 2; i < kShared; ++i) gone.push_back(seq[i]);
          event([&] { idx.ApplyRemoved(key, gone); });
          break;
        }
        case 1: event([&] { idx.ClearWorker(w); }); break;
        default: event([&] { idx.RemoveWorker(w); });  // it returns next round, under a new slot
      }
    }
  }
  // Let the readers see the final state, then check it exactly.
  const long before = reads.load();
  AwaitTrue([&] { return reads.load() > before + 10; });
  done.store(true);
  for (auto& t : readers) t.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_GT(nonempty.load(), 0);
  EXPECT_GT(gate.tolerant_reads(), 0u);  // the reads did meet events
  EXPECT_TRUE(idx.HasRetired());
  idx.FreeRetired();
  EXPECT_FALSE(idx.HasRetired());
  OverlapScores out;
  idx.FindMatches(query, out);
  EXPECT_EQ(out.size(), kWorkers / 3);  // round 5: workers with (w + 5) % 3 == 0 kept half
  for (const auto& s : out) EXPECT_EQ(s.blocks, kShared / 2);
}

// Runs read in one read and turned into scores in a later one, while workers leave and their
// slots pass to newcomers that hold less: a translation names a worker only at a depth that
// worker held when the runs were read, and says so when a slot has passed on meanwhile.
TEST(ConcurrentReads, RunsTranslatedLaterNeverNameASlotsNextWorker) {
  constexpr std::uint64_t kWorkers = 16, kNewcomer = 1000;
  constexpr std::size_t kShared = 12, kNewcomerDepth = 2;
  BlockIndex idx;
  idx.SetConcurrentReaders(true);
  std::vector<LocalHash> shared;
  for (std::size_t i = 0; i < kShared; ++i) shared.push_back(2000 + i);
  const auto seq = ComputeSequenceHashes(shared);
  auto chain = [&](std::size_t n) {
    std::vector<StoredBlock> c;
    for (std::size_t i = 0; i < n; ++i) c.push_back({seq[i], shared[i]});
    return c;
  };
  ReadGate gate;
  std::atomic<bool> done{false};
  std::atomic<long> translated{0}, stale{0}, bad{0};
  std::thread owner([&] {
    auto event = [&](auto&& apply) {
      gate.BeginWrite();
      apply();
      if (gate.EndWrite()) idx.FreeRetired();  // freed slots become free to take again
    };
    for (std::uint64_t w = 0; w < kWorkers; ++w)
      event([&] { (void)idx.ApplyStored({w, 0}, std::nullopt, chain(kShared)); });
    // Round after round a worker of the whole prefix leaves and a newcomer of two blocks comes,
    // in the slot the last leaver freed; then the newcomer leaves and a full worker comes back.
    for (std::uint64_t round = 0; !done.load(); ++round) {
      const std::uint64_t w = round % kWorkers;
      event([&] { (void)idx.RemoveWorker(w); });
      event([&] { (void)idx.ApplyStored({kNewcomer + round, 0}, std::nullopt, chain(kNewcomerDepth)); });
      event([&] { (void)idx.RemoveWorker(kNewcomer + round); });
      event([&] { (void)idx.ApplyStored({w, 0}, std::nullopt, chain(kShared)); });
    }
  });
  std::vector<std::thread> readers;
  for (int i = 0; i < 2; ++i) {
    readers.emplace_back([&] {
      MatchRuns runs;
      OverlapScores out;
      while (!done.load(std::memory_order_relaxed)) {
        bool exact = false;
        {
          ReadGate::Reader r(gate, 0ns);
          idx.FindMatches(seq, runs, r.tolerant());
          exact = !r.tolerant();
        }
        out.clear();
        ReadGate::Reader r(gate, 0ns);
        if (!idx.TranslateMatches(runs, out, r.tolerant())) {
          stale.fetch_add(1);
          if (!out.empty()) bad.fetch_add(1);
          continue;
        }
        // A tolerant read may carry a slot past the node where its worker's match ends when
        // events that take one worker off the path and put another on it overlap the read
        // (docs/design.md); an exact one reads each slot at the depth its worker then held.
        std::set<WorkerKey> seen;
        for (const auto& sc : out) {
          const bool newcomer = sc.worker.worker_id >= kNewcomer;
          if (!seen.insert(sc.worker).second || (!newcomer && sc.worker.worker_id >= kWorkers) ||
              sc.blocks > (newcomer && exact ? kNewcomerDepth : kShared) || sc.blocks == 0) {
            bad.fetch_add(1);
          }
        }
        translated.fetch_add(1);
      }
    });
  }
  // Until both outcomes have been seen many times.
  EXPECT_TRUE(AwaitTrue([&] { return stale.load() >= 10 && translated.load() >= 1000; }))
      << stale.load() << " stale, " << translated.load() << " translated";
  done.store(true);
  owner.join();
  for (auto& t : readers) t.join();
  EXPECT_EQ(bad.load(), 0);
}

}  // namespace
}  // namespace kvrouter
