#!/usr/bin/env bash
# Installs what kvrouter needs to build, test and run, from Debian 12 packages only.
# Idempotent and quiet when everything is already there. Needs root (or sudo) to install.
set -euo pipefail

packages=(
  cmake g++ ninja-build pkg-config
  libnats-dev nats-server
  libmsgpack-cxx-dev libconcurrentqueue-dev libfmt-dev libboost-dev libboost-program-options-dev
  libgtest-dev libgmock-dev libbenchmark-dev libxxhash-dev nlohmann-json3-dev
  prometheus-cpp-dev libcivetweb-dev libzmq3-dev cppzmq-dev libsimdjson-dev libtcmalloc-minimal4
  gnuplot-nox
  clang libclang-rt-14-dev
  python3 libncurses-dev tmux
)
# Only scripts/compose-check.sh (docker-compose.yml run for real) needs docker and debootstrap;
# without them that one step is skipped, loudly. scripts/bench.sh's gateway baseline and load
# generator are nginx and wrk.
optional=(docker-compose docker.io debootstrap curl nginx-light wrk)
# Debian's `prometheus` (promtool, for DeployFiles.PromtoolAcceptsTheConfigsAndTheRulesFire) is
# not installed here: its package starts a Prometheus server on the machine. Without it that test
# skips, loudly; scripts/compose-check.sh runs the same promtool checks in its Prometheus image.

missing=()
for p in "${packages[@]}" "${optional[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "setup: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq >/dev/null
# Required packages must install; optional ones are tried one by one.
req=()
for p in "${missing[@]}"; do
  [[ " ${optional[*]} " == *" $p "* ]] || req+=("$p")
done
if [ ${#req[@]} -gt 0 ]; then
  $sudo apt-get install -y -qq --no-install-recommends "${req[@]}" >/dev/null
fi
for p in "${optional[@]}"; do
  [[ " ${missing[*]} " == *" $p "* ]] || continue
  $sudo apt-get install -y -qq --no-install-recommends "$p" >/dev/null 2>&1 \
    || echo "setup: optional package $p not installed" >&2
done
