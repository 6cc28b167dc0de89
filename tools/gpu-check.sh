#!/usr/bin/env bash
# kerf's GPU check, for a machine with an NVIDIA GPU: builds kerf, runs the
# [gpu] tests, runs them again under compute-sanitizer (memcheck, and racecheck
# for the kernels' shared-memory barriers), runs the
# benchmarks (kerf, then PyTorch eager and Triton where installed), and prints
# a short summary table last. Logs and JSON go to $OUT (default build-gpu/out).
#
#   tools/gpu-check.sh                     # everything
#   tools/gpu-check.sh --stages test,bench # a subset: build is implied
#   tools/gpu-check.sh --quick             # fewer benchmark configurations
#   tools/gpu-check.sh --stages test --jobs 4
#                                          # the test cases in 4 processes at once; those tagged
#                                          # [autotune] or [threads] (which time kernels) run alone after
#   tools/gpu-check.sh --stages build      # only build (C++ and, with pybind11, the Python module)
#   tools/gpu-check.sh --stages bench --bench-op dora_norm,lora_merge
#                                          # only the benchmark cases whose names contain one of these
#   tools/gpu-check.sh --stages bench --bench-args --tuned-only
#                                          # more kerf_bench options (here: the autotuner's choice only, no sweep)
#   tools/gpu-check.sh --stages bench --bench-op "moe_backward r=64" \
#       --bench-args "--config 64,256,0,8,3 --meta BY_COLUMNS=1,WGMMA=1 --variants ;WGMMA_SS=1 --rounds 3"
#                                          # an A/B in one process: each case with each variant in turns
#                                          # (KERF_AUTOTUNE is not needed: a --config call is not tuned)
#   tools/gpu-check.sh --stages order      # tools/access_order_bench.cu at three shapes (sm_90a)
#   tools/gpu-check.sh --stages profile --profile-kernel lora_embedding_backward_fused \
#       --profile-op "embedding_backward r=16 bf16 grads" \
#       --bench-args "--config 128,128,0,4,3 --meta GROUP_BY_ID=1,FUSED=1"
#                                          # Nsight Compute (ncu) on one launch of the kernels whose names
#                                          # match, in kerf_bench's first case named so (tuner off): ncu.log,
#                                          # and ncu-source.csv.gz (each SASS instruction's stall samples)
#
# On a machine with two or more GPUs the [multigpu] test cases and
# tests/python/test_multi_gpu.py run too (with one they say they were skipped):
#   tools/gpu-check.sh --stages test,python --filter "[multigpu]"
#
# The benchmark logs and JSON are written to $OUT as they grow, so a run
# stopped by a time limit still leaves every case it finished.
#
# Debian packages the machine lacks (xxHash headers, Catch2 v2) may be put as
# .deb files in .deps/ (see README); they are unpacked into a private prefix.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
stages="test,sanitize,bench,python"
quick=""
jobs=1
bench_op=""
bench_args=()
test_filter="[gpu]"
profile_kernel=""
profile_op=""
while (($#)); do
  case "$1" in
    --stages) stages="$2"; shift 2 ;;
    --quick) quick="--quick"; shift ;;
    --jobs) jobs="$2"; shift 2 ;;
    --bench-op) bench_op="$2"; shift 2 ;;
    --bench-args) read -r -a bench_args <<< "$2"; shift 2 ;;
    --filter) test_filter="$2"; shift 2 ;;
    --profile-kernel) profile_kernel="$2"; shift 2 ;;
    --profile-op) profile_op="$2"; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
build=${KERF_GPU_BUILD_DIR:-$root/build-gpu}
final=${OUT:-$build/out}
out="$build/logs"   # everything lands here; $final gets the summary, table and one archive
mkdir -p "$out" "$final"
summary=()
status=0
note() { summary+=("$1"); }

prefix=/tmp/kerf-deps
if compgen -G ".deps/*.deb" >/dev/null; then
  mkdir -p "$prefix"
  for f in .deps/*.deb; do dpkg -x "$f" "$prefix"; done
  export PKG_CONFIG_PATH="$prefix/usr/lib/x86_64-linux-gnu/pkgconfig:$prefix/usr/share/pkgconfig:${PKG_CONFIG_PATH:-}"
  if [[ ! -f /usr/include/xxhash.h ]]; then export PKG_CONFIG_SYSROOT_DIR="$prefix"; fi
  export LD_LIBRARY_PATH="$prefix/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
fi

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv \
  > "$out/device.txt" 2>&1 || true
device=$(sed -n 2p "$out/device.txt" | cut -d, -f1)

# The names of the test cases a Catch2 filter selects, one a line: Catch2 v3 wraps long
# names in its plain listing, so its XML listing is read; v2 (whose XML reporter does not
# list) names them one a line itself. (v2's listing exits with the number of names.)
list_tests() {
  local names
  if names=$({ "$build/tests/kerf_tests" --list-tests --reporter xml "$1" 2>/dev/null || true; } |
      python3 -c 'import sys, xml.etree.ElementTree as E
for t in E.parse(sys.stdin).iter("TestCase"): print(t.findtext("Name"))' 2>/dev/null); then
    printf '%s\n' "$names" | sed '/^$/d'
  else
    { "$build/tests/kerf_tests" --list-test-names-only "$1" || true; } | sed '/^$/d'
  fi
}

# --jobs N: the filter's test cases dealt round-robin to N processes at once, then those
# tagged [autotune] or [threads] (they time kernels, or start threads of their own) one
# process after them. Each process's log goes into $2 in turn; the last line counts the
# cases listed and the failure lines.
run_parallel_tests() {
  local filter=$1 log=$2 dir="$out/test-shards" rc=0
  rm -rf "$dir"; mkdir -p "$dir"
  list_tests "$filter" | sort > "$dir/all"
  list_tests "[autotune],[threads]" | sort > "$dir/serial-all"
  # Names go into -f files as test specs: their commas and brackets escaped.
  local escape=(sed -e 's/\\/\\\\/g' -e 's/,/\\,/g' -e 's/\[/\\[/g')
  comm -12 "$dir/all" "$dir/serial-all" | "${escape[@]}" > "$dir/serial"
  comm -23 "$dir/all" "$dir/serial-all" | "${escape[@]}" |
    awk -v n="$jobs" -v d="$dir" '{ print > (d "/shard" (NR % n)) }'
  local pids=()
  for f in "$dir"/shard*; do
    "$build/tests/kerf_tests" -f "$f" -r compact > "$f.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  if [[ -s "$dir/serial" ]]; then
    "$build/tests/kerf_tests" -f "$dir/serial" -r compact > "$dir/serial.log" 2>&1 || rc=1
  fi
  # A name that reached Catch2 mangled would leave its test case out without failing.
  if grep -h "No test cases matched" "$dir"/*.log; then rc=1; fi
  : > "$log"
  for f in "$dir"/*.log; do { echo "== $(basename "$f" .log)"; cat "$f"; } >> "$log"; done
  local failed
  failed=$(grep -hE "^(.*: )?FAILED|failed$" "$dir"/*.log | grep -c . || true)
  local all serial
  all=$(wc -l < "$dir/all"); serial=$(wc -l < "$dir/serial")
  echo "test cases: $all ($((all - serial)) in $jobs processes, then $serial alone); exit $rc; failure lines: $failed" >> "$log"
  return $rc
}

echo "== build"
t0=$SECONDS
python_args=(-DKERF_BUILD_PYTHON=OFF)
if python3 -m pybind11 --cmakedir >/dev/null 2>&1 || [[ ,$stages, == *,python,* ]]; then
  # The machine's own python3 (with torch, triton, pybind11 from pip).
  python_args=(-DKERF_BUILD_PYTHON=ON -DPYBIND11_FINDPYTHON=ON -DPython_EXECUTABLE="$(command -v python3)")
fi
if ! cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${python_args[@]}" \
      -DCMAKE_PREFIX_PATH="$prefix/usr" > "$out/configure.log" 2>&1; then
  tail -30 "$out/configure.log"; echo "configure failed"; exit 1
fi
grep -E "kerf:" "$out/configure.log"
targets=(--target kerf_tests kerf_bench kerf_bench_launch)
[[ ${python_args[0]} == -DKERF_BUILD_PYTHON=ON ]] && targets+=(_kerf)
if ! cmake --build "$build" -j "$(nproc)" "${targets[@]}" > "$out/build.log" 2>&1; then
  grep -E "error|Error" "$out/build.log" | head -40; echo "build failed"; exit 1
fi
note "build: ok ($((SECONDS - t0)) s)"

if [[ ,$stages, == *,test,* ]]; then
  echo "== demo"
  cmake --build "$build" --target kerf_demo > "$out/demo-build.log" 2>&1
  "$build/examples/kerf_demo" 2>&1 | tee "$out/demo.log"
  note "demo: $(tail -1 "$out/demo.log")"
  echo "== [gpu] tests"
  t0=$SECONDS
  if ((jobs > 1)); then
    run_parallel_tests "$test_filter" "$out/gpu-tests.log"
    rc=$?
  else
    "$build/tests/kerf_tests" "$test_filter" -r compact > "$out/gpu-tests.log" 2>&1
    rc=$?
  fi
  tail -5 "$out/gpu-tests.log"
  grep -E "failed|FAILED" "$out/gpu-tests.log" | head -40
  note "[gpu] tests: $(grep -E 'Passed all|test cases' "$out/gpu-tests.log" | tail -1) (exit $rc, $((SECONDS - t0)) s)"
  ((rc)) && status=1
fi

if [[ ,$stages, == *,sanitize,* ]]; then
  echo "== compute-sanitizer memcheck"
  t0=$SECONDS
  # Tests that provoke driver errors on purpose are left out of the memory check.
  compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 20 \
    "$build/tests/kerf_tests" "$test_filter~[provokes-errors]" -r compact > "$out/sanitizer.log" 2>&1
  rc=$?
  grep -E "ERROR SUMMARY|Invalid|out of bounds" "$out/sanitizer.log" | head -20
  note "memcheck: $(grep -E 'Passed all|test cases' "$out/sanitizer.log" | tail -1); $(grep -E 'ERROR SUMMARY' "$out/sanitizer.log" | tail -1) (exit $rc, $((SECONDS - t0)) s)"
  ((rc)) && status=1
  echo "== compute-sanitizer racecheck (shared-memory hazards) on the kernel numerics tests"
  t0=$SECONDS
  race_set="[gpu][kernels],[gpu][numerics],[gpu][merge],[gpu][embedding],[gpu][4bit]"
  # The same tests without the sanitizer first: their kernels are then compiled and
  # cached (NVRTC is slow under it), and a plain failure shows up as one.
  "$build/tests/kerf_tests" "$race_set" -r compact > "$out/racecheck-plain.log" 2>&1 ||
    { echo "the racecheck tests fail without the sanitizer:"; tail -20 "$out/racecheck-plain.log"; }
  timeout 300 compute-sanitizer --tool racecheck --error-exitcode 9 --print-limit 20 \
    "$build/tests/kerf_tests" "$race_set" -r compact > "$out/racecheck.log" 2>&1
  rc=$?
  grep -E "RACECHECK SUMMARY|Race reported|Error:" "$out/racecheck.log" | head -20
  ((rc)) && { echo "racecheck exit $rc; the end of its log:"; tail -15 "$out/racecheck.log"; }
  note "racecheck: $(grep -E 'Passed all|test cases' "$out/racecheck.log" | tail -1); $(grep -E 'RACECHECK SUMMARY' "$out/racecheck.log" | tail -1) (exit $rc, $((SECONDS - t0)) s)"
  ((rc)) && status=1
fi

if [[ ,$stages, == *,python,* ]]; then
  echo "== Python (pytest on the GPU, overhead benchmark, PEFT example)"
  t0=$SECONDS
  export PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}" KERF_BUILD_DIR="$build"
  PYTHONUNBUFFERED=1 python3 -m pytest tests/python -q -rfEs > "$out/pytest.log" 2>&1
  rc=$?
  tail -15 "$out/pytest.log"
  # Failures with their last lines, wherever the skips put them in the summary.
  grep -E "^(FAILED|ERROR) " "$out/pytest.log" | head -20
  note "pytest: $(tail -1 "$out/pytest.log") (exit $rc, $((SECONDS - t0)) s)"
  ((rc)) && status=1
  PYTHONUNBUFFERED=1 python3 tests/bench/python_overhead.py > "$out/python-overhead.log" 2>&1
  tail -12 "$out/python-overhead.log"
  note "python host overhead: $(grep -iE 'kerf' "$out/python-overhead.log" | head -3 | tr '\n' ';')"
  PYTHONUNBUFFERED=1 python3 examples/python/peft_dora_kerf.py > "$out/peft.log" 2>&1
  rc=$?
  tail -8 "$out/peft.log"
  note "PEFT example: exit $rc, $(tail -1 "$out/peft.log")"
  ((rc)) && status=1
fi

if [[ ,$stages, == *,profile,* ]]; then
  echo "== Nsight Compute profile"
  if ! command -v ncu > /dev/null; then
    note "profile: ncu is not installed here"
  else
    t0=$SECONDS
    # The clocks stay as the machine sets them (--clock-control none); the launches
    # before the one profiled warm the caches and compile the kernel.
    # The report is also kept and its source page (each SASS instruction with its
    # warp stall samples by reason) written as CSV: where in the code the warps wait.
    rep="$build/ncu-report"  # outside the logs folder that the archive takes
    rm -f "$rep.ncu-rep"
    KERF_AUTOTUNE=0 ncu --clock-control none ${profile_kernel:+-k "regex:$profile_kernel"} --launch-skip 5 \
      --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
      --section SchedulerStats --section LaunchStats --section SourceCounters \
      -o "$rep" "$build/tests/bench/kerf_bench" \
      ${profile_op:+--op "$profile_op"} "${bench_args[@]}" \
      > "$out/ncu-run.log" 2>&1
    rc=$?
    tail -5 "$out/ncu-run.log"
    if [[ -f "$rep.ncu-rep" ]]; then
      ncu -i "$rep.ncu-rep" --page details > "$final/ncu.log" 2>&1
      ncu -i "$rep.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip -c > "$final/ncu-source.csv.gz"
    fi
    grep -vE "^==PROF==|^\s*$" "$final/ncu.log" | tail -80
    note "profile: ncu exit $rc, report in ncu.log, SASS with stall samples in ncu-source.csv.gz ($((SECONDS - t0)) s)"
  fi
fi

# --stages order: what the memory gives a read-modify-write of W in the orders the
# in-place kernels walk it, beside cudaMemcpy (tools/access_order_bench.cu, no kerf).
if [[ ,$stages, == *,order,* ]]; then
  echo "== access orders"
  if nvcc -arch=sm_90a -O3 -o "$build/access_order_bench" tools/access_order_bench.cu > "$out/access-order.log" 2>&1; then
    for shape in "8192 8192" "14336 4096" "4096 4096"; do
      "$build/access_order_bench" $shape 2>&1 | tee -a "$out/access-order.log" "$final/access-order.log"
    done
    note "access orders: access-order.log"
  else
    tail -5 "$out/access-order.log"
    note "access orders: nvcc failed (access-order.log)"
  fi
fi

if [[ ,$stages, == *,bench,* ]]; then
  "$build/tests/bench/kerf_bench_launch" > "$out/launch-overhead.log" 2>&1
  tail -8 "$out/launch-overhead.log"
  note "C++ launch overhead: $(grep -iE 'difference|gpu' "$out/launch-overhead.log" | head -2 | tr '\n' ';')"
  echo "== benchmarks"
  t0=$SECONDS
  op_args=()
  [[ -n $bench_op ]] && op_args=(--op "$bench_op")
  "$build/tests/bench/kerf_bench" $quick "${op_args[@]}" "${bench_args[@]}" --json "$final/kerf-bench.json" 2>&1 |
    tee "$out/kerf-bench.log" "$final/kerf-bench.log"
  if python3 -c "import torch" 2>/dev/null; then
    PYTHONUNBUFFERED=1 python3 tests/bench/reference_bench.py $quick "${op_args[@]}" \
      --json "$final/reference-bench.json" > "$final/reference-bench.log" 2>&1 || tail -5 "$final/reference-bench.log"
    cp "$final/reference-bench.log" "$out/"
  fi
  python3 tools/bench_table.py "$final/kerf-bench.json" "$final/reference-bench.json" > "$out/bench-table.md"
  note "benchmarks: $((SECONDS - t0)) s"
fi

{
  echo "== summary ($device, $(date -u +%Y-%m-%d))"
  for s in "${summary[@]}"; do echo "  $s"; done
  [[ -f "$out/bench-table.md" && ,$stages, == *,bench,* ]] && cat "$out/bench-table.md"
} > "$out/summary.txt"
cp "$out/summary.txt" "$final/"
cp "$final"/*bench*.json "$out/" 2>/dev/null  # in the archive too
tar -czf "$final/logs.tar.gz" -C "$out" . 2>/dev/null
echo
cat "$out/summary.txt"
exit $status
