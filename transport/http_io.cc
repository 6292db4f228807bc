#include "transport/http_io.h"

#include <pthread.h>

#include <algorithm>

#include "transport/http_io_impl.h"

namespace kvrouter {

HttpIo::HttpIo(std::size_t threads) : impl_(std::make_unique<Impl>()) {
  impl_->work.emplace(impl_->ioc.get_executor());
  for (std::size_t i = 0; i < std::max<std::size_t>(1, threads); ++i) {
    impl_->threads.emplace_back([this] {
      pthread_setname_np(pthread_self(), "http-io");
      impl_->ioc.run();
    });
  }
}

HttpIo::~HttpIo() { Stop(); }

void HttpIo::Stop() {
  if (impl_->threads.empty()) return;
  impl_->work.reset();
  impl_->ioc.stop();
  for (std::thread& t : impl_->threads) t.join();
  impl_->threads.clear();
}

}  // namespace kvrouter
