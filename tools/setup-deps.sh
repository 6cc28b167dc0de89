#!/usr/bin/env bash
# Installs the Debian/Ubuntu packages kerf builds with, when they are missing.
# Needs root or sudo only when something is missing. Safe to run again.
set -euo pipefail

have_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }

# What the build needs (LLVM is optional: without it kerf builds without the CPU backend).
required=(cmake ninja-build g++ pkg-config libxxhash-dev catch2 python3-dev pybind11-dev nlohmann-json3-dev
          python3-numpy python3-pytest)
optional_llvm=()
if ! ls /usr/lib/llvm-*/lib/cmake/llvm/LLVMConfig.cmake >/dev/null 2>&1; then
  # Pick the newest llvm-N-dev the archive offers (Debian 12: 14..19 with backports, 14 by default).
  for v in 19 18 17 16 15 14; do
    if apt-cache show "llvm-$v-dev" >/dev/null 2>&1; then optional_llvm=("llvm-$v-dev"); break; fi
  done
fi

# For the test suite (KERF_TEST_DEPS=1, as tools/test.sh sets it): Debian's CPU build of
# PyTorch, so that the torch tests (autograd wrappers, gradcheck in float64 on the CPU
# back end) run here too; optional like LLVM (without it they skip, saying so).
optional_test=()
if [[ ${KERF_TEST_DEPS:-0} == 1 ]] && ! have_pkg python3-torch; then
  # A machine whose package lists were never fetched knows no python3-torch yet.
  if ! apt-cache show python3-torch >/dev/null 2>&1 && [[ $(id -u) == 0 ]]; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null 2>&1 || true
  fi
  if apt-cache show python3-torch >/dev/null 2>&1; then optional_test=(python3-torch); fi
fi

missing=()
for p in "${required[@]}" "${optional_llvm[@]}" "${optional_test[@]}"; do have_pkg "$p" || missing+=("$p"); done
if ((${#missing[@]} == 0)); then exit 0; fi

SUDO=""
if [[ $(id -u) != 0 ]]; then
  if command -v sudo >/dev/null; then SUDO="sudo"; else
    req_missing=()
    for p in "${required[@]}"; do have_pkg "$p" || req_missing+=("$p"); done
    if ((${#req_missing[@]} == 0)); then  # only optional ones: go on without them
      echo "kerf: not installing the optional ${missing[*]} (run as root, or install them)" >&2; exit 0
    fi
    echo "kerf: missing packages: ${missing[*]} (run as root, or install them)" >&2; exit 1
  fi
fi
echo "kerf: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq >/dev/null || true
if ! $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; then
  # Retry the required ones alone: an optional LLVM or PyTorch must not block the build.
  req_missing=()
  for p in "${required[@]}"; do have_pkg "$p" || req_missing+=("$p"); done
  if ((${#req_missing[@]})); then
    $SUDO apt-get install -y -qq --no-install-recommends "${req_missing[@]}" >/dev/null || {
      echo "kerf: could not install ${req_missing[*]}" >&2; exit 1; }
  fi
fi
