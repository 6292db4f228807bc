// NatsSecurity: how a program logs in to NATS (creds, user/password, token, nkey) and whether it
// speaks TLS. A plain value; the flags that fill it are in router/common/flags.h, and NatsClient
// applies it (transport/nats_client.h). Kept apart so flag parsing needs no NATS header.
#pragma once

#include <string>

namespace kvrouter {

struct NatsSecurity {
  std::string creds_file;         // --nats-creds: a JWT + nkey seed .creds file
  std::string user, password;     // --nats-user / --nats-password
  std::string token;              // --nats-token
  std::string nkey_seed_file;     // --nats-nkey-seed: a file with the seed (S...) and its public key (U...)
  std::string tls_ca;             // --nats-tls-ca: CA bundle to verify the server (turns TLS on)
  std::string tls_cert, tls_key;  // --nats-tls-cert / --nats-tls-key: client certificate (mutual TLS)
  bool tls() const { return !tls_ca.empty() || !tls_cert.empty(); }
};

}  // namespace kvrouter
