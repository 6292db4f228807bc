// What HttpIo hides: the io_context and its threads. Included only by transport/'s HTTP code.
#pragma once

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>

#include <optional>
#include <thread>
#include <vector>

#include "transport/http_io.h"

namespace kvrouter {

struct HttpIo::Impl {
  boost::asio::io_context ioc;
  std::optional<boost::asio::executor_work_guard<boost::asio::io_context::executor_type>> work;
  std::vector<std::thread> threads;
};

}  // namespace kvrouter
