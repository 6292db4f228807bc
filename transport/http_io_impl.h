// What HttpIo hides: an io_context per thread. Included only by transport/'s HTTP code.
// An io_context run by one thread needs no strand for objects only its thread touches: its
// handlers never run at once.
#pragma once

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>

#include <atomic>
#include <cstddef>
#include <memory>
#include <optional>
#include <string_view>
#include <thread>
#include <vector>

#include "transport/http_io.h"

namespace kvrouter {

// A header name or value, a method or a target that would split a message's head.
inline bool HasLineBreak(std::string_view s) { return s.find_first_of("\r\n") != std::string_view::npos; }

struct HttpIo::Impl {
  using Executor = boost::asio::io_context::executor_type;
  // An io_context whose pending handlers can be destroyed before any loop's context is: a
  // handler of one loop may own objects of another (a connection's session owns the listener,
  // whose acceptor is the first loop's).
  struct Context : boost::asio::io_context {
    using io_context::io_context;
    using execution_context::shutdown;
  };
  struct Loop {
    Context ioc{1};  // one thread: a post from it is queued without a lock or a wake-up
    std::optional<boost::asio::executor_work_guard<Executor>> work;
    std::thread thread;
  };

  // The loop the calling thread runs, if it is one of these.
  std::optional<std::size_t> Current() const;
  // The next loop in turn (a new connection's).
  std::size_t Next() { return next.fetch_add(1, std::memory_order_relaxed) % loops.size(); }
  Executor executor(std::size_t loop) { return loops[loop]->ioc.get_executor(); }
  // Whether the calling thread runs one of the loops (a wait for them there would never end).
  bool OnLoop() const { return Current().has_value(); }
  bool stopped() const { return stopped_.load(); }

  std::vector<std::unique_ptr<Loop>> loops;
  std::atomic<std::size_t> next{0};
  std::atomic<bool> stopped_{false};
};

}  // namespace kvrouter
