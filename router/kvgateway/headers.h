// Which headers kvgateway passes between a client and an engine (RFC 9110 section 7.6.1): every
// end-to-end header both ways, none of the hop-by-hop ones, none that the gateway sets itself.
// Pure functions over lower-case names (as HttpListener and HttpClient hand them over); any
// thread.
//
//   HttpHeaders to = {{"content-type", "application/json"}};  ForwardRequestHeaders(request.headers, to);
#pragma once

#include <string_view>

#include "transport/http_listener.h"

namespace kvrouter {

// Connection, Keep-Alive, Proxy-*, TE, Trailer, Transfer-Encoding, Upgrade, or a header that a
// Connection header of `headers` names.
bool IsHopByHop(std::string_view name, const HttpHeaders& headers);

// Appends to `to` the client's request headers an engine gets (traceparent, tracestate, baggage,
// Authorization, Accept, ...): all but the hop-by-hop ones, Host and Content-Length (the HTTP
// client sets them), Expect (the gateway answered it), Accept-Encoding (the gateway reads engine
// answers, so they come unencoded), and Content-Type and X-Request-Id (the gateway sets its own).
void ForwardRequestHeaders(const HttpHeaders& from, HttpHeaders& to);

// Appends to `to` the engine's response headers the client gets (Retry-After, Cache-Control,
// Content-Type, ...): all but the hop-by-hop ones, Content-Length (the gateway frames the
// response), Server (the gateway's), and X-Request-Id and X-Kvrouter-* (the gateway's own).
void ForwardResponseHeaders(const HttpHeaders& from, HttpHeaders& to);

}  // namespace kvrouter
