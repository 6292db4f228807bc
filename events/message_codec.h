// Every message codec of the router's own endpoints and publications, for code that handles
// several sections (the service, the programs, the tests). An umbrella only: each section is in
// its own header, and code that needs one section includes that header alone.
//   registration_codec.h      section 4 (and 11's keys): worker registration
//   router_endpoints_codec.h  section 5: route / best_worker / generate, lifecycle, stats, errors
//   replica_sync_codec.h      section 8: replica sync, heartbeats, kv_metrics
//   overlap_scores_codec.h    section 12: router.overlap_scores
//   peer_dump_codec.h         section 12: router.dump
// Subjects: events/subjects.h. Worker endpoints (sections 6, 7): events/worker_codec.h.
#pragma once

#include "events/overlap_scores_codec.h"
#include "events/peer_dump_codec.h"
#include "events/registration_codec.h"
#include "events/replica_sync_codec.h"
#include "events/router_endpoints_codec.h"
