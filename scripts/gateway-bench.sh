#!/usr/bin/env bash
# The gateway's goals (docs/performance.md), each against a baseline in the same run:
#   requests/s, short non-streamed chat requests, 32 connections (wrk): kvgateway against nginx
#     as a plain round-robin reverse proxy (keep-alive upstreams) in front of the same engines,
#     alternating, two runs each;
#   own CPU per request, non-streamed chat requests whose user message is 100 to 2,000 characters,
#     32 connections (wrk): utime + stime (/proc/PID/stat) of the kvgateway process and of nginx
#     (master and workers) before and after each run over wrk's request count, alternating, two
#     runs each (CPU_ROUNDS);
#   added latency at p50, streaming cost per chunk, memory per idle connection (gateway_bench:
#     against the engine the gateway chose, alternating request by request).
#   the cost of a disaggregated request (docs/protocol.md section 13), on a fleet of its own: a
#     kvrouter with --router-disagg-policy always, a kvmocker process of 2 prefill workers and one
#     of 2 decode workers (nixl), a kvgateway; gateway_bench sends each request through the gateway
#     and runs the two legs itself against the same engines (direct), alternating.
# The engines are kvmocker's HTTP faces (--speedup-ratio 1000: the engine's own time is small next
# to the proxies'). Everything runs on 127.0.0.1 ports chosen free here and is stopped at the end
# (also on Ctrl-C).
#   scripts/gateway-bench.sh [build-dir]     results in $BENCH_OUT (default bench-results/gateway)
#   GATEWAY_BENCH_FLEETS=pd scripts/gateway-bench.sh     one fleet only (default "aggregated pd")
#   PD_REQUESTS (400), PD_STREAMS (200), PD_PROMPT_BYTES (512): the P/D run's size and prompt length
#   CPU_ROUNDS (2), CPU_SECS (8): the CPU runs' count per proxy and length
#   BASELINE_KVGATEWAY=path: a second kvgateway (the build before a change) on the same fleet,
#     taking its turn in the CPU runs (kvgateway, baseline, nginx)
#   GATEWAY_BENCH_LOOPS (1): the event loops of each proxy, nginx's worker_processes and
#     kvgateway's --io-threads alike (the baseline's too): each proxy does the same work with the
#     same number of threads
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
out=${BENCH_OUT:-bench-results/gateway}
fleets=${GATEWAY_BENCH_FLEETS:-aggregated pd}
loops=${GATEWAY_BENCH_LOOPS:-1}
mkdir -p "$out"
for t in nginx wrk nats-server; do command -v "$t" >/dev/null || { echo "gateway-bench: $t is not installed (scripts/setup.sh)"; exit 1; }; done
for b in kvrouter kvgateway kvmocker gateway_bench; do [ -x "$build/bin/$b" ] || { echo "gateway-bench: $build/bin/$b not built"; exit 1; }; done

work=$(mktemp -d /tmp/kvgateway-bench.XXXXXX)
pids=()
stop_started() {  # the processes this script started, and only them
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  pids=()
}
cleanup() {
  stop_started
  rm -rf "$work"
}
trap cleanup EXIT INT TERM
source scripts/ports.sh  # free_port, free_ports
await() {  # url: until it answers 200 (10 s at most)
  for _ in $(seq 100); do [ "$(curl -s -o /dev/null -w '%{http_code}' "$1")" = 200 ] && return 0; sleep 0.1; done
  echo "gateway-bench: $1 did not answer"; exit 1
}

if [[ " $fleets " == *" aggregated "* ]]; then  # (its body is not indented: it holds heredocs)
nats_port=$(free_port); gw_port=$(free_port); gw_metrics=$(free_port); nginx_port=$(free_port)
engine_base=$(free_ports 4)  # the engines take base .. base+3
nats="nats://127.0.0.1:$nats_port"
nats-server -a 127.0.0.1 -p "$nats_port" >"$work/nats.log" 2>&1 & pids+=($!)
for _ in $(seq 100); do (echo >"/dev/tcp/127.0.0.1/$nats_port") 2>/dev/null && break; sleep 0.1; done
"$build/bin/kvrouter" --nats-server "$nats" --router-mode kv --metrics-port 0 >"$work/kvrouter.log" 2>&1 & pids+=($!)
"$build/bin/kvmocker" --nats-server "$nats" --num-workers 4 --worker-id-base 1 --speedup-ratio 1000 --metrics-port 0 \
  --http-port "$engine_base" --http-host 127.0.0.1 --model mock >"$work/kvmocker.log" 2>&1 & pids+=($!)
"$build/bin/kvgateway" --nats-server "$nats" --http-port "$gw_port" --http-host 127.0.0.1 --io-threads "$loops" \
  --metrics-host 127.0.0.1 --metrics-port "$gw_metrics" >"$work/kvgateway.log" 2>&1 & gw_pid=$!; pids+=($gw_pid)
if [ -n "${BASELINE_KVGATEWAY:-}" ]; then
  base_port=$(free_port)
  "$BASELINE_KVGATEWAY" --nats-server "$nats" --http-port "$base_port" --http-host 127.0.0.1 --io-threads "$loops" \
    --metrics-host 127.0.0.1 --metrics-port 0 >"$work/kvgateway-baseline.log" 2>&1 & base_pid=$!; pids+=($base_pid)
fi
engines=()
upstreams=""
for i in 0 1 2 3; do
  engines+=("http://127.0.0.1:$((engine_base + i))")
  upstreams+="    server 127.0.0.1:$((engine_base + i));"$'\n'
done
mkdir -p "$work/nginx/logs"
cat >"$work/nginx/nginx.conf" <<CONF
worker_processes $loops;
pid $work/nginx/nginx.pid;
error_log $work/nginx/logs/error.log;
events { worker_connections 4096; }
http {
  access_log off;
  upstream engines {
$upstreams    keepalive 64;
  }
  server {
    listen 127.0.0.1:$nginx_port;
    location / {
      proxy_pass http://engines;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }
  }
}
CONF
nginx -p "$work/nginx" -c "$work/nginx/nginx.conf" -g 'daemon off;' 2>"$work/nginx/stderr" & nginx_pid=$!; pids+=($nginx_pid)
for i in 0 1 2 3; do await "http://127.0.0.1:$((engine_base + i))/health"; done
await "http://127.0.0.1:$gw_port/ready"
[ -n "${BASELINE_KVGATEWAY:-}" ] && await "http://127.0.0.1:$base_port/ready"
await "http://127.0.0.1:$nginx_port/health"

# wrk: a short chat request, a different prompt each time (so routing has something to decide).
cat >"$work/chat.lua" <<'LUA'
local n = 0
request = function()
  n = n + 1
  local body = '{"model":"mock","max_tokens":1,"messages":[{"role":"user","content":"request ' .. n .. ' of the benchmark: hello"}]}'
  return wrk.format("POST", "/v1/chat/completions", {["Content-Type"] = "application/json"}, body)
end
LUA
rate() {  # url -> requests/s (wrk, 32 connections, 2 threads, 8 s)
  wrk -t2 -c32 -d8s --latency -s "$work/chat.lua" "$1" >"$work/wrk.txt" 2>&1
  grep -q "Non-2xx" "$work/wrk.txt" && { cat "$work/wrk.txt"; echo "gateway-bench: errors under load"; exit 1; }
  awk '/^Requests\/sec:/ {print $2}' "$work/wrk.txt"
}
echo "== each proxy runs $loops event loop(s): nginx worker_processes $loops, kvgateway --io-threads $loops"
echo "== requests/s at 32 connections (wrk), alternating"
gw_rates=(); nginx_rates=()
for round in 1 2; do
  g=$(rate "http://127.0.0.1:$gw_port"); n=$(rate "http://127.0.0.1:$nginx_port")
  gw_rates+=("$g"); nginx_rates+=("$n")
  awk -v r="$round" -v g="$g" -v n="$n" 'BEGIN { printf "round %d: kvgateway %s req/s, nginx %s req/s, ratio %.2f\n", r, g, n, g / n }'
done

# wrk: non-streamed chat requests whose user message is 100 to 2,000 characters, built once per
# thread (16 bodies of spread lengths, each with its own text) and taken in turn.
cat >"$work/chat-mixed.lua" <<'LUA'
local requests = {}
local n = 0
init = function(args)
  local words = {"route", "cache", "block", "engine", "prefix", "token", "stream", "worker"}
  for k = 0, 15 do
    local length = 100 + math.floor(k * 1900 / 15)
    local parts = {"message " .. k .. ":"}
    local size = #parts[1]
    local i = k
    while size < length do
      i = i + 1
      local w = " " .. words[(i * 7 + k) % #words + 1] .. i
      parts[#parts + 1] = w
      size = size + #w
    end
    local content = string.sub(table.concat(parts), 1, length)
    local body = '{"model":"mock","max_tokens":1,"messages":[{"role":"user","content":"' .. content .. '"}]}'
    requests[#requests + 1] = wrk.format("POST", "/v1/chat/completions", {["Content-Type"] = "application/json"}, body)
  end
end
request = function()
  n = n + 1
  return requests[(n - 1) % #requests + 1]
end
LUA
clk_tck=$(getconf CLK_TCK)
cpu_ticks() {  # pid...: utime + stime (fields 14 and 15 of /proc/PID/stat, after the ')' of comm)
  local total=0 p f
  for p in "$@"; do
    f=$(cat "/proc/$p/stat"); f=${f##*) }  # fields from 3 on
    read -r -a a <<<"$f"
    total=$((total + a[11] + a[12]))
  done
  echo "$total"
}
nginx_pids() { echo "$nginx_pid" $(ps -o pid= --ppid "$nginx_pid"); }  # master and workers
cpu_per_request() {  # url pid...: the pids' own CPU in microseconds per request over one wrk run
  local url=$1; shift
  local before after requests
  before=$(cpu_ticks "$@")
  wrk -t2 -c32 -d"${CPU_SECS:-8}"s -s "$work/chat-mixed.lua" "$url" >"$work/wrk-cpu.txt" 2>&1
  after=$(cpu_ticks "$@")
  grep -q "Non-2xx\|Socket errors" "$work/wrk-cpu.txt" && { cat "$work/wrk-cpu.txt"; echo "gateway-bench: errors under load"; exit 1; }
  requests=$(awk '/requests in/ {print $1}' "$work/wrk-cpu.txt")
  awk -v t=$((after - before)) -v hz="$clk_tck" -v n="$requests" 'BEGIN { printf "%.1f\n", t / hz * 1e6 / n }'
}
echo "== own CPU per request, chats of 100 to 2,000 characters, 32 connections (wrk), alternating"
gw_cpu=(); nginx_cpu=()
for round in $(seq "${CPU_ROUNDS:-2}"); do
  g=$(cpu_per_request "http://127.0.0.1:$gw_port" "$gw_pid")
  if [ -n "${BASELINE_KVGATEWAY:-}" ]; then
    b=$(cpu_per_request "http://127.0.0.1:$base_port" "$base_pid")
    echo "round $round: baseline kvgateway $b us/request"
  fi
  n=$(cpu_per_request "http://127.0.0.1:$nginx_port" $(nginx_pids))
  gw_cpu+=("$g"); nginx_cpu+=("$n")
  awk -v r="$round" -v g="$g" -v n="$n" 'BEGIN { printf "round %d: kvgateway %s us/request, nginx %s us/request, ratio %.2f\n", r, g, n, g / n }'
done

echo "== added latency, streaming cost, idle connections (gateway_bench)"
"$build/bin/gateway_bench" --gateway "http://127.0.0.1:$gw_port" --gateway-metrics "http://127.0.0.1:$gw_metrics" \
  --gateway-pid "$gw_pid" --model mock \
  --engines "${engines[@]}" --worker-id-base 1 \
  --json "$out/gateway_bench.json" >/dev/null
python3 - "$out/gateway_bench.json" "${gw_rates[*]}" "${nginx_rates[*]}" "${gw_cpu[*]}" "${nginx_cpu[*]}" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
gw = [float(x) for x in sys.argv[2].split()]; ng = [float(x) for x in sys.argv[3].split()]
ratios = [g / n for g, n in zip(gw, ng)]
print(f"requests/s vs nginx       goal >= 0.5x   measured {min(ratios):.2f}-{max(ratios):.2f}x  "
      f"(kvgateway {min(gw):.0f}-{max(gw):.0f}, nginx {min(ng):.0f}-{max(ng):.0f} req/s)")
gc = [float(x) for x in sys.argv[4].split()]; nc = [float(x) for x in sys.argv[5].split()]
cpu_ratios = [g / n for g, n in zip(gc, nc)]
print(f"own CPU per request       goal <= 4x     measured {min(cpu_ratios):.2f}-{max(cpu_ratios):.2f}x  "
      f"(kvgateway {min(gc):.0f}-{max(gc):.0f}, nginx {min(nc):.0f}-{max(nc):.0f} us/request)")
l = r["latency"]
print(f"added latency at p50      goal <= 1 ms   measured {l['added_p50_ms']:.3f} ms  "
      f"(gateway p50 {l['gateway_p50_ms']:.3f} ms, direct {l['direct_p50_ms']:.3f} ms)")
s = r["streaming"]
print(f"streaming cost per chunk  goal <= 100 us measured {s['overhead_per_chunk_us']:.1f} us  "
      f"({s['chunks']} chunks; mean gap {s['gateway_gap_mean_ms']:.3f} ms vs {s['direct_gap_mean_ms']:.3f} ms)")
if "idle" in r:
    i = r["idle"]
    print(f"memory per idle connection goal <= 16 KB measured {i['bytes_per_connection'] / 1024:.1f} KB  "
          f"({i['connections']} connections, RSS {i['rss_before_kb']} -> {i['rss_after_kb']} KB)")
json.dump({"gateway_req_s": gw, "nginx_req_s": ng, "gateway_cpu_us_per_request": gc,
           "nginx_cpu_us_per_request": nc, **r}, open(sys.argv[1], "w"), indent=2)
PY
fi

if [[ " $fleets " == *" pd "* ]]; then
  stop_started
  echo "== a disaggregated request's cost (gateway_bench, 2 prefill + 2 decode workers, nixl)"
  nats_port=$(free_port); gw_port=$(free_port); gw_metrics=$(free_port)
  prefill_base=$(free_ports 4); decode_base=$((prefill_base + 2))  # 2 ports each
  nats="nats://127.0.0.1:$nats_port"
  nats-server -a 127.0.0.1 -p "$nats_port" >"$work/pd-nats.log" 2>&1 & pids+=($!)
  for _ in $(seq 100); do (echo >"/dev/tcp/127.0.0.1/$nats_port") 2>/dev/null && break; sleep 0.1; done
  "$build/bin/kvrouter" --nats-server "$nats" --router-mode kv --router-disagg-policy always --metrics-port 0 \
    >"$work/pd-kvrouter.log" 2>&1 & pids+=($!)
  # The lease outlasts any pull here (600 s over the speedup); the pull's end unpins.
  for role in prefill decode; do
    if [ "$role" = prefill ]; then port=$prefill_base; id=1; else port=$decode_base; id=11; fi
    "$build/bin/kvmocker" --nats-server "$nats" --num-workers 2 --worker-id-base "$id" --speedup-ratio 1000 \
      --metrics-port 0 --http-port "$port" --http-host 127.0.0.1 --model mock --role "$role" --kv-connector nixl \
      --kv-lease-ms 600000 >"$work/pd-kvmocker-$role.log" 2>&1 & pids+=($!)
  done
  "$build/bin/kvgateway" --nats-server "$nats" --http-port "$gw_port" --http-host 127.0.0.1 \
    --metrics-host 127.0.0.1 --metrics-port "$gw_metrics" >"$work/pd-kvgateway.log" 2>&1 & pids+=($!)
  prefill_engines=("http://127.0.0.1:$prefill_base" "http://127.0.0.1:$((prefill_base + 1))")
  decode_engines=("http://127.0.0.1:$decode_base" "http://127.0.0.1:$((decode_base + 1))")
  for e in "${prefill_engines[@]}" "${decode_engines[@]}"; do await "$e/health"; done
  await "http://127.0.0.1:$gw_port/ready"
  for _ in $(seq 100); do  # the gateway knows all four engines
    curl -s "http://127.0.0.1:$gw_metrics/metrics" | grep -q '^kvgateway_engines 4$' && break; sleep 0.1
  done
  "$build/bin/gateway_bench" --gateway "http://127.0.0.1:$gw_port" --model mock --idle-connections 0 \
    --engines "${decode_engines[@]}" --worker-id-base 11 \
    --prefill-engines "${prefill_engines[@]}" --prefill-worker-id-base 1 \
    --requests "${PD_REQUESTS:-400}" --streams "${PD_STREAMS:-200}" --stream-tokens 8 --prompt-bytes "${PD_PROMPT_BYTES:-512}" --max-tokens 4 \
    --json "$out/gateway_bench_pd.json" >/dev/null
  curl -s "http://127.0.0.1:$gw_metrics/metrics" >"$out/kvgateway_pd_metrics.txt"
  python3 - "$out/gateway_bench_pd.json" "$out/kvgateway_pd_metrics.txt" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
metrics = {}
for line in open(sys.argv[2]):
    if line.startswith("kvgateway_") and " " in line:
        name, value = line.rsplit(" ", 1)
        metrics[name] = float(value)
def mean_ms(h):
    n = metrics.get(h + "_count", 0)
    return 1000 * metrics.get(h + "_sum", 0) / n if n else float("nan")
for key, what in (("pd_latency", "P/D added latency at p50 "), ("pd_first_byte", "P/D added first byte p50 ")):
    l = r[key]
    print(f"{what} goal <= 1 ms   measured {l['added_p50_ms']:.3f} ms  (gateway p50 {l['gateway_p50_ms']:.3f} ms, "
          f"direct {l['direct_p50_ms']:.3f} ms, direct prefill leg {l['direct_prefill_leg_p50_ms']:.3f} ms; p99 "
          f"{l['gateway_p99_ms']:.3f} / {l['direct_p99_ms']:.3f} ms; {l['pairs']} pairs, "
          f"{l['not_disaggregated']} not disaggregated)")
print(f"kvgateway means: route (render + route) {mean_ms('kvgateway_route_seconds'):.3f} ms, "
      f"prefill leg {mean_ms('kvgateway_prefill_leg_seconds'):.3f} ms, "
      f"prefill answer to decode first byte {mean_ms('kvgateway_decode_wait_seconds'):.3f} ms")
r["kvgateway_means_ms"] = {h: mean_ms("kvgateway_" + h + "_seconds") for h in ("route", "prefill_leg", "decode_wait")}
json.dump(r, open(sys.argv[1], "w"), indent=2)
PY
fi
echo "raw results: $out"
