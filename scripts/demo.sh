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
#   DEMO_FLEET=pd scripts/demo.sh       disaggregated prefill and decode through kvgateway: 2
#                                       prefill and 2 decode kvmocker workers (vLLM's nixl legs),
#                                       the trace replayed by HTTP clients (kvbench --gateway) with
#                                       the default policy, `always`, and an aggregated fleet of 4;
#                                       TTFT, ITL, goodput and the decisions
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

bash scripts/setup.sh
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S . -B build "${gen[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j "$(nproc 2>/dev/null || echo 2)" --target kvrouter kvmocker kvbench kvgateway >/dev/null
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

source scripts/ports.sh  # free_port, free_ports
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
  pd) workers=4 ;;
  *) echo "demo: DEMO_FLEET is uniform, mixed or pd, not '$fleet'" >&2; exit 2 ;;
esac

rows=()
shares=()
failed() {  # label: the run's logs before cleanup removes them
  echo "demo: the $1 run failed; its logs:" >&2
  for f in "$work"/*"$1"*.log; do echo "== $f" >&2; tail -n 15 "$f" >&2; done
  exit 1
}
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
    --json "$work/$label.json" >"$work/$label.txt" 2>"$work/kvbench-$label.log" || failed "$label"
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

itl_rows=()
# One P/D (or aggregated) run through kvgateway: label, prefill workers (0: an aggregated fleet of
# 4), router flags... The engines run at --speedup-ratio 2 while the trace comes 4x faster: the
# prefill pool is busy, where the choice of policy shows.
run_gateway() {
  local label=$1 prefill=$2; shift 2
  "$nats_server" -a 127.0.0.1 -p "$port" >"$work/nats.log" 2>&1 &
  pids+=($!)
  wait_port "$port"
  "$bin/kvrouter" --nats-server "$url" --metrics-port "$(free_port)" --router-mode kv "$@" \
    >"$work/kvrouter-$label.log" 2>&1 &
  pids+=($!)
  local engine=(--nats-server "$url" --metrics-port 0 --num-gpu-blocks 16384 --speedup-ratio 2 --model mock
                --http-host 127.0.0.1)
  if [ "$prefill" -gt 0 ]; then
    "$bin/kvmocker" "${engine[@]}" --num-workers 2 --worker-id-base 1 --role prefill --http-port "$(free_ports 2)" \
      >"$work/kvmocker-prefill-$label.log" 2>&1 &
    pids+=($!)
    "$bin/kvmocker" "${engine[@]}" --num-workers 2 --worker-id-base 11 --role decode --http-port "$(free_ports 2)" \
      >"$work/kvmocker-decode-$label.log" 2>&1 &
    pids+=($!)
  else
    "$bin/kvmocker" "${engine[@]}" --num-workers 4 --worker-id-base 1 --http-port "$(free_ports 4)" \
      >"$work/kvmocker-$label.log" 2>&1 &
    pids+=($!)
  fi
  local gateway_port
  gateway_port=$(free_port)
  "$bin/kvgateway" --nats-server "$url" --http-host 127.0.0.1 --http-port "$gateway_port" --metrics-port 0 \
    >"$work/kvgateway-$label.log" 2>&1 &
  pids+=($!)
  echo "demo: $label ..."
  "$bin/kvbench" --nats-server "$url" --gateway "http://127.0.0.1:$gateway_port" --wait-workers "$workers" \
    --prefill-workers "$prefill" --label "$label" --concurrency 256 "${workload[@]}" --json "$work/$label.json" \
    >"$work/$label.txt" 2>"$work/kvbench-$label.log" || failed "$label"
  rows+=("$(sed -n 2p "$work/$label.txt")")
  itl_rows+=("$(sed -n 5p "$work/$label.txt")")
  stop_all
}

if [ "$fleet" = pd ]; then
  run_gateway pd-predicted 2
  run_gateway pd-always 2 --router-disagg-policy always
  run_gateway aggregated 0
  echo
  head -n 1 "$work/pd-predicted.txt"
  printf '%s\n' "${rows[@]}"
  echo
  sed -n 4p "$work/pd-predicted.txt"
  printf '%s\n' "${itl_rows[@]}"
  echo
  echo "Through kvgateway over HTTP; TTFT and ITL at the client. pd-* = 2 prefill + 2 decode workers (pd-predicted:"
  echo "the default --router-disagg-policy; pd-always: every request through the prefill pool, Dynamo's default);"
  echo "aggregated = 4 workers doing both. goodput = requests with TTFT <= 1 s and TPOT <= 50 ms;"
  echo "disagg/local/fallback = the router's decisions."
  [ -n "${DEMO_JSON_DIR:-}" ] && mkdir -p "$DEMO_JSON_DIR" && cp "$work"/*.json "$DEMO_JSON_DIR"/ \
    && echo "JSON per run: $DEMO_JSON_DIR"
  exit 0
fi
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
