#!/usr/bin/env bash
# The official OpenAI client (its Node SDK, `openai` from npm) against kvgateway: starts
# nats-server, kvrouter (default policy), kvmocker processes with HTTP faces (two aggregated
# workers serving `mock`; for `mock-pd` one of role prefill and two of role decode, nixl legs) and
# kvgateway on free 127.0.0.1 ports, runs tests/openai_client/check.mjs (models, chat and
# completions plain and streamed, cached_tokens rising, 404 and 400 as the SDK's error classes, a
# client abort freeing its booking) and tests/openai_client/check_pd.mjs (the same through both
# legs: the worker headers, the prefill engine's cached_tokens, the gateway's P/D counts, an abort
# freeing both bookings and the prefill engine's pins), and stops the processes it started.
# The SDK is installed once into KVROUTER_NPM_CACHE (default ~/.cache/kvrouter/openai-node).
#
#   scripts/openai-client-check.sh build/bin
# Exit status: 0 passed (or skipped, loudly, without node and npm or the npm registry), 1 failed.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=$(cd "${1:-build/bin}" && pwd)

say() { printf 'openai-client-check: %s\n' "$*"; }
skip() {
  say "SKIPPED: $* -- the official OpenAI client was NOT run against kvgateway"
  exit 0
}
for c in node npm nats-server curl /usr/bin/python3; do command -v "$c" >/dev/null || skip "$c is not installed"; done
node -e 'process.exit(Number(process.versions.node.split(".")[0]) >= 18 ? 0 : 1)' ||
  skip "node $(node --version) is older than 18 (the SDK needs fetch)"

# One exact version, so that every machine checks the same client.
version=4.104.0
sdk=${KVROUTER_NPM_CACHE:-$HOME/.cache/kvrouter/openai-node}
sdk=$(mkdir -p "$sdk" && cd "$sdk" && pwd)
installed=$(node -e 'try { console.log(require(process.argv[1]).version) } catch { }' \
  "$sdk/node_modules/openai/package.json")
if [ "$installed" != "$version" ]; then
  mkdir -p "$sdk"
  [ -f "$sdk/package.json" ] || printf '{"name":"kvrouter-openai-check","private":true}\n' >"$sdk/package.json"
  timeout 20 npm view "openai@$version" version >/dev/null 2>&1 || skip "the npm registry does not answer"
  timeout 300 npm install --prefix "$sdk" --no-audit --no-fund --loglevel=error "openai@$version" >/dev/null 2>&1 ||
    skip "npm could not install openai@$version"
fi

work=$(mktemp -d /tmp/kvrouter-openai.XXXXXX)
pids=()
stop() {  # SIGTERM, then SIGKILL to what is still there after 10 s
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for _ in $(seq 100); do
    alive=0
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ "$alive" -eq 0 ] && break
    sleep 0.1
  done
  for p in "${pids[@]}"; do
    if kill -0 "$p" 2>/dev/null; then kill -KILL "$p" 2>/dev/null || true; fi
    wait "$p" 2>/dev/null || true
  done
  rm -rf "$work"
}
trap stop EXIT

# Ports free now, all different (held open until all are chosen): NATS, the router's and the
# gateway's metrics, the gateway's API, the three kvmocker processes' metrics, the prefill
# worker's HTTP port, and the first HTTP port of the aggregated and of the decode workers (the
# port after each is free too, for their second worker).
read -r nats_port router_port gw_metrics gw_port mock_metrics prefill_metrics decode_metrics prefill_port \
  mock_port decode_port < <(/usr/bin/python3 - <<'PY'
import socket
held, ports = [], []
def take(port=0):
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        s.close()
        return None
    held.append(s)
    return s.getsockname()[1]
for _ in range(8):
    ports.append(take())
for _ in range(2):
    while True:
        base = take()
        if base < 65535 and take(base + 1):
            ports.append(base)
            break
print(*ports)
PY
) || { say "FAILED: could not pick free ports"; exit 1; }
nats=nats://127.0.0.1:$nats_port

nats-server -a 127.0.0.1 -p "$nats_port" >"$work/nats.log" 2>&1 & pids+=($!)
for _ in $(seq 100); do (exec 3<>"/dev/tcp/127.0.0.1/$nats_port") 2>/dev/null && break; sleep 0.1; done
"$bin/kvrouter" --nats-server "$nats" --metrics-host 127.0.0.1 --metrics-port "$router_port" \
  --router-mode kv >"$work/kvrouter.log" 2>&1 & pids+=($!)
"$bin/kvmocker" --nats-server "$nats" --num-workers 2 --speedup-ratio 10 --model mock \
  --http-host 127.0.0.1 --http-port "$mock_port" --metrics-host 127.0.0.1 --metrics-port "$mock_metrics" \
  >"$work/kvmocker.log" 2>&1 & pids+=($!)
# The P/D fleet. Fixed worker ids, so check_pd.mjs knows which engine is which. The router keeps
# its default policy (`predicted`), which may prefill a short prompt on an idle decode engine (it
# saves the KV transfer); so the decode engines announce a prefill budget of 16 tokens per step
# (as a decode pool tuned for decoding may), a local prefill of any prompt the check sends takes
# several steps there, and every request takes both legs (protocol.md section 13).
# The prefill engine's short KV lease (0.3 s at this speedup) ends the pins of a leg whose pull
# notice never comes within the check's wait.
prefill_base=1001 decode_base=2001
"$bin/kvmocker" --nats-server "$nats" --num-workers 1 --worker-id-base "$prefill_base" --speedup-ratio 10 \
  --model mock-pd --role prefill --kv-lease-ms 3000 --http-host 127.0.0.1 --http-port "$prefill_port" \
  --metrics-host 127.0.0.1 --metrics-port "$prefill_metrics" >"$work/kvmocker-prefill.log" 2>&1 & pids+=($!)
"$bin/kvmocker" --nats-server "$nats" --num-workers 2 --worker-id-base "$decode_base" --speedup-ratio 10 \
  --model mock-pd --role decode --max-num-batched-tokens 16 --http-host 127.0.0.1 --http-port "$decode_port" \
  --metrics-host 127.0.0.1 --metrics-port "$decode_metrics" >"$work/kvmocker-decode.log" 2>&1 & pids+=($!)
"$bin/kvgateway" --nats-server "$nats" --http-host 127.0.0.1 --http-port "$gw_port" \
  --metrics-host 127.0.0.1 --metrics-port "$gw_metrics" >"$work/kvgateway.log" 2>&1 & pids+=($!)

# Ready: the gateway knows the five engines and the router has registered them.
ready=0
for _ in $(seq 300); do
  gw_metrics_text=$(curl -s "127.0.0.1:$gw_metrics/metrics" || true)
  router_metrics_text=$(curl -s "127.0.0.1:$router_port/metrics" || true)
  if curl -sf "127.0.0.1:$gw_port/ready" >/dev/null &&
     grep -q '^kvgateway_engines 5$' <<<"$gw_metrics_text" &&
     grep -q '^kvgateway_router_up 1$' <<<"$gw_metrics_text" &&
     grep -q '^kvrouter_worker_ranks 5$' <<<"$router_metrics_text"; then
    ready=1; break
  fi
  sleep 0.1
done
if [ "$ready" -ne 1 ]; then
  tail -n 20 "$work"/*.log; echo; say "FAILED: the system did not become ready"; exit 1
fi

# Node finds a module's packages beside it, not on NODE_PATH: run a copy beside the SDK's.
cp tests/openai_client/*.mjs "$work/"
ln -s "$sdk/node_modules" "$work/node_modules"
rc=0
node "$work/check.mjs" "http://127.0.0.1:$gw_port/v1" "http://127.0.0.1:$router_port/metrics" \
  "http://127.0.0.1:$gw_metrics/metrics" || rc=$?
node "$work/check_pd.mjs" "http://127.0.0.1:$gw_port/v1" "http://127.0.0.1:$router_port/metrics" \
  "http://127.0.0.1:$prefill_port/v1" "http://127.0.0.1:$prefill_metrics/metrics" "$prefill_base" "$decode_base,$((decode_base + 1))" \
  "http://127.0.0.1:$gw_metrics/metrics" ||
  rc=$?
if [ "$rc" -ne 0 ]; then tail -n 20 "$work"/*.log; echo; say "FAILED"; exit 1; fi
say "passed"
