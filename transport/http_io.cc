#include "transport/http_io.h"

#include <pthread.h>

#include <algorithm>

#include "transport/http_io_impl.h"

namespace kvrouter {

namespace {
// The loop this thread runs: set once, at the start of an HttpIo thread.
thread_local const HttpIo::Impl* t_owner = nullptr;
thread_local std::size_t t_loop = 0;
}  // namespace

std::optional<std::size_t> HttpIo::Impl::Current() const {
  if (t_owner != this) return std::nullopt;
  return t_loop;
}

HttpIo::HttpIo(std::size_t threads) : impl_(std::make_unique<Impl>()) {
  const std::size_t n = std::max<std::size_t>(1, threads);
  for (std::size_t i = 0; i < n; ++i) {
    auto loop = std::make_unique<Impl::Loop>();
    loop->work.emplace(loop->ioc.get_executor());
    impl_->loops.push_back(std::move(loop));
  }
  for (std::size_t i = 0; i < n; ++i) {
    impl_->loops[i]->thread = std::thread([impl = impl_.get(), i] {
      pthread_setname_np(pthread_self(), "http-io");
      t_owner = impl;
      t_loop = i;
      impl->loops[i]->ioc.run();
    });
  }
}

HttpIo::~HttpIo() {
  Stop();
  // Every loop's pending handlers go (and what they own) before any loop's context does.
  for (auto& loop : impl_->loops) loop->ioc.shutdown();
}

void HttpIo::Stop() {
  if (impl_->stopped_.exchange(true)) return;
  for (auto& loop : impl_->loops) {
    loop->work.reset();
    loop->ioc.stop();
  }
  for (auto& loop : impl_->loops) loop->thread.join();
}

}  // namespace kvrouter
