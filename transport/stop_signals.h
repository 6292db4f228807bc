// StopSignals: SIGINT and SIGTERM taken synchronously by the thread that calls Wait(), so a
// service can drain in order instead of doing work in a signal handler. Construct it in main
// before starting any thread: the blocked mask is inherited by every thread started later.
// SIGPIPE is ignored (a closed socket is an error return, not a death).
//
//   StopSignals stop;  ...start threads...;  int sig = stop.Wait();  ...drain...
#pragma once

#include <csignal>

#include <pthread.h>

namespace kvrouter {

class StopSignals {
 public:
  StopSignals() {
    sigemptyset(&set_);
    sigaddset(&set_, SIGINT);
    sigaddset(&set_, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set_, nullptr);
    std::signal(SIGPIPE, SIG_IGN);
  }
  // Blocks until SIGINT or SIGTERM arrives; returns its number.
  int Wait() {
    int sig = 0;
    sigwait(&set_, &sig);
    return sig;
  }

 private:
  sigset_t set_;
};

}  // namespace kvrouter
