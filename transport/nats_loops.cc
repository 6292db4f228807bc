#include "transport/nats_loops.h"

#include <string>
#include <utility>

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

std::optional<std::size_t> NatsLoops::Current() const { return io_.impl().Current(); }

}  // namespace kvrouter
