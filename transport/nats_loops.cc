#include "transport/nats_loops.h"

#include <algorithm>
#include <future>
#include <string>
#include <utility>

#include <boost/asio/post.hpp>

#include "transport/http_io_impl.h"

namespace kvrouter {

Result<std::unique_ptr<NatsLoops>> NatsLoops::Connect(HttpIo& io, NatsOptions options) {
  std::unique_ptr<NatsLoops> loops(new NatsLoops(io));
  const std::string name = options.name;
  for (std::size_t i = 0; i < io.impl().loops.size(); ++i) {
    options.event_loop = &io.impl().loops[i]->ioc;
    options.name = name + "-loop" + std::to_string(i);
    auto client = NatsClient::Connect(options, {});
    if (!client.ok()) return client.status();
    loops->clients_.push_back(std::move(client).value());
  }
  return loops;
}

void NatsLoops::Close() {
  for (auto& client : clients_) client->Close();
}

std::optional<std::size_t> NatsLoops::Current() const { return io_.impl().Current(); }

void NatsLoops::Flush(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (std::size_t i = 0; i < clients_.size(); ++i) {
    auto ran = std::make_shared<std::promise<void>>();
    std::future<void> done = ran->get_future();
    boost::asio::post(io_.impl().loops[i]->ioc, [ran] { ran->set_value(); });
    if (done.wait_until(deadline) != std::future_status::ready) return;
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    (void)clients_[i]->Flush(std::max(left, std::chrono::milliseconds(1)));
  }
}

}  // namespace kvrouter
