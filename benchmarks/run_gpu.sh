#!/usr/bin/env bash
# Everything the GPU machine checks, in one command (the device tool runs it from the repo root):
#   benchmarks/run_gpu.sh [build] [diag] [tests] [sanitize] [bench] [profile] [fbgemm] [placements] [referee] [cache] [sweep] [large]
#   (default: all but profile, placements, referee, cache, sweep and large). Narrower runs: BUILD_SPECS="sgd adam" builds only those;
#   TEST_FILES, TEST_MARK=cuda and TBEGEN_TEST_OPTIMIZERS="sgd adam" (see tests/conftest.py) narrow the tests step;
#   BENCH_OPTS=sgd,adam the bench step.
# Logs and results go to $OUT (default /tmp/tbegen-gpu-out). See docs/gpu-results.md.
# The device tool brings back at most 8 files a call: run `build diag tests sanitize` in one call
# and `build bench fbgemm` (or `profile`) in another.
set -u
OUT=${OUT:-/tmp/tbegen-gpu-out}
mkdir -p "$OUT"
# (always 9.0, as every other run script sets it. This script alone kept a preset list, and at
# landing13 its build made new cache keys for the four specs run_gpu_landing.sh had just built (130 s;
# landing11 and 12 lost 120-220 s the same way): the likeliest cause is a list the device's
# environment presets. env.txt now says what the call found)
ARCH_PRESET=${TORCH_CUDA_ARCH_LIST-unset}
PRESET_ENV=$(env | grep -E '^(TBEGEN_|TORCH_|CUDA|NVCC|CC=|CXX=)' | sort | tr '\n' ' ')
export TORCH_CUDA_ARCH_LIST=9.0
# inside the (ignored) build/ folder, so a second call on the same warm machine finds the cache
export TBEGEN_BUILD_DIR=${TBEGEN_BUILD_DIR:-$PWD/build/tbegen-cache}
export PYTHONPATH=$PWD:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
steps=${*:-build diag tests sanitize bench fbgemm}
has() { [[ " $steps " == *" $1 "* ]]; }
status=0

{
  date -u +"date: %Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | sed 's/^/gpu: /'
  python3 -c "import torch, sys; print('python:', sys.version.split()[0]); print('torch:', torch.__version__, 'cuda', torch.version.cuda)"
  nvcc --version | tail -n 2 | head -n 1 | sed 's/^/nvcc: /'
  echo "TORCH_CUDA_ARCH_LIST: 9.0 (the environment's before this script: $ARCH_PRESET)"
  echo "build-related environment the call found: ${PRESET_ENV:-none}"
} | tee "$OUT/env.txt"

if has build; then
  source benchmarks/tools/gpu_common.sh
  cache_entries "before the build" >> "$OUT/env.txt"
  start=$(date +%s)
  python3 -c "
from tbegen import build; from tbegen.spec import find_spec, list_specs
import os
names = os.environ.get('BUILD_SPECS', '').split()
build.prebuild([find_spec(n) for n in names] if names else list_specs(), with_cuda=True)" > "$OUT/build.log" 2>&1 || { status=1; tail -n 60 "$OUT/build.log"; }
  # (kept only when the build failed: the device tool returns at most 8 files)
  [ $status = 0 ] && rm -f "$OUT/build.log"
  echo "build of all extensions (parallel): $(( $(date +%s) - start )) s" | tee -a "$OUT/env.txt"
  cache_entries "after the build" >> "$OUT/env.txt"
fi
if has diag; then
  python3 benchmarks/diag_errors.py 2>&1 | tee "$OUT/diag.log" | tail -n 40
fi
if has tests; then
  # xdist (in the GPU image): four processes share the GPU, and a crashing test is reported
  # instead of ending the session
  # (XDIST workers, two CPU threads each; TEST_FILES narrows the run)
  xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${XDIST:-12}")
  timeout_opt=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout 300")
  OMP_NUM_THREADS=2 TBEGEN_RESULTS_DIR="$OUT" timeout ${TESTS_TIMEOUT:-480} python3 -m pytest \
    ${TEST_FILES:-tests/test_cuda.py tests/test_module.py tests/test_placements.py tests/test_cache.py tests/test_any_width.py tests/test_state_dtypes.py tests/test_int_states.py tests/test_bad_input.py tests/test_cuda_lane_split.py} ${TEST_MARK:+-m $TEST_MARK} -q -p no:cacheprovider $xdist $timeout_opt \
    > "$OUT/pytest_cuda.log" 2>&1 || status=1
  grep -E "^(FAILED|ERROR)|passed|failed|crashed" "$OUT/pytest_cuda.log" | tail -n 30
  python3 benchmarks/summarize_results.py "$OUT" | tee "$OUT/numerics_table.md"
  rm -f "$OUT"/harness_results_*.jsonl
fi
if has sanitize; then
  for tool in memcheck racecheck; do
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout ${SANITIZE_TIMEOUT:-300} compute-sanitizer --tool $tool --print-limit 20 \
      python3 benchmarks/sanitize_cases.py ${SANITIZE_OPTS:-rowwise_adagrad adam} > "$OUT/sanitize_$tool.tmp" 2>&1 || status=1
    { echo "== compute-sanitizer --tool $tool"; cat "$OUT/sanitize_$tool.tmp"; } >> "$OUT/sanitize.log"
    rm -f "$OUT/sanitize_$tool.tmp"
    echo "== $tool"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|FAILED|Error" "$OUT/sanitize.log" | tail -n 8
  done
fi
if has bench; then
  python3 benchmarks/bench.py --out "$OUT" ${BENCH_OPTS:+--opts $BENCH_OPTS} 2>&1 | tee "$OUT/bench.log" | grep -v Warning || status=1
fi
if has profile; then
  python3 benchmarks/bench.py --out /tmp/tbegen-profile --configs C1,C2 --opts sgd --iters 5 --profile 2>&1 \
    | tee "$OUT/profile.log" | grep -v Warning
fi
if has placements; then
  # Table placements (docs/placements.md) on C2 (Zipf): every table in device memory, then every
  # table in managed memory, tbegen and FBGEMM (its MANAGED location) in the same call.
  # PLACEMENT_OPTS narrows the optimizers (default sgd,rowwise_adagrad).
  popts=${PLACEMENT_OPTS:-sgd,rowwise_adagrad}
  python3 benchmarks/bench.py --out "$OUT/placements" --configs C2 --opts "$popts" --placements device,managed \
    2>&1 | tee "$OUT/placements.log" | grep -v Warning || status=1
  if [ -d .anchor/bundle ]; then
    python3 .anchor/unpack_bundle.py .anchor/bundle /tmp/fbg_site > /dev/null 2>&1 &&
    PYTHONPATH=/tmp/fbg_site:$PYTHONPATH CUDA_MODULE_LOADING=LAZY python3 .anchor/bench_tbe.py --configs C2 \
      --systems fbgemm,tbegen --placements device,managed --opts "$(echo "$popts" | sed 's/rowwise_adagrad/EXACT_ROWWISE_ADAGRAD/; s/\bsgd\b/EXACT_SGD/')" \
      --fast-init --out "$OUT/placements-fbgemm" >> "$OUT/placements.log" 2>&1 || status=1
    rm -f "$OUT/placements-fbgemm/env.json"
    grep -E "fbgemm|tbegen" "$OUT/placements.log" | grep -vi "compat table" | tail -n 20
  else
    echo "placements: .anchor/bundle not carried; FBGEMM's MANAGED skipped" | tee -a "$OUT/placements.log"
  fi
fi
if has referee; then
  # issue 27's record: the referee's own --placements run (bench_tbe.py), FBGEMM's and tbegen's
  # managed_caching at each fraction of C2's rows on fresh batches (the issue's command), one
  # process per fraction (FBGEMM and tbegen side by side in it; the referee runs system by system,
  # so a budget cut inside one process would drop tbegen's cells). REFEREE_PLACEMENTS (default
  # "cache:0.2 cache:0.1 cache:0.05"), REFEREE_OPTS (default EXACT_SGD,EXACT_ROWWISE_ADAGRAD),
  # REFEREE_TIMEOUT for all of them. Into $OUT/referee/results.jsonl (appended) and referee.log.
  if [ -d .anchor/bundle ] && python3 .anchor/unpack_bundle.py .anchor/bundle /tmp/fbg_site > /dev/null 2>&1; then
    places=(${REFEREE_PLACEMENTS:-cache:0.2 cache:0.1 cache:0.05})
    each=$(( ${REFEREE_TIMEOUT:-420} / ${#places[@]} ))
    for p in "${places[@]}"; do
      echo "== bench_tbe.py --placements $p" >> "$OUT/referee.log"
      PYTHONPATH=/tmp/fbg_site:$PYTHONPATH CUDA_MODULE_LOADING=LAZY timeout $each python3 .anchor/bench_tbe.py \
        --configs C2 --systems fbgemm,tbegen --placements "$p" --opts ${REFEREE_OPTS:-EXACT_SGD,EXACT_ROWWISE_ADAGRAD} \
        --nsets 40 --warmup 20 --iters 20 --fast-init --out "$OUT/referee" >> "$OUT/referee.log" 2>&1 || status=1
    done
    grep -E "^(==|C2 |total|budget)" "$OUT/referee.log" | tail -n 30
  else
    echo "referee: .anchor/bundle not carried; skipped" | tee -a "$OUT/referee.log"
  fi
fi
if has cache; then
  # managed_caching (docs/placements.md): C2's shape with caches of 1%, 5%, 20% of each table's
  # rows against all-device placement, and FBGEMM's MANAGED_CACHING when the bundle is carried.
  # CACHE_OPTS: more bench_cache.py options (e.g. "--optimizer sgd --prefetch-ahead").
  fbg_path=""
  if [ -d .anchor/bundle ] && python3 .anchor/unpack_bundle.py .anchor/bundle /tmp/fbg_site > /dev/null 2>&1; then
    fbg_path=/tmp/fbg_site:
  fi
  PYTHONPATH=$fbg_path$PYTHONPATH CUDA_MODULE_LOADING=LAZY timeout ${CACHE_TIMEOUT:-420} python3 benchmarks/bench_cache.py --tables 32 \
    --rows 1000000 --dim 128 --batch 16384 --pooling-factor 20 ${CACHE_OPTS:-} --out "$OUT/cache" \
    > "$OUT/cache.log" 2>&1 || status=1
  # (CACHE_TRACES=0: --profile's trace-*.json left out: large, and the device tool returns 8 files)
  [ "${CACHE_TRACES:-1}" = 1 ] || rm -f "$OUT"/cache/trace-*.json
  tail -n 14 "$OUT/cache.log"
fi
if has large; then
  # tables larger than the memory the process may use (benchmarks/bench_large_tables.py; LARGE_OPTS
  # e.g. "--tables 32 --cap-gb 16"), into $OUT/large_tables.json
  timeout ${LARGE_TIMEOUT:-300} python3 benchmarks/bench_large_tables.py ${LARGE_OPTS:-} --out "$OUT" 2>&1 \
    | tee "$OUT/large.log" | tail -n 3 || status=1
fi
if has sweep; then
  # the shape sweep beside FBGEMM (benchmarks/sweep_gpu.py; SWEEP_OPTS e.g. "--quick" or "--only 'D='"),
  # into $OUT/sweep (sweep.json, sweep.md; the PNG: benchmarks/sweep_report.py where matplotlib is)
  if [ -d .anchor/bundle ] && python3 .anchor/unpack_bundle.py .anchor/bundle /tmp/fbg_site > /dev/null 2>&1; then
    PYTHONPATH=/tmp/fbg_site:$PYTHONPATH CUDA_MODULE_LOADING=LAZY timeout ${SWEEP_TIMEOUT:-600} python3 benchmarks/sweep_gpu.py \
      ${SWEEP_OPTS:-} --out "$OUT/sweep" > "$OUT/sweep.log" 2>&1 || status=1
    grep -E "geometric mean|cells timed" "$OUT/sweep/sweep.md" 2>/dev/null || tail -n 20 "$OUT/sweep.log"
  else
    echo "sweep: .anchor/bundle not carried; skipped"
  fi
fi
if has fbgemm; then
  if [ -d .anchor/bundle ]; then
    python3 .anchor/unpack_bundle.py .anchor/bundle /tmp/fbg_site > /dev/null 2>&1 &&
    # FBGEMM_ARGS: e.g. "--configs C2 --profile"; tbegen is timed beside FBGEMM through its module
    PYTHONPATH=/tmp/fbg_site:$PYTHONPATH CUDA_MODULE_LOADING=LAZY python3 .anchor/bench_tbe.py --check \
      ${FBGEMM_ARGS:---systems fbgemm,tbegen,torch --fast-init} --out "$OUT/fbgemm" \
      > "$OUT/fbgemm.log" 2>&1 || status=1
    { echo "== env.json"; cat "$OUT/fbgemm/env.json"; } >> "$OUT/fbgemm.log" 2>/dev/null && rm -f "$OUT/fbgemm/env.json"
    grep -vi "compat table" "$OUT/fbgemm.log" | tail -n 30
  else
    echo "fbgemm: .anchor/bundle not carried; skipped"
  fi
fi
exit $status
