// ShardLock: an index shard's reader-writer lock, for one writer that works in short steps (the
// shard's writer applying events, upkeep included) and readers of the shard's bookkeeping that
// must not wait long: the stats (TreeSizes, TreeSize, Memory) and router.dump (DumpableRanks,
// DumpRank). Route requests never take it: FindMatches goes through the shard's ReadGate
// (router/index/read_gate.h; docs/design.md "Glossary": read gate).
// - A reader that finds the writer inside says so (ReadersWaiting) and spins for up to
//   kReaderSpin: a running writer lets it in at its next step, so the reader does not pay a
//   sleep and a wake-up. If the writer does not let go in that time (it was preempted), the
//   reader sleeps on the lock like any other.
// - The writer calls YieldToReaders() between steps: when a reader waits it unlocks, gives the
//   waiting readers up to kWriterPause (and then a few turns of its CPU) to get in, and locks
//   again (waiting behind them).
// Thread contract: any number of readers; writers (the shard thread, or a thread applying its
// own events, ShardedIndexOptions::apply_on_submit) take it exclusively, one at a time.
//
//   ShardLock mu;
//   { KvReaderLock r(mu); ... }                        // readers
//   mu.lock(); for (step : steps) { Apply(step); mu.YieldToReaders(); } mu.unlock();  // writer
#pragma once

#include <atomic>
#include <chrono>
#include <shared_mutex>
#include <thread>

#include "router/index/read_gate.h"
#include "events/base/thread_annotations.h"

namespace kvrouter {

class KV_CAPABILITY("mutex") ShardLock {
 public:
  static constexpr std::chrono::microseconds kReaderSpin{20};
  static constexpr std::chrono::microseconds kWriterPause{5};
  static constexpr int kWriterYields = 4;

  void lock() KV_ACQUIRE() { m_.lock(); }
  bool try_lock() KV_TRY_ACQUIRE(true) { return m_.try_lock(); }
  void unlock() KV_RELEASE() { m_.unlock(); }

  void lock_shared() KV_ACQUIRE_SHARED() {
    if (m_.try_lock_shared()) return;
    waiting_.fetch_add(1);
    const auto deadline = std::chrono::steady_clock::now() + kReaderSpin;
    bool in = false;
    for (unsigned i = 1; !(in = m_.try_lock_shared()); ++i) {
      CpuRelax();
      if (i % 16 == 0 && std::chrono::steady_clock::now() > deadline) break;
    }
    if (!in) m_.lock_shared();
    waiting_.fetch_sub(1);
  }
  void unlock_shared() KV_RELEASE_SHARED() { m_.unlock_shared(); }

  bool ReadersWaiting() const { return waiting_.load(std::memory_order_relaxed) != 0; }

  // Writer, lock held: when readers wait, lets them in before going on. True if it did.
  // A reader that spins gets in within microseconds; one that slept on the lock must first be
  // given a CPU, and on a busy machine the CPU it needs may be this one, so after kWriterPause
  // the writer offers its CPU (sched_yield) a few times before taking the lock back.
  bool YieldToReaders() KV_REQUIRES(this) {
    if (!ReadersWaiting()) return false;
    m_.unlock();
    const auto deadline = std::chrono::steady_clock::now() + kWriterPause;
    for (unsigned i = 1; ReadersWaiting(); ++i) {
      CpuRelax();
      if (i % 16 == 0 && std::chrono::steady_clock::now() > deadline) break;
    }
    for (int i = 0; i < kWriterYields && ReadersWaiting(); ++i) std::this_thread::yield();
    m_.lock();
    return true;
  }

 private:
  std::shared_mutex m_;
  std::atomic<int> waiting_{0};  // readers spinning or asleep on the lock
};

}  // namespace kvrouter
