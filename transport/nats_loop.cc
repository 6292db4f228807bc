// Event-loop mode of NatsClient (NatsOptions::event_loop): the connection's socket is served by
// an Asio io_context's thread instead of nats.c's read and flusher threads, and subscriptions are
// synchronous ones whose messages that thread hands to their handlers right after each read.
//
// What nats.c 3.4.1 does in this mode (from its sources): it starts no read thread, and with
// send_asap no flusher. It calls Attach after each (re)connect with the new socket (start
// reading); ReadAddRemove(false) and WriteAddRemove(false) when it stops polling a lost
// connection, before it reconnects; WriteAddRemove(true) once when its write buffer gets data,
// and (false) from natsConnection_ProcessWriteEvent once that has written it all; Detach when
// the connection closes. natsConnection_ProcessReadEvent reads once and parses what it read.
// These callbacks come from any thread (connecting, reconnecting, publishing, nats.c's timers),
// all but Detach under the connection's lock, so they only post to the loop: the socket is
// touched on the loop alone, and the loop calls into nats.c under `mu`, which Detach also takes
// (it is never taken under the connection's lock, so the two locks never cross).
//
// A message is destroyed through nats.c's garbage collector, whose thread is woken for each one
// that finds it idle: the loop keeps handled messages and destroys them kSpentBatch at a time,
// so that one wake-up frees many (at most kSpentBatch wait, freed at the latest with the loop's
// state).
//
// The loop watches a duplicate of nats.c's descriptor, so that the two are closed independently
// (nats.c closes its own at a disconnect, the loop its copy when told to stop). After a read that
// left bytes in the socket (FIONREAD), the loop reads again at once instead of waiting (each Asio
// wait re-arms epoll, a system call). A write wait belongs to the socket it was armed on: a newer
// socket's writes never depend on an older one's wait.
//
// Not for TLS: nats.c 3.4.1 waits inside its TLS reads and writes (poll) for the rest of a record,
// which would block the loop's thread; a TLS connection is left to nats.c's own threads.
#include <fcntl.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/posix/stream_descriptor.hpp>
#include <fmt/format.h>

#include "transport/nats_detail.h"

namespace kvrouter::transport_detail {

namespace net = boost::asio;

constexpr std::size_t kSpentBatch = 256;

struct LoopAttachment : std::enable_shared_from_this<LoopAttachment> {
  explicit LoopAttachment(net::io_context& loop) : ioc(loop) {}
  ~LoopAttachment() { DestroySpent(); }

  struct Polled {
    SubscriptionState* state;
    natsSubscription* sub;
  };

  net::io_context& ioc;
  // Held while the loop calls into nats.c and runs handlers; Detach and RemovePolled take it to
  // know the loop is out of what they end. Recursive: a handler may subscribe or unsubscribe
  // another subscription of the connection.
  std::recursive_mutex mu;
  std::atomic<natsConnection*> nc{nullptr};  // set by Attach, cleared by Detach under `mu`
  std::vector<Polled> polled;                // under `mu`
  std::atomic<std::uint64_t> attach_seq{0};  // counts Attach calls: which socket a post is about
  std::atomic<bool> want_write{false};       // nats.c's write buffer has data for the loop

  // The loop's thread only.
  std::optional<net::posix::stream_descriptor> socket;  // the duplicate being watched
  std::uint64_t watched = 0;                            // the attach_seq of `socket`
  bool write_waiting = false;
  std::vector<natsMsg*> spent;  // handled, not destroyed yet (under `mu` while delivering)

  void DestroySpent() {
    for (natsMsg* m : spent) natsMsg_Destroy(m);
    spent.clear();
  }

  void Watch(std::uint64_t seq, int fd) {
    if (seq < watched) {
      ::close(fd);
      return;
    }
    socket.reset();
    write_waiting = false;
    watched = seq;
    boost::system::error_code ec;
    socket.emplace(ioc);
    socket->assign(fd, ec);
    if (ec) {
      ::close(fd);
      socket.reset();
      return;
    }
    AwaitRead(seq);
  }

  void Unwatch(std::uint64_t seq) {
    if (seq != watched) return;  // a newer socket is watched already
    socket.reset();
    write_waiting = false;
  }

  void AwaitRead(std::uint64_t seq) {
    socket->async_wait(net::posix::stream_descriptor::wait_read,
                       [self = shared_from_this(), seq](const boost::system::error_code& ec) {
                         if (!ec && seq == self->watched && self->socket) self->OnReadable(seq);
                       });
  }

  void OnReadable(std::uint64_t seq) {
    {
      std::lock_guard<std::recursive_mutex> g(mu);
      natsConnection* const c = nc.load();
      if (c == nullptr) return;
      natsConnection_ProcessReadEvent(c);
      DeliverPolled();
      if (spent.size() >= kSpentBatch) DestroySpent();
    }
    if (seq != watched || !socket) return;
    int queued = 0;
    if (::ioctl(socket->native_handle(), FIONREAD, &queued) == 0 && queued > 0) {
      net::post(ioc, [self = shared_from_this(), seq] {
        if (seq == self->watched && self->socket) self->OnReadable(seq);
      });
    } else {
      AwaitRead(seq);
    }
  }

  // Writes what nats.c buffered; if the socket takes only part, waits until it can take more.
  void Flush() {
    if (!want_write.load()) return;
    {
      std::lock_guard<std::recursive_mutex> g(mu);
      natsConnection* const c = nc.load();
      if (c == nullptr) return;
      natsConnection_ProcessWriteEvent(c);
    }
    if (!want_write.load() || !socket || write_waiting) return;
    write_waiting = true;
    socket->async_wait(net::posix::stream_descriptor::wait_write,
                       [self = shared_from_this(), seq = watched](const boost::system::error_code& ec) {
                         if (seq != self->watched || !self->socket) return;
                         self->write_waiting = false;
                         if (!ec) self->Flush();
                       });
  }

  // Under `mu`: hands every message waiting in a polled subscription to its handler.
  void DeliverPolled() {
    for (std::size_t i = 0; i < polled.size();) {
      const Polled p = polled[i];
      for (;;) {
        int msgs = 0, bytes = 0;
        if (natsSubscription_GetPending(p.sub, &msgs, &bytes) != NATS_OK || msgs == 0) break;
        natsMsg* raw = nullptr;
        const natsStatus s = natsSubscription_NextMsg(&raw, p.sub, 0);
        if (s == NATS_OK) {
          spent.push_back(raw);
          Deliver(p.state, p.sub, raw);
        } else if (s == NATS_NO_RESPONDERS) {
          DeliverNoResponders(p.state);
        } else if (s != NATS_SLOW_CONSUMER) {  // that one is reported once, then messages follow
          break;
        }
        if (i >= polled.size() || polled[i].state != p.state) break;  // a handler changed the list
      }
      // Where the list goes on after `p` (a handler may have removed `p` or one before it).
      const auto at = std::find_if(polled.begin(), polled.end(), [&](const Polled& q) { return q.state == p.state; });
      if (at != polled.end()) {
        i = static_cast<std::size_t>(at - polled.begin()) + 1;
      } else if (i > polled.size()) {
        i = polled.size();
      }
    }
  }

  // nats.c took the message (to say "no responders" as a status), so which request it answers is
  // unknown: the handler gets the status alone.
  static void DeliverNoResponders(SubscriptionState* state) {
    static const std::vector<std::pair<std::string, std::string>> kStatus{{"Status", "503"}};
    try {
      IncomingMessage m;
      m.no_responders = true;
      m.headers = &kStatus;
      state->handler(m);
    } catch (const std::exception& e) {
      state->client->CountCallbackError(fmt::format("handler for '{}'", state->subject), e.what());
    } catch (...) {
      state->client->CountCallbackError(fmt::format("handler for '{}'", state->subject), "unknown exception");
    }
  }
};

namespace {

natsStatus OnAttach(void** user, void* loop, natsConnection* nc, natsSock fd) {
  auto* a = static_cast<LoopAttachment*>(loop);
  *user = a;
  const int copy = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (copy < 0) return NATS_SYS_ERROR;
  a->nc.store(nc);
  const std::uint64_t seq = a->attach_seq.fetch_add(1) + 1;
  net::post(a->ioc, [self = a->shared_from_this(), seq, copy] { self->Watch(seq, copy); });
  return NATS_OK;
}

natsStatus OnRead(void* user, bool add) {
  auto* a = static_cast<LoopAttachment*>(user);
  if (add) return NATS_OK;  // nats.c asks for reads only through Attach
  const std::uint64_t seq = a->attach_seq.load();
  net::post(a->ioc, [self = a->shared_from_this(), seq] { self->Unwatch(seq); });
  return NATS_OK;
}

natsStatus OnWrite(void* user, bool add) {
  auto* a = static_cast<LoopAttachment*>(user);
  a->want_write.store(add);
  if (add) net::post(a->ioc, [self = a->shared_from_this()] { self->Flush(); });
  return NATS_OK;
}

natsStatus OnDetach(void* user) {
  auto* a = static_cast<LoopAttachment*>(user);
  {
    std::lock_guard<std::recursive_mutex> g(a->mu);  // the loop is out of nats.c and handlers
    a->nc.store(nullptr);
  }
  const std::uint64_t seq = a->attach_seq.load();
  net::post(a->ioc, [self = a->shared_from_this(), seq] { self->Unwatch(seq); });
  return NATS_OK;
}

}  // namespace

std::shared_ptr<LoopAttachment> MakeLoopAttachment(net::io_context& loop) {
  return std::make_shared<LoopAttachment>(loop);
}

natsStatus SetEventLoop(natsOptions* opts, LoopAttachment& attachment) {
  return natsOptions_SetEventLoop(opts, &attachment, OnAttach, OnRead, OnWrite, OnDetach);
}

void AddPolled(LoopAttachment& attachment, SubscriptionState* state, natsSubscription* sub) {
  std::lock_guard<std::recursive_mutex> g(attachment.mu);
  attachment.polled.push_back({state, sub});
}

void RemovePolled(LoopAttachment& attachment, SubscriptionState* state) {
  std::lock_guard<std::recursive_mutex> g(attachment.mu);
  std::erase_if(attachment.polled, [&](const LoopAttachment::Polled& p) { return p.state == state; });
}

}  // namespace kvrouter::transport_detail
