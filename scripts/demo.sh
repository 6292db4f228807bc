#!/usr/bin/env bash
# The one-command demo. The full demo (mock workers replaying the Mooncake trace in kv,
# round-robin and approximate mode) comes with kvmocker and kvbench (issue 6). Until then it
# installs, builds and shows kvrouter at work: the index (apply rate, find_matches latency,
# memory), route round trips through a real nats-server and kvrouter it starts on a free
# local port (and stops), and the queue policies compared under 2x overload.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S . -B build "${gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j "$(nproc 2>/dev/null || echo 2)" --target index_bench route_bench queue_bench kvrouter
echo "== the index: apply rate, find_matches latency (64 / 1,000 workers), memory per block"
build/bin/index_bench --benchmark_filter='ApplyChains16|FindMatches200/(64|1000)/0|MemoryPerPair/64'
echo "== route round trip through nats-server + kvrouter (idle, and with 100k events/s)"
build/bin/route_bench
echo "== TTFT per priority class under 2x overload: no queue vs fcfs / wspt / lcfs (seconds)"
build/bin/queue_bench
