#!/usr/bin/env bash
# The one-command demo: installs what is missing, builds, starts nats-server, kvrouter and 4
# mock workers on free local ports, replays a workload through router.generate in kv mode (the
# default cost, then Dynamo's formula), round-robin and approximate mode, prints the
# comparison, and stops everything it started
# (also on Ctrl-C). The workload is a slice of the shared Mooncake trace when
# ../shared/traces/conversation_trace.jsonl (or $KVROUTER_TRACE) exists, else the synthetic
# multi-turn conversation workload.
#
#   scripts/demo.sh                 about 3 minutes on a 2-core machine
#   DEMO_REQUESTS=600 scripts/demo.sh
#   DEMO_JSON_DIR=out scripts/demo.sh   also keeps each mode's kvbench JSON
#   DEMO_FLEET=mixed scripts/demo.sh    two kvmocker processes, 4 workers 4x slower than the other
#                                       4 (unannounced: the router learns it); least-loaded too,
#                                       the fast half's share of requests and the learned rates
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

bash scripts/setup.sh
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S . -B build "${gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j "$(nproc 2>/dev/null || echo 2)" --target kvrouter kvmocker kvbench >/dev/null
bin=$root/build/bin

work=$(mktemp -d)
pids=()
stop_all() {
  for pid in "${pids[@]:-}"; do
    [ -n "$pid" ] && kill "$pid" 2>/dev/null || true
  done
  for pid in "${pids[@]:-}"; do
    [ -n "$pid" ] && wait "$pid" 2>/dev/null || true
  done
  pids=()
}
cleanup() { stop_all; rm -rf "$work"; }
trap cleanup EXIT
trap 'echo; echo "demo: interrupted"; exit 130' INT TERM

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_port() {  # port: until it accepts connections (10 s)
  for _ in $(seq 1 200); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.05
  done
  echo "demo: nothing listens on port $1" >&2
  return 1
}

nats_server=$(command -v nats-server || echo /usr/sbin/nats-server)
port=$(free_port)
url="nats://127.0.0.1:$port"

trace=${KVROUTER_TRACE:-$root/../shared/traces/conversation_trace.jsonl}
requests=${DEMO_REQUESTS:-400}
if [ -f "$trace" ]; then
  workload=(--trace "$trace" --max-requests "$requests" --speedup 4)
  echo "demo: replaying the first $requests requests of $trace"
else
  workload=(--synthetic --sessions $((requests / 4)) --turns 4 --rate 25)
  echo "demo: no trace at $trace; replaying $requests synthetic multi-turn conversation requests"
fi

fleet=${DEMO_FLEET:-uniform}
case "$fleet" in
  uniform) workers=4 ;;
  mixed) workers=8 ;;
  *) echo "demo: DEMO_FLEET is uniform or mixed, not '$fleet'" >&2; exit 2 ;;
esac

rows=()
shares=()
run() {  # label, router flags...
  local label=$1; shift
  "$nats_server" -a 127.0.0.1 -p "$port" >"$work/nats.log" 2>&1 &
  pids+=($!)
  wait_port "$port"
  local metrics_port
  metrics_port=$(free_port)
  "$bin/kvrouter" --nats-server "$url" --metrics-port "$metrics_port" "$@" >"$work/kvrouter-$label.log" 2>&1 &
  pids+=($!)
  if [ "$fleet" = mixed ]; then
    # Workers 1-4 at speed 4, workers 101-104 at speed 1: one process each, as two machine types.
    # With the trace replayed 4x faster they carry the load of the offline mixed fleet
    # (--worker-speedups 1,1,1,1,0.25,0.25,0.25,0.25 at the trace's own pace), in a quarter of
    # its time.
    "$bin/kvmocker" --nats-server "$url" --metrics-port 0 --num-workers 4 --worker-id-base 1 --num-gpu-blocks 16384 \
      --speedup-ratio 4 >"$work/kvmocker-fast-$label.log" 2>&1 &
    pids+=($!)
    "$bin/kvmocker" --nats-server "$url" --metrics-port 0 --num-workers 4 --worker-id-base 101 --num-gpu-blocks 16384 \
      --speedup-ratio 1 >"$work/kvmocker-slow-$label.log" 2>&1 &
    pids+=($!)
  else
    "$bin/kvmocker" --nats-server "$url" --metrics-port 0 --num-workers 4 --num-gpu-blocks 16384 --speedup-ratio 10 \
      >"$work/kvmocker-$label.log" 2>&1 &
    pids+=($!)
  fi
  echo "demo: $label ..."
  "$bin/kvbench" --nats-server "$url" --wait-workers "$workers" --label "$label" --concurrency 64 "${workload[@]}" \
    --json "$work/$label.json" >"$work/$label.txt" 2>"$work/kvbench-$label.log"
  rows+=("$(sed -n 2p "$work/$label.txt")")  # the run's row of the first table
  if [ "$fleet" = mixed ]; then
    # Workers come in id order: the first four are the fast ones.
    shares+=("$(python3 -c 'import json, sys
w = json.load(open(sys.argv[1]))["worker_requests"]
print(f"{sys.argv[2]:<16} fast half served {100 * sum(w[:4]) / max(1, sum(w)):.1f} % of the requests")' \
      "$work/$label.json" "$label")")
    [ "$label" = kv ] && curl -s "http://127.0.0.1:$metrics_port/metrics" \
      | grep -E '^kvrouter_worker_(prefill_tokens_per_second|decode_step_seconds)' >"$work/rates.txt" || true
  fi
  stop_all  # a fresh NATS, router and cold workers for the next mode
}

run kv --router-mode kv
run kv-dynamo-cost --router-mode kv --router-prefill-load-scale 1
run round-robin --router-mode round-robin
if [ "$fleet" = mixed ]; then
  run least-loaded --router-mode least-loaded
else
  run kv-approx --router-mode kv --no-router-kv-events
fi

echo
head -n 1 "$work/kv.txt"
printf '%s\n' "${rows[@]}"
echo
echo "kv = the default cost (predicted time); kv-dynamo-cost = Dynamo's formula (--router-prefill-load-scale 1)."
echo "kv_hit = cached prompt tokens / prompt tokens; max/share = busiest worker's requests / a fair share;"
echo "busy_max/mean = busiest worker's engine busy time / the mean (kvbench --offline only: '-' online)."
if [ "$fleet" = mixed ]; then
  echo
  printf '%s\n' "${shares[@]}"
  echo "learned by the kv router (workers 1-4 run 4x faster than 101-104; the prior says 65789 tokens/s):"
  sed 's/^/  /' "$work/rates.txt"
fi
[ -n "${DEMO_JSON_DIR:-}" ] && mkdir -p "$DEMO_JSON_DIR" && cp "$work"/*.json "$DEMO_JSON_DIR"/ \
  && echo "JSON per mode: $DEMO_JSON_DIR"
exit 0
