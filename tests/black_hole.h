// BlackHole: a local stand-in for a host that drops packets, for connect-timeout tests. A
// listening socket on 127.0.0.1 whose accept queue (backlog 0: one connection, taken by a
// filler) is full and never drained: Linux then drops every further SYN, so a connect to it
// hangs as to a host that does not answer. Owned by one test thread.
//
//   BlackHole hole;  ASSERT_TRUE(hole.ok());  Announce(1, hole.url());
#pragma once

#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <string>

namespace kvrouter {

class BlackHole {
 public:
  BlackHole() {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ok_ = ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 && ::listen(listen_fd_, 0) == 0;
    socklen_t len = sizeof(a);
    ok_ = ok_ && ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len) == 0;
    port_ = ntohs(a.sin_port);
    filler_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    ok_ = ok_ && ::connect(filler_fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  }
  ~BlackHole() {
    ::close(filler_fd_);
    ::close(listen_fd_);
  }
  BlackHole(const BlackHole&) = delete;
  BlackHole& operator=(const BlackHole&) = delete;

  bool ok() const { return ok_; }
  std::uint16_t port() const { return port_; }
  std::string url() const { return fmt::format("http://127.0.0.1:{}", port_); }

 private:
  int listen_fd_ = -1, filler_fd_ = -1;
  std::uint16_t port_ = 0;
  bool ok_ = false;
};

}  // namespace kvrouter
