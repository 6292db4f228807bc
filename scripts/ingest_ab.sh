#!/usr/bin/env bash
# Ingest A/B: BM_IngestVsBareSubscriber with two kvrouter binaries in alternating runs, each
# pair in the other order than the last (this 2-core VM drifts by ±10 % within minutes, so one
# build's runs are only compared with the other's from the same minutes). Prints, per run, the
# router's CPU per event, its rate against the bare nats.c subscriber, and the cores the phase
# kept busy.
#
#   scripts/ingest_ab.sh OLD_KVROUTER NEW_KVROUTER [PAIRS]     (PAIRS: 5)
#
# Build an old commit's binary with: git worktree add /tmp/old REV && cmake -S /tmp/old -B
# /tmp/old/build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo && cmake --build /tmp/old/build
# --target kvrouter. route_bench itself comes from this checkout's build/.
set -euo pipefail
cd "$(dirname "$0")/.."
[[ $# -ge 2 ]] || { sed -n 2,12p "$0"; exit 2; }
old=$1 new=$2 pairs=${3:-5}
for b in "$old" "$new"; do [[ -x $b ]] || { echo "not an executable: $b" >&2; exit 2; }; done
bench=build/bin/route_bench
[[ -x $bench ]] || { echo "build route_bench first (cmake --build build --target route_bench)" >&2; exit 2; }

field() { grep -o "$1=[0-9.k]*" <<<"$2" | cut -d= -f2; }
for ((p = 1; p <= pairs; p++)); do
  order=("$old" "$new")
  ((p % 2 == 0)) && order=("$new" "$old")  # neither build always runs first
  for b in "${order[@]}"; do
    line=$(ROUTE_BENCH_KVROUTER=$b "$bench" --benchmark_filter=IngestVsBare 2>&1 | grep '^BM_Ingest' || true)
    if [[ -z $line ]]; then
      echo "pair $p  $b: no result" >&2
      continue
    fi
    printf 'pair %d  %-40s cpu_per_event_ns=%-8s router_vs_bare=%-9s router_cores_busy=%s\n' "$p" "$b" \
      "$(field router_cpu_ns_per_msg "$line")" "$(field router_vs_bare "$line")" "$(field router_cores_busy "$line")"
  done
done
