// InMemoryBus: a MessageBus inside one process, for unit tests and kvbench's offline mode.
// Publish delivers synchronously, on the caller's thread, to every matching subscription (NATS
// wildcards `*` and `>`; one member per queue group, round-robin), so the caller sees every
// effect of a message when Publish returns. Request() publishes with a private reply subject
// and returns the reply. Like NATS, a request (a message with a reply subject) that no
// subscription matches is answered at once with an empty "no responders" message whose header
// Status is "503".
// Thread-safe: any thread may publish, subscribe and unsubscribe. One mutex guards the
// subscription list and each subscription's liveness; handlers run unlocked, so a handler may
// publish again (nested delivery) or drop its own subscription. Destroying a subscription waits
// until no other thread is running its handler, so afterwards it never runs again (as the
// MessageBus contract says). The bus must outlive its subscriptions.
//
//   InMemoryBus bus;  auto sub = bus.Subscribe("a.*", "", handler);  bus.Publish("a.b", bytes);
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "transport/message_bus.h"
#include "events/base/thread_annotations.h"

namespace kvrouter {

class InMemoryBus : public MessageBus {
 public:
  Result<std::unique_ptr<BusSubscription>> Subscribe(std::string subject, std::string group, Handler handler) override {
    auto entry = std::make_shared<Entry>(std::move(subject), std::move(group), std::move(handler));
    KvMutexLock g(state_->mu);
    state_->subs.push_back(entry);
    return std::unique_ptr<BusSubscription>(new Sub(state_, std::move(entry)));
  }

  Status Publish(std::string_view subject, std::span<const std::byte> data) override {
    return Deliver(subject, data, "", {});
  }

  Status PublishRequest(std::string_view subject, std::string_view reply, std::span<const std::byte> data) override {
    return Deliver(subject, data, reply, {});
  }

  // Like NATS's max_payload: larger publishes fail (default 1 MiB).
  std::size_t MaxPayload() const override { return max_payload_.load(); }
  void set_max_payload(std::size_t bytes) { max_payload_.store(bytes); }
  Status Flush(std::chrono::milliseconds) override { return Status::Ok(); }  // delivery is synchronous

  // Publishes messages one after another the way a NATS subscription delivers a backlog: every
  // message but the last arrives with more_pending set.
  Status PublishBurst(std::string_view subject, std::span<const std::vector<std::byte>> messages) {
    for (std::size_t i = 0; i < messages.size(); ++i) {
      if (Status s = Deliver(subject, messages[i], "", {}, i + 1 < messages.size()); !s.ok()) return s;
    }
    return Status::Ok();
  }

  // Publishes with headers.
  Status PublishWithHeaders(std::string_view subject, std::span<const std::byte> data,
                            std::map<std::string, std::string> headers) {
    return Deliver(subject, data, "", std::move(headers));
  }

  // Publishes with a reply subject and returns what was published to it (nullopt: no reply).
  std::optional<std::vector<std::byte>> Request(std::string_view subject, std::span<const std::byte> data) {
    const std::string inbox = NewInbox();
    auto reply = std::make_shared<std::optional<std::vector<std::byte>>>();
    auto sub = Subscribe(inbox, "", [reply](const BusMessage& m) { reply->emplace(m.data.begin(), m.data.end()); });
    (void)Deliver(subject, data, inbox, {});
    sub->reset();  // waits out a reply being written by another thread
    return std::move(*reply);
  }

  // A request whose reply may come later (a queued route): the reply lands in `reply` whenever
  // it is published, as long as the returned object lives. Read `reply` from the publishing
  // thread, or after the subscription is gone.
  struct PendingRequest {
    std::unique_ptr<BusSubscription> sub;
    std::shared_ptr<std::optional<std::vector<std::byte>>> reply;
  };
  PendingRequest RequestAsync(std::string_view subject, std::span<const std::byte> data) {
    const std::string inbox = NewInbox();
    PendingRequest p{nullptr, std::make_shared<std::optional<std::vector<std::byte>>>()};
    auto slot = p.reply;
    p.sub = std::move(Subscribe(inbox, "", [slot](const BusMessage& m) {
              slot->emplace(m.data.begin(), m.data.end());
            })).value();
    (void)Deliver(subject, data, inbox, {});
    return p;
  }

  std::size_t published(std::string_view subject) const {
    KvMutexLock g(state_->mu);
    auto it = state_->counts.find(std::string(subject));
    return it == state_->counts.end() ? 0 : it->second;
  }

  static bool Matches(std::string_view pattern, std::string_view subject) {
    while (true) {
      const auto pd = pattern.find('.');
      const auto sd = subject.find('.');
      const std::string_view pt = pattern.substr(0, pd);
      const std::string_view st = subject.substr(0, sd);
      if (pt == ">") return !subject.empty();
      if (pt != "*" && pt != st) return false;
      if (pd == std::string_view::npos || sd == std::string_view::npos) {
        return pd == std::string_view::npos && sd == std::string_view::npos;
      }
      pattern.remove_prefix(pd + 1);
      subject.remove_prefix(sd + 1);
    }
  }

 private:
  struct State;
  struct Entry {
    Entry(std::string s, std::string g, Handler h)
        : subject(std::move(s)), group(std::move(g)), handler(std::move(h)) {}
    const std::string subject, group;
    const Handler handler;
    bool live = true;  // guarded by State::mu
    int running = 0;   // guarded by State::mu: threads inside handler now
  };
  // Shared with the subscriptions, so that each can unlink itself under the bus's lock.
  struct State {
    KvMutex mu;
    std::condition_variable_any idle;  // a handler returned
    std::vector<std::shared_ptr<Entry>> subs KV_GUARDED_BY(mu);
    std::map<std::string, std::size_t> counts KV_GUARDED_BY(mu);
    std::size_t rr KV_GUARDED_BY(mu) = 0;
  };
  // The entries whose handlers this thread is running (nested delivery), innermost last.
  static inline thread_local std::vector<const Entry*> running_here_;

  class Sub : public BusSubscription {
   public:
    Sub(std::shared_ptr<State> state, std::shared_ptr<Entry> e) : state_(std::move(state)), e_(std::move(e)) {}
    ~Sub() override {
      // Runs on this thread's own stack at most `mine` times: wait only for other threads.
      const int mine = static_cast<int>(std::count(running_here_.begin(), running_here_.end(), e_.get()));
      std::unique_lock<KvMutex> lk(state_->mu);
      e_->live = false;
      std::erase(state_->subs, e_);
      state_->idle.wait(lk, [&] { return e_->running <= mine; });
    }

   private:
    std::shared_ptr<State> state_;
    std::shared_ptr<Entry> e_;
  };

  static std::optional<std::string> HeaderOf(const void* ctx, std::string_view key) {
    const auto* h = static_cast<const std::map<std::string, std::string>*>(ctx);
    auto it = h->find(std::string(key));
    return it == h->end() ? std::nullopt : std::optional<std::string>(it->second);
  }

  std::string NewInbox() { return "_INBOX." + std::to_string(++inbox_seq_); }

  Status Deliver(std::string_view subject, std::span<const std::byte> data, std::string_view reply,
                 std::map<std::string, std::string> headers, bool more_pending = false) {
    if (data.size() > max_payload_.load()) {
      return Internal(fmt::format("payload {} greater than maximum allowed: {}", data.size(), max_payload_.load()));
    }
    std::vector<std::shared_ptr<Entry>> targets;
    {
      KvMutexLock g(state_->mu);
      ++state_->counts[std::string(subject)];
      std::map<std::string, std::vector<std::shared_ptr<Entry>>> groups;
      for (const auto& e : state_->subs) {
        if (!Matches(e->subject, subject)) continue;
        if (e->group.empty()) {
          targets.push_back(e);
        } else {
          groups[e->group].push_back(e);
        }
      }
      for (auto& [name, members] : groups) targets.push_back(members[state_->rr++ % members.size()]);
    }
    if (targets.empty() && !reply.empty()) {
      const std::map<std::string, std::string> no_responders = {{"Status", "503"}};
      BusMessage nr{reply, {}, "", &InMemoryBus::HeaderOf, &no_responders};
      return DeliverTo(reply, nr);
    }
    BusMessage m{subject, data, reply, &InMemoryBus::HeaderOf, &headers};
    m.more_pending = more_pending;
    return RunHandlers(targets, m);
  }

  // Delivers `m` to the subscriptions matching `subject` (no queue-group choice: replies).
  Status DeliverTo(std::string_view subject, const BusMessage& m) {
    std::vector<std::shared_ptr<Entry>> targets;
    {
      KvMutexLock g(state_->mu);
      for (const auto& e : state_->subs) {
        if (Matches(e->subject, subject)) targets.push_back(e);
      }
    }
    return RunHandlers(targets, m);
  }

  Status RunHandlers(const std::vector<std::shared_ptr<Entry>>& targets, const BusMessage& m) {
    for (auto& t : targets) {
      {
        KvMutexLock g(state_->mu);
        if (!t->live) continue;  // unsubscribed since the list was taken
        ++t->running;
      }
      running_here_.push_back(t.get());
      t->handler(m);
      running_here_.pop_back();
      KvMutexLock g(state_->mu);
      --t->running;
      state_->idle.notify_all();
    }
    return Status::Ok();
  }

  const std::shared_ptr<State> state_ = std::make_shared<State>();
  std::atomic<std::size_t> inbox_seq_{0};
  std::atomic<std::size_t> max_payload_{std::size_t{1} << 20};
};

}  // namespace kvrouter
