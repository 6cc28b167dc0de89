#!/usr/bin/env bash
# Builds kerf and runs the whole test suite (C++ through CTest, then Python).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${KERF_BUILD_DIR:-$root/build}
"$root/tools/build.sh" "$@"
cd "$build"
ctest --output-on-failure -j "${KERF_JOBS:-$(nproc)}"
