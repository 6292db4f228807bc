#!/usr/bin/env bash
# Routing quality of every router mode, offline (kvbench --offline: the real router and simulated
# engines on virtual time, deterministic for a seed): the shared Mooncake trace and the synthetic
# workload shapes, each as docs/performance.md's table and as a plot (SVG, gnuplot), plus the trace's TTFT
# over several seeds (a p99 of 12,031 requests moves by tens of ms with the tie-break seed).
# About 8 minutes on a 2-core machine.
#
#   scripts/quality.sh                    results in bench-results/quality/
#   QUALITY_OUT=dir QUALITY_SEEDS=3 scripts/quality.sh
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S . -B build "${gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j "$(nproc 2>/dev/null || echo 2)" --target kvbench >/dev/null

out=${QUALITY_OUT:-bench-results/quality}
seeds=${QUALITY_SEEDS:-5}
trace=${KVROUTER_TRACE:-../shared/traces/conversation_trace.jsonl}
mkdir -p "$out"
echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown); results: $out"

compare() {  # name, kvbench workload flags...
  local name=$1; shift
  echo
  echo "== $name"
  build/bin/kvbench --offline --compare "$@" --json "$out/$name.json" --plot "$out/$name.svg" 2>/dev/null
}

if [ -f "$trace" ]; then
  compare trace --trace "$trace"
  # The mixed fleet of docs/performance.md: workers 5-8 4x slower, unannounced.
  compare mixed-trace --trace "$trace" --workers 8 --worker-speedups 1,1,1,1,0.25,0.25,0.25,0.25
else
  echo "no trace at $trace: skipping it" >&2
fi
for w in chat system-prompts agentic bursts fanout; do compare "$w" --workload "$w"; done

[ -f "$trace" ] || exit 0
echo
echo "== trace, TTFT by seed (seeds 1..$seeds)"
for s in $(seq 1 "$seeds"); do
  build/bin/kvbench --offline --trace "$trace" --router-mode kv --seed "$s" --label default \
    --json "$out/seed-$s-default.json" >/dev/null 2>&1 &
  build/bin/kvbench --offline --trace "$trace" --router-mode kv --router-prefill-load-scale 1 --seed "$s" \
    --json "$out/seed-$s-dynamo.json" >/dev/null 2>&1
  wait
done
python3 - "$out" "$seeds" <<'PY'
import json, sys
out, seeds = sys.argv[1], int(sys.argv[2])
for run in ("default", "dynamo"):
    rows = [json.load(open(f"{out}/seed-{s}-{run}.json")) for s in range(1, seeds + 1)]
    p50 = [r["ttft_ms"]["p50"] for r in rows]
    p99 = [r["ttft_ms"]["p99"] for r in rows]
    hit = [100 * r["kv_hit_rate"] for r in rows]
    print(f"{run:8} hit {sum(hit)/seeds:5.1f}%  ttft p50 {sum(p50)/seeds:6.1f} ms  "
          f"p99 mean {sum(p99)/seeds:7.1f} ms (each: {', '.join(f'{v:.0f}' for v in p99)})")
PY
