#!/usr/bin/env bash
# Builds kerf and runs its demo: a DSL kernel compiled on its first call and
# checked against a float64 reference (on the GPU when there is one).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${KERF_BUILD_DIR:-$root/build}
log=$(mktemp)
if ! KERF_TARGETS=kerf_demo "$root/tools/build.sh" >"$log" 2>&1; then
  cat "$log"; rm -f "$log"; echo "kerf demo: the build failed" >&2; exit 1
fi
rm -f "$log"
exec "$build/examples/kerf_demo" "$@"
