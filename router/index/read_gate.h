// ReadGate: lets queries read an index shard without ever sleeping on its writer, while the
// shard thread applies events to it in place (terms: docs/design.md "Glossary").
// - The writer brackets every event with BeginWrite/EndWrite (a version counter, odd while
//   writing). BeginWrite waits for exact readers inside to leave; EndWrite reports whether the
//   shard is quiet (no reader of either kind inside), when memory replaced so far may be freed.
// - A reader that finds the version even reads an exact state: no write starts until it leaves.
// - A reader that finds an event half-applied waits up to `patience` for it to finish (and the
//   writer's next event lets it in first, so a writer with a backlog cannot starve it); if the
//   writer does not finish in that time (it was preempted: two cores, more runnable threads),
//   the reader goes in anyway and reads while events are applied ("tolerant": it may see that
//   event and the ones after it partly; the writer does not wait for it). Once a reader has
//   waited out its patience on an event, later readers that meet the same event go in at once:
//   its thread is off the CPU, and each would otherwise spin `patience` too. Such a read relies
//   on the index being readable while written (BlockIndex's thread contract, block_index.h):
//   what a write replaces is retired until the shard is quiet (EndWrite, Quiet).
// Thread contract: one writer at a time (the shard's lock orders them); any number of readers.
//
//   writer: gate.BeginWrite(); Apply(event); if (gate.EndWrite()) index.FreeRetired();
//   reader: ReadGate::Reader r(gate, patience); index.FindMatches(hashes, out, r.tolerant());
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

namespace kvrouter {

// Word access for memory that a writer changes while readers may read it (index shards): the
// same instructions as plain loads and stores on x86, but defined behaviour, and seen by TSan.
template <typename T>
inline T RelaxedLoad(const T& v) {
  return __atomic_load_n(&v, __ATOMIC_RELAXED);
}
template <typename T>
inline T AcquireLoad(const T& v) {
  return __atomic_load_n(&v, __ATOMIC_ACQUIRE);
}
template <typename T, typename U>
inline void RelaxedStore(T& v, U x) {
  __atomic_store_n(&v, static_cast<T>(x), __ATOMIC_RELAXED);
}
template <typename T, typename U>
inline void ReleaseStore(T& v, U x) {
  __atomic_store_n(&v, static_cast<T>(x), __ATOMIC_RELEASE);
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

class ReadGate {
 public:
  // A route waits this long for a half-applied event before reading around it: an event is
  // short unless its thread lost its CPU, so a longer wait mostly waits for a preempted thread,
  // and a spinning reader also keeps a CPU from the writer it waits for. Chosen against the
  // find_matches p99 goal of docs/performance.md (index_bench).
  static constexpr std::chrono::microseconds kDefaultPatience{3};

  // How long an event holds back for readers that waited out the previous one (a reader that
  // lost its CPU while waiting is not waited for longer).
  static constexpr std::chrono::microseconds kWriterHold{20};

  // Writer: an event starts. Readers that waited for the previous event get in first, then it
  // waits for exact readers inside to leave (they read for microseconds); readers arriving now
  // wait for EndWrite or read tolerantly. Tolerant readers inside are not waited for: they
  // read around writes by design, and where queries meet events all the time, waiting for
  // them would hold up a large share of the events.
  void BeginWrite() {
    if (waiting_.load(std::memory_order_seq_cst) != 0) {
      // Without this a writer with a backlog starts its next event within nanoseconds of the
      // last, and a waiting reader never finds the gate open.
      const auto deadline = std::chrono::steady_clock::now() + kWriterHold;
      for (unsigned i = 1; waiting_.load(std::memory_order_seq_cst) != 0; ++i) {
        CpuRelax();
        if (i % 16 == 0 && std::chrono::steady_clock::now() >= deadline) break;
      }
    }
    version_.store(version_.load(std::memory_order_relaxed) + 1, std::memory_order_seq_cst);
    for (unsigned i = 1; exact_.load(std::memory_order_seq_cst) != 0; ++i) {
      if (i % 64 == 0) {
        std::this_thread::yield();  // a reader that lost its CPU needs one of ours
      } else {
        CpuRelax();
      }
    }
  }
  // Writer: the event is applied. True when no reader is inside and none can still hold memory
  // this event or an earlier one replaced (a reader arriving from now on finds only the new
  // state).
  bool EndWrite() {
    version_.store(version_.load(std::memory_order_relaxed) + 1, std::memory_order_seq_cst);
    return Quiet();
  }
  // Writer, between events: the same question again (a tolerant reader may have left since).
  bool Quiet() const {
    return exact_.load(std::memory_order_seq_cst) == 0 && tolerant_.load(std::memory_order_seq_cst) == 0;
  }
  bool writing() const { return (version_.load(std::memory_order_relaxed) & 1) != 0; }
  int waiting_readers() const { return waiting_.load(std::memory_order_relaxed); }

  class Reader {
   public:
    Reader(ReadGate& g, std::chrono::nanoseconds patience) : g_(g) { tolerant_ = g_.Enter(patience); }
    ~Reader() { (tolerant_ ? g_.tolerant_ : g_.exact_).fetch_sub(1, std::memory_order_release); }
    Reader(const Reader&) = delete;
    Reader& operator=(const Reader&) = delete;
    // The read may overlap the writing of events (see the header comment).
    bool tolerant() const { return tolerant_; }

   private:
    ReadGate& g_;
    bool tolerant_ = false;
  };

  std::uint64_t tolerant_reads() const { return tolerant_reads_.load(std::memory_order_relaxed); }

 private:
  // Counts the reader in (as exact first, so a writer starting now waits); true when it goes in
  // tolerantly.
  bool Enter(std::chrono::nanoseconds patience) {
    exact_.fetch_add(1, std::memory_order_seq_cst);
    std::uint64_t v = version_.load(std::memory_order_seq_cst);
    if ((v & 1) == 0) return false;  // between events: the writer waits for us
    if (v == late_.load(std::memory_order_relaxed)) {
      // A reader before us already waited out its patience on this very event: its thread has
      // lost its CPU (for a scheduler slice, typically), so waiting again would only burn ours.
      // Counted in during the event, as a reader that waited.
      GoTolerant();
      return true;
    }
    // An event is being applied: step aside so BeginWrite's wait cannot hold it up, say that we
    // wait (the next event lets us in first), and give it `patience` to finish.
    exact_.fetch_sub(1, std::memory_order_release);
    waiting_.fetch_add(1, std::memory_order_seq_cst);
    const auto deadline = std::chrono::steady_clock::now() + patience;
    bool tolerant = false;
    while (true) {
      bool late = false;
      for (unsigned i = 1; version_.load(std::memory_order_acquire) == v; ++i) {
        CpuRelax();
        if (i % 16 == 0 && std::chrono::steady_clock::now() >= deadline) {
          late = true;
          break;
        }
      }
      exact_.fetch_add(1, std::memory_order_seq_cst);
      const std::uint64_t now = version_.load(std::memory_order_seq_cst);
      if ((now & 1) == 0) break;  // counted in between events: exact
      if (late) {                 // counted in during the event: read around it
        tolerant = true;
        late_.store(v, std::memory_order_relaxed);
        GoTolerant();
        break;
      }
      exact_.fetch_sub(1, std::memory_order_release);  // another event began: wait for it too
      v = now;
    }
    waiting_.fetch_sub(1, std::memory_order_seq_cst);
    return tolerant;
  }

  // From exact to tolerant: counted as tolerant before no longer as exact, so EndWrite never
  // finds the reader in neither count.
  void GoTolerant() {
    tolerant_.fetch_add(1, std::memory_order_seq_cst);
    exact_.fetch_sub(1, std::memory_order_release);
    tolerant_reads_.fetch_add(1, std::memory_order_relaxed);
  }

  std::atomic<std::uint64_t> version_{0};  // odd while an event is being applied
  std::atomic<int> exact_{0};              // exact readers inside (and readers entering)
  std::atomic<int> tolerant_{0};           // tolerant readers inside
  std::atomic<int> waiting_{0};            // readers waiting for an event to end
  std::atomic<std::uint64_t> tolerant_reads_{0};
  // The last event (odd version) a reader waited out its whole patience for: later readers
  // that meet the same event go in at once.
  std::atomic<std::uint64_t> late_{0};
};

}  // namespace kvrouter
