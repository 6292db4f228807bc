// kSanitized: true in an ASan or TSan build of the tests. Their shadow memory and quarantine make
// a process's RSS meaningless and its timings slower, so a test of memory or time checks those
// only when false (the behaviour it checks either way).
#pragma once

namespace kvrouter {

// g++ names its sanitizers with macros, clang answers __has_feature.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define KV_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define KV_TEST_SANITIZED 1
#endif
#endif
#ifdef KV_TEST_SANITIZED
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif

}  // namespace kvrouter
