#!/usr/bin/env bash
# Runs every benchmark of docs/performance.md, each beside its baseline from the same
# run, and keeps the raw results (JSON) in one folder. About 1.5 minutes on a 2-core machine;
# run it on an otherwise idle machine.
#
#   scripts/bench.sh                  results in bench-results/<date>/
#   BENCH_OUT=dir scripts/bench.sh    results in dir
#   BENCH_FILTER=Ingest scripts/bench.sh   only the Google Benchmark cases matching a regex
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S . -B build "${gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVROUTER_BENCH=ON >/dev/null
cmake --build build -j "$(nproc 2>/dev/null || echo 2)" \
  --target index_bench route_bench queue_bench recovery_bench indexer_bench warmup_bench gateway_bench kvrouter kvgateway kvmocker \
  >/dev/null

out=${BENCH_OUT:-bench-results/$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$out"
filter=${BENCH_FILTER:-.}
trace=../shared/traces/conversation_trace.jsonl

echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'), $(uname -r)"
echo "commit:  $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
echo "results: $out"

gbench() {  # program
  echo
  echo "== $1"
  "build/bin/$1" --benchmark_filter="$filter" --benchmark_out="$out/$1.json" --benchmark_out_format=json \
    2>/dev/null | grep -E '^(BM_|-|Benchmark)'
}

# Route round trip against a bare nats.c echo; event ingest against a bare counting subscriber.
gbench route_bench
# find_matches percentiles while 1 M blocks/s are ingested; bytes per (block, worker); the
# machine's own stalls (BM_MachineStalls), which set a floor under every p99 on a busy VM.
gbench index_bench
gbench queue_bench
gbench recovery_bench

if [ -f "$trace" ] && [ "$filter" = . ]; then
  echo
  echo "== indexer_bench (Dynamo's mooncake_bench: 1,000 workers x 7, the conversation trace)"
  # find_matches as runs of holder slots (the index's answer): the sweep, and rates past 1.5x
  # Dynamo's published peak (255,316 ops/s); then a score per worker, as the route path reads,
  # and runs named in a second read.
  build/bin/indexer_bench --trace "$trace" --offered 400000 --offered 480000 \
    --sweep --sweep-min 25000 --sweep-max 560000 --sweep-steps 7 --json "$out/indexer_bench.json"
  build/bin/indexer_bench --trace "$trace" --find-matches scores --offered 260000 --offered 300000 \
    --json "$out/indexer_bench_scores.json"
  build/bin/indexer_bench --trace "$trace" --find-matches translated --offered 200000 \
    --json "$out/indexer_bench_translated.json"
fi
if [ "$filter" = . ]; then
  echo
  echo "== a new replica from a peer's dump against every worker's (1,000 workers x 10,000 blocks)"
  build/bin/warmup_bench --workers 1000 --blocks 10000 --json "$out/warmup_bench.json"
fi
if [ "$filter" = . ]; then
  echo
  echo "== kvgateway against nginx and against the engines (scripts/gateway-bench.sh)"
  BENCH_OUT="$out/gateway" bash scripts/gateway-bench.sh build
fi
echo
echo "raw results: $out"
