#!/usr/bin/env bash
# The include rules of docs/design.md "Layout", checked on the sources: each library includes only
# what lies below it, and no program includes another program's folder. Prints every breach and
# exits 1 if there is one. Run by ctest (Layout.IncludesFollowTheLayers).
set -euo pipefail
cd "$(dirname "$0")/.."

breaches=0
forbid() {  # folder, regex of included paths it must not name, reason
  local hits
  hits=$(grep -rnE "#include \"($2)" "$1" --include='*.h' --include='*.cc' || true)
  if [ -n "$hits" ]; then
    echo "$1 must not include $2 ($3):"
    echo "$hits"
    breaches=1
  fi
}
forbid events/base 'events/[a-z_]+\.h|transport/|router/' "kv_base is the bottom of the graph"
forbid events 'transport/|router/' "the wire has no sockets and no router"
forbid transport 'router/|events/[a-z_]+\.h' "transport needs only kv_base"
forbid router/common 'router/(engine|index|scheduling|service|kv[a-z]+)/' "common sits under every router library"
forbid router/engine 'router/(common|index|scheduling|service|kv[a-z]+)/' "the engine model stands alone"
forbid router/index 'router/(common|engine|scheduling|service|kv[a-z]+)/' "the index knows nothing of scheduling"
forbid router/scheduling 'router/(engine|service|kv[a-z]+)/' "scheduling sits under the service; the router's prior is its own, not the simulated engine"
forbid router/service 'router/kv[a-z]+/' "libraries do not reach into programs"
# Every program's folder (router/kv*), found rather than listed, so a new program is checked too.
programs=()
for d in router/kv*/; do programs+=("$(basename "$d")"); done
for p in "${programs[@]}"; do
  others=$(printf '%s|' "${programs[@]}" | sed "s/\b$p|//; s/|$//")
  forbid "router/$p" "router/($others)/" "one program never includes another's folder"
done
# One clock type: events/base/clock.h's SteadyTime.
clocks=$(grep -rn "steady_clock::time_point" events router transport --include='*.h' --include='*.cc' |
         grep -v '^events/base/clock.h:' || true)
if [ -n "$clocks" ]; then echo "use SteadyTime (events/base/clock.h):"; echo "$clocks"; breaches=1; fi
[ "$breaches" -eq 0 ] && echo "layout: every include follows the layers"
exit "$breaches"
