#!/usr/bin/env bash
# Proves docker-compose.yml on a machine that reaches only Debian's mirror: starts a Docker
# engine (Debian's docker.io) unless one already runs, makes the base images locally
# (`debian:12` by debootstrap from the mirror this machine's apt configuration names, `nats:2.9`
# from Debian's nats-server), builds kvrouter's image and the monitoring profile's Prometheus
# image (Debian's prometheus; its promtool checks deploy/prometheus: the configs, the rules and
# their unit tests), then
#   docker-compose --profile monitoring up -d   until the router serves and 4 mock workers are
#                                               registered,
#   a plain and a streamed chat completion through the gateway container (curl),
#   ... --profile bench run --rm kvbench       200 requests, 0 errors,
#   Prometheus (its HTTP API): every target of the stack up, the alert rules loaded, the
#                              router's worker ranks read, every query of
#                              deploy/grafana/kvrouter.json evaluated,
#   the same with DYN_ROUTER_USE_KV_EVENTS=false (approximate mode, checked on /metrics),
#   ... --profile pd up -d   until the prefill and decode engines are registered too, a plain and
#                            a streamed chat completion for `mock-pd` through the gateway that
#                            name their prefill and decode engines,
#   docker-compose down,
# and stops the engine it started, by its PID, putting back what the engine changed (its
# bridge, the firewall tables, ip_forward).
#
#   scripts/compose-check.sh                      kvrouter's image built from source (Dockerfile)
#   scripts/compose-check.sh --binaries build/bin the runtime stage plus binaries built here
#                                                 (what scripts/test.sh does: no second compile)
# Exit status: 0 proven (or skipped, loudly, when no engine can start here), 1 failed.
# Images stay in the engine's data root (KVROUTER_DOCKER_ROOT, default
# /var/lib/kvrouter-docker for an engine this script starts), so a second run takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

binaries=""
if [ "${1:-}" = "--binaries" ]; then binaries=$(cd "$2" && pwd); fi
programs=(kvrouter kvgateway kvmocker kvbench kvrelay)
project=kvrouter-check
max_image_mb=200

say() { printf 'compose-check: %s\n' "$*"; }
fail() { say "FAILED: $*"; exit 1; }
skip() {
  printf '\n%s\n' "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"
  say "SKIPPED: $* -- docker-compose.yml was NOT proven on this machine"
  printf '%s\n\n' "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!"
  exit 0
}

for c in docker docker-compose curl; do command -v "$c" >/dev/null || skip "$c is not installed"; done
started=0 ; work=$(mktemp -d /tmp/kvrouter-compose.XXXXXX)
compose_up=0

# --- what the engine changes, read before it starts ---------------------------------------
ip_forward_before=$(cat /proc/sys/net/ipv4/ip_forward 2>/dev/null || echo "")
links_before=$(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | sort)
save_tables() {
  command -v iptables-save >/dev/null && iptables-save >"$work/iptables.v4" 2>/dev/null || true
  command -v ip6tables-save >/dev/null && ip6tables-save >"$work/iptables.v6" 2>/dev/null || true
}

restore_tables() {  # iptables|ip6tables, saved file: the saved tables back, the others emptied
  local cmd=$1 saved=$2 t
  [ -e "$saved" ] || return 0
  for t in filter nat mangle raw; do
    grep -qx "\*$t" "$saved" && continue
    if "$cmd" -V 2>/dev/null | grep -q nf_tables && command -v nft >/dev/null; then
      nft delete table "$([ "$cmd" = iptables ] && echo ip || echo ip6)" "$t" 2>/dev/null
      continue
    fi
    "$cmd" -t "$t" -F 2>/dev/null; "$cmd" -t "$t" -X 2>/dev/null
    for c in $("$cmd" -t "$t" -S 2>/dev/null | awk '$1 == "-P" {print $2}'); do "$cmd" -t "$t" -P "$c" ACCEPT; done
  done
  [ -s "$saved" ] && "$cmd-restore" <"$saved"
}

cleanup() {
  local rc=$?
  set +e
  if [ "$compose_up" = 1 ]; then
    [ "$rc" -ne 0 ] && compose logs --no-color --tail 30 2>&1 | tail -80
    compose --profile bench --profile pd --profile monitoring down -v --remove-orphans >/dev/null 2>&1
  fi
  if [ "$started" = 1 ]; then
    local pid
    pid=$(cat "$work/dockerd.pid" 2>/dev/null || echo "$dockerd_pid")
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -0 "$pid" 2>/dev/null && { say "dockerd $pid did not stop: SIGKILL"; kill -KILL "$pid"; }
    # The bridges it made (docker0, compose's br-*), its firewall rules, ip_forward.
    for l in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | sort); do
      grep -qx "$l" <<<"$links_before" || ip link delete "$l" 2>/dev/null
    done
    restore_tables iptables "$work/iptables.v4"
    restore_tables ip6tables "$work/iptables.v6"
    [ -n "$ip_forward_before" ] && echo "$ip_forward_before" >/proc/sys/net/ipv4/ip_forward
    umount "$work/exec"/* 2>/dev/null
    say "dockerd $pid stopped; bridges, firewall tables and ip_forward put back"
  fi
  rm -rf "$work" 2>/dev/null
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

# --- the engine ----------------------------------------------------------------------------
if [ -z "${DOCKER_HOST:-}" ] && ! docker info >/dev/null 2>&1; then
  command -v dockerd >/dev/null || skip "no Docker engine runs and dockerd is not installed (apt-get install docker.io)"
  [ "$(id -u)" -eq 0 ] || skip "starting dockerd needs root"
  save_tables
  root=${KVROUTER_DOCKER_ROOT:-/var/lib/kvrouter-docker}
  mkdir -p "$root"
  dockerd --host "unix://$work/docker.sock" --pidfile "$work/dockerd.pid" --data-root "$root" \
    --exec-root "$work/exec" >"$work/dockerd.log" 2>&1 &
  dockerd_pid=$!
  started=1
  export DOCKER_HOST="unix://$work/docker.sock"
  for _ in $(seq 150); do
    docker info >/dev/null 2>&1 && break
    kill -0 "$dockerd_pid" 2>/dev/null || break
    sleep 0.2
  done
  if ! docker info >/dev/null 2>&1; then
    tail -15 "$work/dockerd.log"
    skip "dockerd could not start here (log above)"
  fi
  say "started dockerd (pid $dockerd_pid, data root $root)"
else
  say "using the running Docker engine"
fi
export COMPOSE_PROJECT_NAME=$project
compose() { docker-compose -f docker-compose.yml "$@"; }
# Debian's client, when installed beside another one earlier on the PATH.
docker() { if [ -x /usr/bin/docker ]; then /usr/bin/docker "$@"; else command docker "$@"; fi; }

# --- base images -----------------------------------------------------------------------------
# The Debian mirror apt uses here: the first URIs / deb line naming a Debian archive.
apt_mirror() {
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -e "$f" ] || continue
    awk '/^URIs:/ {for (i = 2; i <= NF; i++) if ($i !~ /security/) {print $i; exit}}' "$f"
  done
  if [ -e /etc/apt/sources.list ]; then
    awk '$1 == "deb" && $0 !~ /security/ {
      for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) {print $i; exit}}' /etc/apt/sources.list
  fi
}
if ! docker image inspect debian:12 >/dev/null 2>&1; then
  command -v debootstrap >/dev/null || fail "debootstrap is not installed (apt-get install debootstrap)"
  mirror=$(apt_mirror | head -n 1)
  [ -n "$mirror" ] || fail "no Debian mirror found in apt's sources"
  say "debootstrap --variant=minbase bookworm from $mirror"
  debootstrap --variant=minbase bookworm "$work/rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 \
    || { tail -20 "$work/debootstrap.log"; fail "debootstrap"; }
  # The image's apt reads the same mirror (and its updates and security suites, as here).
  rm -f "$work/rootfs/etc/apt/sources.list"
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -e "$f" ] && grep -q '^URIs:.*debian' "$f" && cp "$f" "$work/rootfs/etc/apt/sources.list.d/"
  done
  if [ -e /etc/apt/sources.list ]; then
    grep '^deb .*debian' /etc/apt/sources.list >"$work/rootfs/etc/apt/sources.list" || true
  fi
  ls "$work/rootfs/etc/apt/sources.list.d/"*.sources >/dev/null 2>&1 || [ -s "$work/rootfs/etc/apt/sources.list" ] \
    || echo "deb $mirror bookworm main" >"$work/rootfs/etc/apt/sources.list"
  # Like Debian's own images: apt keeps no package caches in image layers.
  cat >"$work/rootfs/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
  rm -rf "$work/rootfs/var/cache/apt/archives/"*.deb "$work/rootfs/var/cache/apt/"*.bin "$work/rootfs/var/lib/apt/lists/"*
  tar -C "$work/rootfs" -c . | docker import - debian:12 >/dev/null
  rm -rf "$work/rootfs"
fi
if ! docker image inspect nats:2.9 >/dev/null 2>&1; then
  say "building nats:2.9 from Debian's nats-server"
  docker build -q -t nats:2.9 - >/dev/null <<'EOF'
FROM debian:12
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nats-server \
    && rm -rf /var/lib/apt/lists/*
EXPOSE 4222 6222 8222
ENTRYPOINT ["nats-server"]
EOF
fi

# --- kvrouter's image ------------------------------------------------------------------------
if [ -n "$binaries" ]; then
  say "kvrouter:local = the Dockerfile's runtime stage + binaries from $binaries"
  docker build -q --target runtime -t kvrouter-runtime:local . >/dev/null
  mkdir -p "$work/ctx/bin"
  for p in "${programs[@]}"; do
    [ -x "$binaries/$p" ] || fail "$binaries/$p not built"
    strip -o "$work/ctx/bin/$p" "$binaries/$p"
  done
  printf 'FROM kvrouter-runtime:local\nCOPY bin/ /usr/local/bin/\n' >"$work/ctx/Dockerfile"
  docker build -q -t kvrouter:local "$work/ctx" >/dev/null
else
  say "kvrouter:local built from source (docker-compose build)"
  compose build -q kvrouter
fi
# The monitoring profile's Prometheus: Debian's package on debian:12 (cached after the first run).
docker build -q -t kvrouter-prometheus:local deploy/prometheus >/dev/null || fail "building deploy/prometheus/Dockerfile"
# Its promtool checks deploy/prometheus, all in one container.
t_promtool=$SECONDS
out=$(docker run --rm --entrypoint sh -v "$PWD/deploy/prometheus:/p:ro" kvrouter-prometheus:local -c \
  'promtool --version && promtool check config /p/prometheus.yml && promtool check config /p/compose.yml &&
   promtool test rules /p/kvrouter-rules.test.yml' 2>&1) || { echo "$out"; fail "promtool rejects deploy/prometheus"; }
say "kvrouter-prometheus:local is $(( $(docker image inspect -f '{{.Size}}' kvrouter-prometheus:local) / 1000000 )) MB;" \
  "its promtool (Debian's $(awk 'NR == 1 {print $3}' <<<"$out")): deploy/prometheus's configs valid, its alert rules pass their tests ($((SECONDS - t_promtool)) s)"
size_mb=$(( $(docker image inspect -f '{{.Size}}' kvrouter:local) / 1000000 ))
say "kvrouter:local is $size_mb MB"
[ "$size_mb" -lt "$max_image_mb" ] || fail "the runtime image is $size_mb MB (limit $max_image_mb MB)"

# --- up, bench, down -------------------------------------------------------------------------
source scripts/ports.sh  # free_port
KVROUTER_NATS_PORT=$(free_port); KVROUTER_METRICS_PORT=$(free_port); KVROUTER_HTTP_PORT=$(free_port)
KVROUTER_PROMETHEUS_PORT=$(free_port); KVGATEWAY_METRICS_PORT=$(free_port)
export KVROUTER_NATS_PORT KVROUTER_METRICS_PORT KVROUTER_HTTP_PORT KVROUTER_PROMETHEUS_PORT KVGATEWAY_METRICS_PORT
gateway_url="http://127.0.0.1:$KVROUTER_HTTP_PORT"
gateway_metrics_url="http://127.0.0.1:$KVGATEWAY_METRICS_PORT/metrics"
prometheus_url="http://127.0.0.1:$KVROUTER_PROMETHEUS_PORT"
metrics_url="http://127.0.0.1:$KVROUTER_METRICS_PORT/metrics"

metric() {  # name -> value ("" when the router does not answer)
  local page
  page=$(curl -fsS --max-time 2 "$metrics_url" 2>/dev/null) || return 0
  awk -v n="$1" '$1 == n {print $2; exit}' <<<"$page"
}
await_router() {  # approximate-mode value expected (0 or 1), worker ranks expected
  local ranks mode
  for _ in $(seq 300); do
    ranks=$(metric kvrouter_worker_ranks); mode=$(metric kvrouter_approximate_mode)
    [ "$ranks" = "$2" ] && [ "$mode" = "$1" ] && return 0
    sleep 0.2
  done
  fail "the router did not show $2 worker ranks with kvrouter_approximate_mode $1 (ranks '$ranks', mode '$mode')"
}
chat() {  # stream (true|false) [model content curl-options...]: a chat completion through the
          # gateway, the body on stdout
  local stream=$1 model=${2:-mock} content=${3:-Hello from compose-check}
  shift $(($# < 3 ? $# : 3))
  curl -fsS --max-time 20 "$@" "$gateway_url/v1/chat/completions" -H 'content-type: application/json' \
    -d "{\"model\": \"$model\", \"stream\": $stream, \"max_tokens\": 8,
         \"messages\": [{\"role\": \"user\", \"content\": \"$content\"}]}"
}
await_gateway() {  # engines: the gateway is ready, knows that many engines and the router answers it
  for _ in $(seq 300); do
    metrics=$(curl -fsS --max-time 2 "$gateway_metrics_url" || true)
    [ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 "$gateway_url/ready")" = 200 ] &&
      grep -qx "kvgateway_engines $1" <<<"$metrics" && grep -qx "kvgateway_router_up 1" <<<"$metrics" && return 0
    sleep 0.2
  done
  fail "the gateway did not become ready with $1 engines"
}
gateway_checks() {
  await_gateway 4
  local plain stream
  plain=$(chat false) || fail "a plain chat completion through the gateway failed"
  grep -q '"chat.completion"' <<<"$plain" && grep -q '"cached_tokens"' <<<"$plain" ||
    fail "the plain chat completion is not one: $plain"
  stream=$(chat true) || fail "a streamed chat completion through the gateway failed"
  [ "$(grep -c '^data: ' <<<"$stream")" -ge 3 ] && grep -q '^data: \[DONE\]' <<<"$stream" ||
    fail "the streamed chat completion is not a stream of events ending in [DONE]: $stream"
  say "gateway: a plain and a streamed chat completion on $gateway_url ($(grep -c '^data: ' <<<"$stream") events)"
}
# The pd profile's engines (docker-compose.yml): one prefill worker, two decode workers.
prefill_id=1000000000000000
decode_ids="2000000000000000 2000000000000001"
pd_checks() {
  await_gateway 7
  # Over the decode engines' prefill budget (256 tokens per step), so the router's default policy
  # sends it through the prefill engine; each request's own first block, so no decode engine
  # holds its prompt already.
  local filler kind answer prefill decode
  filler=$(printf 'Tell me about disaggregated prefill and decode. %.0s' $(seq 20))
  for kind in plain streamed; do
    answer=$(chat "$([ "$kind" = streamed ] && echo true || echo false)" mock-pd "$kind: $filler" -i) ||
      fail "a $kind mock-pd chat completion through the gateway failed"
    prefill=$(tr -d '\r' <<<"$answer" | awk -F': ' 'tolower($1) == "x-kvrouter-prefill-worker-id" {print $2}')
    decode=$(tr -d '\r' <<<"$answer" | awk -F': ' 'tolower($1) == "x-kvrouter-worker-id" {print $2}')
    [ "$prefill" = "$prefill_id" ] && [ -n "$decode" ] && [[ " $decode_ids " == *" $decode "* ]] ||
      fail "the $kind mock-pd answer names prefill worker '$prefill' (want $prefill_id) and decode worker '$decode' (want one of $decode_ids): $answer"
    if [ "$kind" = plain ]; then
      grep -q '"chat.completion"' <<<"$answer" || fail "the plain mock-pd chat completion is not one: $answer"
    else
      [ "$(grep -c '^data: ' <<<"$answer")" -ge 3 ] && grep -q '^data: \[DONE\]' <<<"$answer" ||
        fail "the streamed mock-pd chat completion is not a stream of events ending in [DONE]: $answer"
    fi
  done
  say "pd profile: a plain and a streamed mock-pd chat through prefill worker $prefill_id and a decode worker"
}
prometheus_api() {  # path, python expression over the answer's "data" as d: its value, "" on failure
  curl -fsS --max-time 2 "$prometheus_url/api/v1/$1" 2>/dev/null |
    python3 -c "import json, sys; d = json.load(sys.stdin)['data']; print($2)" 2>/dev/null || true
}
monitoring_checks() {  # Prometheus scrapes every service of deploy/prometheus/compose.yml
  local want="kvgateway=up kvmocker=up kvrouter=up" targets="" rules ranks t=$SECONDS
  for _ in $(seq 150); do
    targets=$(prometheus_api "targets?state=active" \
      "' '.join(sorted(t['labels']['job'] + '=' + t['health'] for t in d['activeTargets']))")
    [ "$targets" = "$want" ] && break
    sleep 0.2
  done
  [ "$targets" = "$want" ] || fail "Prometheus's targets are '$targets', not '$want'"
  rules=$(prometheus_api rules "sum(len(g['rules']) for g in d['groups'])")
  [ "$rules" = "$(grep -c -- '- alert:' deploy/prometheus/kvrouter-rules.yml)" ] ||
    fail "Prometheus loaded '$rules' alert rules, not those of deploy/prometheus/kvrouter-rules.yml"
  ranks=$(prometheus_api "query?query=max(kvrouter_worker_ranks)" "d['result'][0]['value'][1] if d['result'] else ''")
  [ "$ranks" = 4 ] || fail "Prometheus reads kvrouter_worker_ranks '$ranks', not 4"
  # Every query of the dashboard is PromQL that Prometheus evaluates (Grafana's interval
  # variables given a value).
  local queries
  queries=$(python3 - "$prometheus_url" deploy/grafana/kvrouter.json <<'EOF'
import json, sys, urllib.parse, urllib.request
url, path = sys.argv[1], sys.argv[2]
def targets(panels):
    for p in panels:
        for t in p.get("targets", []):
            yield p.get("title", ""), t["expr"]
        yield from targets(p.get("panels", []))
n = 0
for title, expr in targets(json.load(open(path))["panels"]):
    q = expr.replace("$__rate_interval", "30s").replace("$__interval", "30s")
    try:
        with urllib.request.urlopen(url + "/api/v1/query?" + urllib.parse.urlencode({"query": q}), timeout=5) as r:
            ok = json.load(r)["status"] == "success"
    except Exception as e:  # a query Prometheus rejects answers 400
        ok, q = False, f"{q} ({e})"
    if not ok:
        print(f"panel '{title}': Prometheus does not evaluate {q}")
        sys.exit(1)
    n += 1
print(n)
EOF
  ) || fail "a dashboard query: $queries"
  say "monitoring profile: Prometheus on $prometheus_url scrapes $targets, $rules alert rules loaded, 4 worker ranks read, the dashboard's $queries queries evaluated ($((SECONDS - t)) s)"
}
bench() {  # label
  local out="$work/bench-$1.txt"
  compose --profile bench run --rm kvbench >"$out" 2>"$work/bench-$1.err" \
    || { cat "$out" "$work/bench-$1.err"; fail "kvbench ($1) exited with an error"; }
  local requests errors
  read -r requests errors < <(awk 'NR == 2 {print $2, $3}' "$out")
  say "$1: $(sed -n 2p "$out")"
  [ "$requests" = 200 ] && [ "$errors" = 0 ] || { cat "$out"; fail "kvbench ($1): $requests requests, $errors errors"; }
}

t0=$SECONDS
compose_up=1
compose --profile monitoring up -d --no-build >/dev/null 2>&1 ||
  { compose --profile monitoring up -d --no-build; fail "docker-compose --profile monitoring up"; }
await_router 0 4
say "router serves with 4 workers registered ($((SECONDS - t0)) s after up)"
gateway_checks
bench kv-events
DYN_ROUTER_USE_KV_EVENTS=false compose up -d --no-build >/dev/null 2>&1 || fail "docker-compose up (approximate)"
await_router 1 4
bench approximate
# Prometheus hands its first targets to the scrapers seconds after it starts: asked here, after
# both benches, it has scraped them already.
monitoring_checks
t1=$SECONDS
compose --profile pd up -d --no-build >/dev/null 2>&1 || { compose --profile pd up -d --no-build; fail "docker-compose --profile pd up"; }
await_router 0 7
pd_checks
say "pd profile proven in $((SECONDS - t1)) s"
compose --profile bench --profile pd --profile monitoring down -v --remove-orphans >/dev/null 2>&1 ||
  fail "docker-compose down"
compose_up=0
say "docker-compose.yml proven: up, the gateway's plain and streamed chat, 2 x 200 requests with 0 errors (events and approximate mode), Prometheus scraping every service with the alert rules loaded, the pd profile's plain and streamed chat through both legs, down"
