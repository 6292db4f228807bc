// Clang's thread-safety analysis, behind KV_* macros (empty for other compilers), and mutex
// types it understands: KvMutex / KvMutexLock and KvSharedMutex / KvWriterLock / KvReaderLock.
// A member declared `T x KV_GUARDED_BY(mu_);` is then checked at compile time by the clang
// build (-Wthread-safety): touching it without holding mu_ is a warning, and the clang build
// turns warnings into errors for the analysis. The types are std::mutex / std::shared_mutex
// underneath and meet BasicLockable (std::unique_lock<KvMutex>, std::condition_variable_any).
// Lives in transport/ because every directory above events/ may use it; it has no dependency.
//
// Inside a lambda that runs under the lock, call mu_.AssertHeld() first.
//
//   mutable KvMutex mu_;  int n_ KV_GUARDED_BY(mu_);  void Inc() { KvMutexLock g(mu_); ++n_; }
#pragma once

#include <mutex>
#include <shared_mutex>

#if defined(__clang__)
#define KV_THREAD_ATTRIBUTE(x) __attribute__((x))
#else
#define KV_THREAD_ATTRIBUTE(x)
#endif

#define KV_CAPABILITY(x) KV_THREAD_ATTRIBUTE(capability(x))
#define KV_SCOPED_CAPABILITY KV_THREAD_ATTRIBUTE(scoped_lockable)
#define KV_GUARDED_BY(x) KV_THREAD_ATTRIBUTE(guarded_by(x))
#define KV_PT_GUARDED_BY(x) KV_THREAD_ATTRIBUTE(pt_guarded_by(x))
#define KV_REQUIRES(...) KV_THREAD_ATTRIBUTE(requires_capability(__VA_ARGS__))
#define KV_REQUIRES_SHARED(...) KV_THREAD_ATTRIBUTE(requires_shared_capability(__VA_ARGS__))
#define KV_ACQUIRE(...) KV_THREAD_ATTRIBUTE(acquire_capability(__VA_ARGS__))
#define KV_ACQUIRE_SHARED(...) KV_THREAD_ATTRIBUTE(acquire_shared_capability(__VA_ARGS__))
#define KV_RELEASE(...) KV_THREAD_ATTRIBUTE(release_capability(__VA_ARGS__))
#define KV_RELEASE_SHARED(...) KV_THREAD_ATTRIBUTE(release_shared_capability(__VA_ARGS__))
#define KV_RELEASE_GENERIC(...) KV_THREAD_ATTRIBUTE(release_generic_capability(__VA_ARGS__))
#define KV_TRY_ACQUIRE(...) KV_THREAD_ATTRIBUTE(try_acquire_capability(__VA_ARGS__))
#define KV_EXCLUDES(...) KV_THREAD_ATTRIBUTE(locks_excluded(__VA_ARGS__))
#define KV_ASSERT_CAPABILITY(x) KV_THREAD_ATTRIBUTE(assert_capability(x))
#define KV_ASSERT_SHARED_CAPABILITY(x) KV_THREAD_ATTRIBUTE(assert_shared_capability(x))
#define KV_NO_THREAD_SAFETY_ANALYSIS KV_THREAD_ATTRIBUTE(no_thread_safety_analysis)

namespace kvrouter {

class KV_CAPABILITY("mutex") KvMutex {
 public:
  void lock() KV_ACQUIRE() { m_.lock(); }
  void unlock() KV_RELEASE() { m_.unlock(); }
  bool try_lock() KV_TRY_ACQUIRE(true) { return m_.try_lock(); }
  // Tells the analysis the caller holds this mutex (checked by nothing at run time): for
  // lambdas run under the lock, which the analysis cannot follow into.
  void AssertHeld() const KV_ASSERT_CAPABILITY(this) {}

 private:
  std::mutex m_;
};

// lock_guard for KvMutex, with an early Unlock() for "gather under the lock, publish after".
class KV_SCOPED_CAPABILITY KvMutexLock {
 public:
  explicit KvMutexLock(KvMutex& mu) KV_ACQUIRE(mu) : mu_(mu) { mu_.lock(); }
  ~KvMutexLock() KV_RELEASE() {
    if (held_) mu_.unlock();
  }
  void Unlock() KV_RELEASE() {
    mu_.unlock();
    held_ = false;
  }
  KvMutexLock(const KvMutexLock&) = delete;
  KvMutexLock& operator=(const KvMutexLock&) = delete;

 private:
  KvMutex& mu_;
  bool held_ = true;
};

class KV_CAPABILITY("mutex") KvSharedMutex {
 public:
  void lock() KV_ACQUIRE() { m_.lock(); }
  void unlock() KV_RELEASE() { m_.unlock(); }
  void lock_shared() KV_ACQUIRE_SHARED() { m_.lock_shared(); }
  void unlock_shared() KV_RELEASE_SHARED() { m_.unlock_shared(); }
  void AssertHeld() const KV_ASSERT_CAPABILITY(this) {}
  void AssertReaderHeld() const KV_ASSERT_SHARED_CAPABILITY(this) {}

 private:
  std::shared_mutex m_;
};

class KV_SCOPED_CAPABILITY KvWriterLock {
 public:
  explicit KvWriterLock(KvSharedMutex& mu) KV_ACQUIRE(mu) : mu_(mu) { mu_.lock(); }
  ~KvWriterLock() KV_RELEASE() { mu_.unlock(); }
  KvWriterLock(const KvWriterLock&) = delete;
  KvWriterLock& operator=(const KvWriterLock&) = delete;

 private:
  KvSharedMutex& mu_;
};

// Shared ownership of any capability with lock_shared/unlock_shared (KvSharedMutex, the index's
// ShardLock); the mutex type is deduced: KvReaderLock lk(mu_);
template <typename Mutex>
class KV_SCOPED_CAPABILITY KvReaderLock {
 public:
  explicit KvReaderLock(Mutex& mu) KV_ACQUIRE_SHARED(mu) : mu_(mu) { mu_.lock_shared(); }
  ~KvReaderLock() KV_RELEASE() { mu_.unlock_shared(); }
  KvReaderLock(const KvReaderLock&) = delete;
  KvReaderLock& operator=(const KvReaderLock&) = delete;

 private:
  Mutex& mu_;
};

}  // namespace kvrouter
