#!/usr/bin/env bash
# Builds kvrouter and runs every test: unit and integration tests (the integration tests start
# their own nats-server on a free 127.0.0.1 port), then all of them again under ASan+UBSan
# (but the routing-quality replays), the concurrent parts (index shards, NATS transport,
# in-memory bus, the whole service racing over real NATS) under TSan, and a short libFuzzer run
# of every decoder (the clang build also checks the thread-safety annotations).
#
#   scripts/test.sh                 everything (what CI runs)
#   KVROUTER_QUICK=1 scripts/test.sh    plain build and tests only
#   FUZZ_SECONDS=30 scripts/test.sh     longer fuzzing (default 8 s per decoder)
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh

jobs=$(nproc 2>/dev/null || echo 2)
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)

step() { printf '\n== %s  [%d:%02d]\n' "$*" $((SECONDS / 60)) $((SECONDS % 60)); }
# Compiling dominates the suite's time (four builds on two cores), so the builds here trade a
# little run time for compile time: line tables only (-g1; sanitizer and crash traces keep
# file:line), about a fifth faster than full debug info; and -O1 instead of -O2 for the
# optimised builds (the plain one, TSan's, the fuzzers'), about a third faster (routing.cc:
# 16 s -> 11 s) while still optimised (TSan asks for -O1 or more). The demo, the benchmarks and
# a user's build stay at -O2 (CMake's RelWithDebInfo).
g1=(-DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" -DCMAKE_CXX_FLAGS_DEBUG="-g1")
# Every build here treats warnings as errors (a user's build does not: KVROUTER_WERROR is off).
g1+=(-DKVROUTER_WERROR=ON)

configure_build() {  # dir, targets..., -- cmake args...
  local dir=$1; shift
  local targets=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do targets+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  cmake -S . -B "$dir" "${gen[@]}" "$@" >/dev/null
  if [ ${#targets[@]} -gt 0 ]; then
    cmake --build "$dir" -j "$jobs" --target "${targets[@]}"
  else
    cmake --build "$dir" -j "$jobs"
  fi
}

step "build (RelWithDebInfo)"
configure_build build -- -DCMAKE_BUILD_TYPE=RelWithDebInfo "${g1[@]}"
step "tests: unit and integration"
ctest --test-dir build --output-on-failure -j "$jobs" --timeout 300

if [ "${KVROUTER_QUICK:-0}" = "1" ]; then
  if command -v docker-compose >/dev/null; then
    docker-compose -f docker-compose.yml config -q && echo "docker-compose.yml is valid (not run)"
  fi
  echo "KVROUTER_QUICK=1: docker-compose run, sanitizer builds and fuzzing skipped"
  exit 0
fi

step "the official OpenAI client against kvgateway (scripts/openai-client-check.sh)"
bash scripts/openai-client-check.sh build/bin

# docker-compose.yml run for real (images from Debian's mirror, these binaries in the runtime
# stage), in the background while the ASan build compiles: it mostly waits on the network.
compose_log=$(mktemp)
bash scripts/compose-check.sh --binaries build/bin >"$compose_log" 2>&1 &
compose_pid=$!
# If the script stops early, compose-check stops too (and puts the machine back).
trap 'kill -TERM "$compose_pid" 2>/dev/null || true; wait "$compose_pid" 2>/dev/null || true; rm -f "$compose_log"' EXIT

# The sanitizer builds use clang when it is there: it compiles this code base in half of g++'s
# time (Debug + ASan: 378 s of CPU against 780 s), and the plain build above already proves
# g++, the compiler a user builds with.
sanitizer_cc=()
command -v clang++ >/dev/null && sanitizer_cc=(-DCMAKE_CXX_COMPILER=clang++)

step "build under ASan+UBSan (docker-compose.yml is proven meanwhile)"
configure_build build-asan -- "${sanitizer_cc[@]}" \
  -DCMAKE_BUILD_TYPE=Debug -DKVROUTER_SANITIZE=address -DKVROUTER_BENCH=OFF "${g1[@]}"

step "docker-compose.yml, proven (scripts/compose-check.sh)"
compose_rc=0
wait "$compose_pid" || compose_rc=$?
trap - EXIT
if [ "$compose_rc" -ne 0 ]; then cat "$compose_log"; echo "compose-check failed"; exit 1; fi
cat "$compose_log"
rm -f "$compose_log"

# The routing-quality replays (label `quality`) run in the plain build only: under a Debug ASan
# build they take minutes, and kvbench_test runs the same replay code there. So do three tests of
# scale alone (a million-block dump, an hour of churn: 50 s under ASan; the P/D soak of 1,000
# requests: 2 minutes), whose code paths the smaller publisher, index and GatewayPdClientsTest
# tests take under ASan too.
step "every test under ASan+UBSan (the kvrouter binary too; not the quality replays)"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j "$jobs" --timeout 600 -LE quality \
  -E '^(KvEventPublisherIndex\.MillionBlockDumpTravelsInPartsUnderTheMaxPayload|SoakTest\.AnHourOfChurnKeepsTheIndexExactAndItsMemoryFlat|PdSoakTest\.AThousandRequestsWithAbortsAndAKilledPrefillProcessLoseNothing)$'

step "concurrent parts under TSan (built with clang: its thread-safety analysis checks every KV_GUARDED_BY)"
tsan_targets=(index_test service_test transport_test nats_loop_test transport_unit_test service_threads_test kvrelay_unit_test
              kvmocker_http_test gateway_test gateway_edges_test gateway_disagg_test gateway_pd_kvmocker_test router_link_test kvrouter
              kvgateway kvmocker kvbench)
tsan_args=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVROUTER_SANITIZE=thread -DKVROUTER_BENCH=OFF "${g1[@]}")
configure_build build-tsan "${tsan_targets[@]}" -- "${sanitizer_cc[@]}" "${tsan_args[@]}"
# Older TSan runtimes cannot map memory under high ASLR entropy; run without ASLR.
# The nine GatewayPdKvmocker* process tests run outside TSan: GatewayPdClientsTest and
# GatewayDisaggTest take the same legs' threads under it.
TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
  setarch "$(uname -m)" -R ctest --test-dir build-tsan --output-on-failure -j "$jobs" --timeout 600 \
  -R '^(ShardedIndex|ReadGate|ConcurrentReads|TransportTest|InMemoryBus|ServiceThreads|RecoveryTest|RecoveryClientTest|GenerateRelayTest|KvRelayTest|HttpHealthChecksTest|KvMockerHttpTest|HttpTest|Gateway[A-Za-z]*Test|RouterLink[A-Za-z]*Test|NatsLoopTest)\.' \
  -E '^GatewayPdKvmocker'

if command -v clang++ >/dev/null; then
  step "fuzzing the decoders (${FUZZ_SECONDS:-8} s each)"
  fuzzers=()
  for f in tests/fuzz/fuzz_*.cc; do fuzzers+=("$(basename "$f" .cc)"); done
  configure_build build-fuzz "${fuzzers[@]}" -- "${sanitizer_cc[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVROUTER_FUZZ=ON "${g1[@]}"
  seeds=$(mktemp -d)
  build-fuzz/bin/fuzz_seedgen "$seeds"
  # One fuzzer per core at a time (each is one process on one thread); each gets its full time.
  fuzz_one() {  # binary: runs it on its corpus, leaves NAME.log and NAME.rc
    local name rc=0
    name=$(basename "$1")
    mkdir -p "$seeds/$name"
    "$1" -max_total_time="${FUZZ_SECONDS:-8}" -dict=tests/fuzz/kvrouter.dict -print_final_stats=1 \
      "$seeds/$name" >"$seeds/$name.log" 2>&1 || rc=$?
    echo "$rc" >"$seeds/$name.rc"
  }
  running=()
  for f in build-fuzz/bin/fuzz_*; do
    [ "$(basename "$f")" = fuzz_seedgen ] && continue
    fuzz_one "$f" &
    running+=($!)
    if [ ${#running[@]} -ge "$jobs" ]; then
      wait "${running[0]}"
      running=("${running[@]:1}")
    fi
  done
  wait
  for f in build-fuzz/bin/fuzz_*; do
    name=$(basename "$f")
    [ "$name" = fuzz_seedgen ] && continue
    echo "-- $name"
    grep -E "^stat::number_of_executed_units" "$seeds/$name.log" || true
    if [ "$(cat "$seeds/$name.rc")" != 0 ]; then tail -40 "$seeds/$name.log"; echo "fuzzer $name failed"; exit 1; fi
  done
  rm -rf "$seeds"
else
  echo "clang++ not found: fuzzing skipped"
fi
echo
echo "all tests passed in $((SECONDS / 60)) min $((SECONDS % 60)) s"
