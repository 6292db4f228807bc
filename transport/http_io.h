// HttpIo: the threads that run asynchronous HTTP (Boost.Asio/Beast), shared by an HttpListener
// and an HttpClient so a proxy's two sides run on the same few threads; no thread per
// connection. Each thread runs its own event loop: a connection lives on one loop for its life,
// and an HttpClient call started on a loop's thread runs on that loop, so that a proxied
// request is served on its client connection's thread, without hand-offs between threads.
// Asio stays private to transport/: users see only this handle.
// Thread contract: construct and destroy from one controlling thread; Stop joins the threads
// (every listener and client using it must be stopped first). Ownership: owns its threads.
//
//   HttpIo io(2);  auto listener = HttpListener::Start(io, options, handler);  ...  io.Stop();
#pragma once

#include <cstddef>
#include <memory>

namespace kvrouter {

class HttpIo {
 public:
  explicit HttpIo(std::size_t threads);
  ~HttpIo();  // Stop()
  HttpIo(const HttpIo&) = delete;
  HttpIo& operator=(const HttpIo&) = delete;

  // Ends the event loops and joins their threads. Idempotent.
  void Stop();

  struct Impl;  // transport/http_io_impl.h
  Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvrouter
