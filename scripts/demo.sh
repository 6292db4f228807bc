#!/usr/bin/env bash
# The one-command demo. The full demo (nats-server, kvrouter, mock workers and a replay of the
# Mooncake trace in kv, round-robin and approximate mode) is coming with the mock workers and
# kvbench (issue 6). Until then it installs, builds and shows the index at work: apply
# throughput, find_matches latency at 64 and 1,000 workers, and memory per indexed block.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S . -B build "${gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j "$(nproc 2>/dev/null || echo 2)" --target index_bench
echo "kvrouter demo: the full router demo is coming (issue 6); index benchmarks meanwhile:"
build/bin/index_bench --benchmark_filter='ApplyChains16|FindMatches200/(64|1000)/0|MemoryPerPair/64'
