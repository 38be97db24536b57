#!/usr/bin/env bash
# The whole GPU evidence for a landing, in one device call of under 10 minutes (the lent machine's
# per-call limit), from the repository root:
#   1. build the four benchmarked optimizers' CUDA extensions;
#   2. the benchmark beside FBGEMM_GPU (the referee, .anchor/bench_tbe.py --check), while the other
#      eleven extensions build at low priority (the benchmark's timed work is on the GPU), then the
#      kernel profiles of the worst cells (PROFILE), an environment switch's A/B (AB_ENV) and the
#      shape sweep (benchmarks/sweep_gpu.py; SWEEP=0 skips);
#   3. every CUDA test (pytest -m cuda over tests/, but for FBGEMM_GPU's and TorchRec's files, which
#      step 5 runs; TEST_FILES runs the files it names instead, EXTRA_TESTS adds files);
#   4. compute-sanitizer memcheck and racecheck over benchmarks/sanitize_cases.py (into extras.log);
#   5. FBGEMM_GPU differential tests (test_fbgemm_compat -m cuda), TorchRec over NCCL on one rank
#      (test_torchrec -m cuda and examples/torchrec_training.py, with the wheels in .whl/).
# Every step's timeout is capped by DEADLINE (below), so the later steps may be cut short.
# Carry .anchor (FBGEMM bundle and referee) and .whl (TorchRec 1.6.1 and its pure-Python wheels:
# benchmarks/fetch_gpu_wheels.sh). Output: at
# most 8 files under $OUT (the device tool's limit).
set -u
OUT=${OUT:-/tmp/tbegen-gpu-out}
mkdir -p "$OUT/fbgemm"
ARCH_PRESET=${TORCH_CUDA_ARCH_LIST-unset}
PRESET_ENV=$(env | grep -E '^(TBEGEN_|TORCH_|CUDA|NVCC|CC=|CXX=)' | sort | tr '\n' ' ')
export TORCH_CUDA_ARCH_LIST=9.0 TBEGEN_BUILD_DIR=$PWD/build/tbegen-cache PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
status=0
# every step's timeout is capped so that the whole script ends DEADLINE seconds after it starts
# (default 570: inside the device's 10-minute limit per call), the later steps getting what is left
t_start=$(date +%s)
cap() { local left=$(( ${DEADLINE:-570} - ($(date +%s) - t_start) )); [ $left -lt 5 ] && left=5; echo $(( $1 < left ? $1 : left )); }
log() { echo "== $*" | tee -a "$OUT/extras.log"; }
build() {  # build the named specs' CUDA extensions into the cache
  python3 -c "
import sys; from tbegen import build; from tbegen.spec import find_spec
build.prebuild([find_spec(n) for n in sys.argv[1:]], with_cuda=True)" "$@"
}
{
  date -u +"date: %Y-%m-%d %H:%M UTC"; git rev-parse --short HEAD 2>/dev/null | sed 's/^/commit (the .git sent to the device, may be stale): /'
  echo "tree: ${TREE:-not given (TREE=<commit> names the tree sent)}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | sed 's/^/gpu: /'
  python3 -c "import torch, sys; print('python:', sys.version.split()[0]); print('torch:', torch.__version__, 'cuda', torch.version.cuda)"
  nvcc --version | tail -n 2 | head -n 1 | sed 's/^/nvcc: /'
  echo "TORCH_CUDA_ARCH_LIST: 9.0 (the environment's before this script: $ARCH_PRESET)"
  echo "build-related environment the call found: ${PRESET_ENV:-none}"
} | tee "$OUT/env.txt"
# the host link's limits (the referee's host_link.py; ~2 s): machines of one kind differ, and the
# cached tables' steps follow the link (landing13's 101.6 GB/s both ways at once, landing14's 74.0)
[ -f .anchor/host_link.py ] && timeout 60 python3 .anchor/host_link.py 2>/dev/null \
  | sed 's/^/host link, pinned 2 GiB copies, best of 5 (GB\/s): /' | tee -a "$OUT/env.txt"
python3 .anchor/unpack_bundle.py .anchor/bundle /tmp/fbg_site > /dev/null 2>&1 || log "FBGEMM bundle did not unpack"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1 \
  || log "TorchRec wheels did not install"

source benchmarks/tools/gpu_common.sh
cache_entries "before the build" >> "$OUT/env.txt"
t0=$(date +%s)
BENCHED="sgd rowwise_adagrad adagrad adam"
build $BENCHED > "$OUT/extras.log" 2>&1 || { status=1; log "build failed"; }
log "build of the 4 benchmarked extensions: $(( $(date +%s) - t0 )) s"
REST=$(python3 -c "from tbegen.spec import list_specs; print(' '.join(p.stem for p in list_specs() if p.stem not in '$BENCHED'.split()))")
# (BUILD_REST=0: the other extensions are not built, for a probing call whose tests are narrowed with
# TBEGEN_TEST_OPTIMIZERS; the sweep is then timed on a machine with nothing else running)
rest_pid=
if [ "${BUILD_REST:-1}" = 1 ]; then
  ( nice -n 19 bash -c "$(declare -f build); build $REST" >> "$OUT/extras.log" 2>&1 ) &
  rest_pid=$!
fi

# (BENCH=0 skips the referee's run: a probing call that times only the sweep)
[ "${BENCH:-1}" = 1 ] && { PYTHONPATH=/tmp/fbg_site:$PYTHONPATH CUDA_MODULE_LOADING=LAZY timeout $(cap ${BENCH_TIMEOUT:-200}) python3 .anchor/bench_tbe.py --check \
  --systems fbgemm,tbegen --fast-init --budget-s ${BENCH_BUDGET:-150} --out "$OUT/fbgemm" > "$OUT/fbgemm.log" 2>&1 || status=1; }
grep -vi "compat table" "$OUT/fbgemm.log" | grep -E "^C[123] " | tail -n 24
rm -f "$OUT/fbgemm/env.json" "$OUT/fbgemm/profiles.json"  # (profiles.json: the PROFILE step below)
# where the time goes, kernel by kernel, in the cells named by PROFILE (config:OPT,...; default the
# worst backward cells of run N and P, about 40 s; PROFILE= skips):
# bench_tbe.py --profile, FBGEMM and tbegen, into fbgemm/profiles.json
if [ -n "${PROFILE-C1:EXACT_ADAGRAD,C3:ADAM}" ]; then
  for cell in $(echo "${PROFILE-C1:EXACT_ADAGRAD,C3:ADAM}" | tr ',' ' '); do
    PYTHONPATH=/tmp/fbg_site:$PYTHONPATH CUDA_MODULE_LOADING=LAZY timeout $(cap ${PROFILE_TIMEOUT:-60}) python3 .anchor/bench_tbe.py \
      --configs "${cell%%:*}" --opts "${cell##*:}" --systems fbgemm,tbegen --fast-init --profile --iters 10 \
      --out "$OUT/profile" >> "$OUT/fbgemm.log" 2>&1 || log "profile of $cell failed or timed out"
    python3 - "$OUT/profile/profiles.json" "$OUT/fbgemm/profiles.json" <<'PY' || log "profile of $cell not kept"
import json, os, sys
new = json.load(open(sys.argv[1]))
old = json.load(open(sys.argv[2])) if os.path.exists(sys.argv[2]) else {}
old.update(new)
json.dump(old, open(sys.argv[2], "w"), indent=1)
PY
  done
  rm -rf "$OUT/profile"
fi
# an A/B of an environment switch beside the referee run above: AB_ENV (e.g.
# "TBEGEN_LONG_RUN_L2_HINT=1") set, tbegen alone through the referee on AB_CONFIGS (default C2),
# into fbgemm.log and fbgemm/ab_results.jsonl, after the same with the defaults (a process without
# FBGEMM in it times tbegen 4-7% faster, benchmarks/NOTES-gpu.md item 19, so the referee's rows
# above are not the A/B's other half)
if [ -n "${AB_ENV:-}" ]; then
  for ab in "" "$AB_ENV"; do
    echo "== A/B: bench_tbe.py with ${ab:-the defaults}" >> "$OUT/fbgemm.log"
    rm -rf /tmp/ab
    env $ab PYTHONPATH=/tmp/fbg_site:$PYTHONPATH CUDA_MODULE_LOADING=LAZY timeout $(cap ${AB_TIMEOUT:-60}) python3 .anchor/bench_tbe.py \
      --configs ${AB_CONFIGS:-C2} --systems tbegen --fast-init --out /tmp/ab >> "$OUT/fbgemm.log" 2>&1 || log "A/B (${ab:-defaults}) failed or timed out"
    cat /tmp/ab/results.jsonl >> "$OUT/fbgemm/ab_results.jsonl" 2>/dev/null
  done
  grep -E "^== A/B|^C[123] " "$OUT/fbgemm.log" | tail -n 10
fi
# the backward's lane-group kernel against the whole-warp kernel (TBEGEN_LANE_GROUPS=0), tbegen
# alone (benchmarks/bench.py): GROUPS_CONFIGS (default C5, 32 tables of 32 columns; the referee
# above times C3 with it), optimizers without per-element
# state (the others take the whole-warp kernel either way); GROUPS_AB=0 skips
if [ "${GROUPS_AB:-1}" = 1 ]; then
  for flag in 1 0; do
    echo "== benchmarks/bench.py, TBEGEN_LANE_GROUPS=$flag" >> "$OUT/fbgemm.log"
    TBEGEN_LANE_GROUPS=$flag CUDA_MODULE_LOADING=LAZY timeout $(cap ${GROUPS_TIMEOUT:-45}) python3 benchmarks/bench.py --configs ${GROUPS_CONFIGS:-C5} \
      --opts sgd,rowwise_adagrad --out /tmp/groups_ab_$flag >> "$OUT/fbgemm.log" 2>&1 || log "lane-group A/B ($flag) failed or timed out"
  done
  grep -E "TBEGEN_LANE_GROUPS=|^C[35] " "$OUT/fbgemm.log" | tail -n 10
fi
# what bounds C3's update kernel (runs O/P: not rows in flight per warp): ncu's memory and
# scheduler sections on two launches of the sgd kernel (benchmarks/bench.py, tbegen alone), into
# fbgemm.log; NCU=0 skips
if [ "${NCU:-1}" = 1 ] && command -v ncu >/dev/null; then
  echo "== ncu, C3 sgd update kernel" >> "$OUT/fbgemm.log"
  CUDA_MODULE_LOADING=LAZY timeout $(cap ${NCU_TIMEOUT:-90}) ncu --clock-control none -k "regex:backward_(group|warp)_kernel" \
    --launch-skip 2 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section Occupancy --section LaunchStats python3 benchmarks/bench.py --configs C3 --opts sgd --warmup 1 --iters 2 \
    --nsets 1 --out /tmp/ncu_bench >> "$OUT/fbgemm.log" 2>&1 || log "ncu failed or timed out"
fi
# the shape sweep beside FBGEMM (benchmarks/sweep_gpu.py, ~140 cells, about a minute on the H200),
# into fbgemm/sweep.json and sweep.md; SWEEP=0 skips (benchmarks/sweep_report.py makes the PNG)
if [ "${SWEEP:-1}" = 1 ]; then
  PYTHONPATH=/tmp/fbg_site:$PYTHONPATH CUDA_MODULE_LOADING=LAZY timeout $(cap ${SWEEP_TIMEOUT:-150}) python3 benchmarks/sweep_gpu.py \
    --budget-s $(( $(cap ${SWEEP_TIMEOUT:-150}) - 25 )) --out "$OUT/fbgemm" >> "$OUT/fbgemm.log" 2>&1 || log "shape sweep failed or timed out"
  grep -E "geometric mean" "$OUT/fbgemm/sweep.md" 2>/dev/null
fi
# the sweep's cells matching SWEEP_AB_ONLY (a regex, default the 1024-wide rows) again with an
# environment switch, SWEEP_AB_ENV (e.g. "TBEGEN_BACKWARD_4WIDE_MAX_D=512"), its table into fbgemm.log
if [ -n "${SWEEP_AB_ENV:-}" ]; then
  echo "== sweep A/B: ${SWEEP_AB_ENV} on cells matching '${SWEEP_AB_ONLY:-D=1024}'" >> "$OUT/fbgemm.log"
  env $SWEEP_AB_ENV PYTHONPATH=/tmp/fbg_site:$PYTHONPATH CUDA_MODULE_LOADING=LAZY timeout $(cap ${SWEEP_AB_TIMEOUT:-60}) \
    python3 benchmarks/sweep_gpu.py --only "${SWEEP_AB_ONLY:-D=1024}" --out /tmp/sweep_ab >> "$OUT/fbgemm.log" 2>&1 \
    || log "sweep A/B failed or timed out"
  cat /tmp/sweep_ab/sweep.md >> "$OUT/fbgemm.log" 2>/dev/null
fi
# the sweep's cells matching SWEEP_PROFILE_ONLY (a regex, e.g. the latency-bound "^(T=1|L=1|B=512) ")
# with each system's kernels per step (sweep_gpu.py --profile): kernel time and launches against the
# step's time, into fbgemm.log and fbgemm/sweep_profile.json
if [ -n "${SWEEP_PROFILE_ONLY:-}" ]; then
  echo "== sweep profile: cells matching '${SWEEP_PROFILE_ONLY}'" >> "$OUT/fbgemm.log"
  PYTHONPATH=/tmp/fbg_site:$PYTHONPATH CUDA_MODULE_LOADING=LAZY timeout $(cap ${SWEEP_PROFILE_TIMEOUT:-60}) \
    python3 benchmarks/sweep_gpu.py --only "$SWEEP_PROFILE_ONLY" --profile --out /tmp/sweep_prof >> "$OUT/fbgemm.log" 2>&1 \
    || log "sweep profile failed or timed out"
  cat /tmp/sweep_prof/sweep.md >> "$OUT/fbgemm.log" 2>/dev/null
  cp /tmp/sweep_prof/sweep.json "$OUT/fbgemm/sweep_profile.json" 2>/dev/null
fi
# host time per forward and backward call on the latency-bound cells, both systems, and the CPU-side
# operators of tbegen's backward (benchmarks/host_overhead.py), into fbgemm.log; HOST=1 runs it
if [ "${HOST:-0}" = 1 ]; then
  echo "== host time per call (benchmarks/host_overhead.py)" >> "$OUT/fbgemm.log"
  PYTHONPATH=/tmp/fbg_site:$PYTHONPATH CUDA_MODULE_LOADING=LAZY timeout $(cap ${HOST_TIMEOUT:-60}) python3 benchmarks/host_overhead.py \
    --out /tmp/host >> "$OUT/fbgemm.log" 2>&1 || log "host_overhead.py failed or timed out"
  cat /tmp/host/host_overhead.md >> "$OUT/fbgemm.log" 2>/dev/null
fi
# variable batch sizes (VBE) beside the fixed-batch path and FBGEMM's padded step (benchmarks/bench_vbe.py),
# its table into fbgemm.log; VBE=1 runs it (fbgemm_subset: the bundle lacks the inference library fbgemm_gpu imports)
if [ "${VBE:-0}" = 1 ]; then
  echo "== VBE (benchmarks/bench_vbe.py)" >> "$OUT/fbgemm.log"
  PYTHONPATH=$PWD/benchmarks/fbgemm_subset:/tmp/fbg_site:$PYTHONPATH CUDA_MODULE_LOADING=LAZY timeout $(cap ${VBE_TIMEOUT:-90}) python3 benchmarks/bench_vbe.py \
    --gathered --rounds ${VBE_ROUNDS:-3} --out /tmp/vbe >> "$OUT/fbgemm.log" 2>&1 || log "bench_vbe.py failed or timed out"
  # what a VBE step dispatches beyond the padded one, with the runtime calls' host time (narrow-skewed's shape)
  echo "== VBE launches per step (benchmarks/vbe_step_ops.py)" >> "$OUT/fbgemm.log"
  timeout $(cap 60) python3 benchmarks/vbe_step_ops.py --device cuda --batch 256 --rows 500000 --pooling-factor 10 \
    --json "$OUT/vbe_step_ops.json" >> "$OUT/fbgemm.log" 2>&1 || log "vbe_step_ops.py failed or timed out"
fi
[ -z "$rest_pid" ] || wait $rest_pid || { status=1; log "build of the other extensions failed"; }
log "all extensions built: $(( $(date +%s) - t0 )) s"
cache_entries "after the build" >> "$OUT/env.txt"

xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n 12")
# (default: every test marked cuda, in every file but those run below with FBGEMM_GPU and TorchRec on
# their path; TEST_FILES names files to run whole instead)
if [ -n "${TEST_FILES:-}" ]; then test_args="$TEST_FILES"; else
  test_args="-m cuda tests --ignore=tests/test_fbgemm_compat.py --ignore=tests/test_torchrec.py --ignore=tests/test_torchrec_config.py"
fi
OMP_NUM_THREADS=2 TBEGEN_RESULTS_DIR="$OUT" timeout $(cap ${TESTS_TIMEOUT:-240}) python3 -m pytest -q -p no:cacheprovider $xdist \
  $test_args ${EXTRA_TESTS:-} > "$OUT/pytest_cuda.log" 2>&1 || status=1
# a test whose xdist worker crashed: again, alone, with Python's fault handler (its stack, if any)
for t in $(grep -oE "crashed while running '[^']+'" "$OUT/pytest_cuda.log" | sed -E "s/.*'(.*)'/\1/"); do
  echo "== alone: $t" >> "$OUT/pytest_cuda.log"
  OMP_NUM_THREADS=2 timeout $(cap 60) python3 -X faulthandler -m pytest -q -p no:cacheprovider -p no:xdist "$t" >> "$OUT/pytest_cuda.log" 2>&1
  echo "== exit status $?" >> "$OUT/pytest_cuda.log"
done
# what only a process alone on the GPU can measure (the device's free memory after the 2 MB host
# kinds' deleters), again without xdist
if [ -z "${TEST_FILES:-}" ]; then
  echo "== alone: tests/test_host_huge.py::test_cuda_the_deleters_free" >> "$OUT/pytest_cuda.log"
  OMP_NUM_THREADS=2 timeout $(cap 60) python3 -m pytest -q -p no:cacheprovider -p no:xdist \
    tests/test_host_huge.py::test_cuda_the_deleters_free 2>&1 | tail -n 3 >> "$OUT/pytest_cuda.log"
fi
grep -E "^(FAILED|ERROR)|passed|failed|^== (alone|exit)" "$OUT/pytest_cuda.log" | tail -n 15
python3 benchmarks/summarize_results.py "$OUT" > "$OUT/numerics_table.md" 2>&1
rm -f "$OUT"/harness_results_*.jsonl "$OUT"/*.jsonl

# the authoring loop on the GPU (issue 26): a new optimizer from `tbegen new`, validated, built and
# tested on the device, each step timed, into extras.log; AUTHOR=1 runs it
# (a name of its own per run, so that nothing of it is cached; the machine's load average first:
# the build splits its translation units only where cores are idle; then the build alone, the
# --quick library and the full one of two more new names, benchmarks/tools/time_cuda_quick_build.py)
if [ "${AUTHOR:-0}" = 1 ]; then
  log "authoring loop: tbegen new, validate, test --device cuda --quick (load average $(cut -d' ' -f1-3 /proc/loadavg))"
  probe=gpu_probe_$(date +%s)
  ( cd /tmp && rm -rf author && mkdir author && cd author && \
    { /usr/bin/time -f "tbegen new: %e s" python3 -m tbegen new $probe && \
      /usr/bin/time -f "tbegen validate: %e s" python3 -m tbegen validate $probe.yaml && \
      /usr/bin/time -f "tbegen test --device cuda --quick (first): %e s" timeout $(cap 120) python3 -m tbegen test --optimizer $probe.yaml --device cuda --quick && \
      /usr/bin/time -f "tbegen test --device cuda --quick (cached): %e s" timeout $(cap 60) python3 -m tbegen test --optimizer $probe.yaml --device cuda --quick; } 2>&1 | tail -n 30 ) >> "$OUT/extras.log"
  for kind in "" --full; do
    timeout $(cap 120) python3 benchmarks/tools/time_cuda_quick_build.py $kind 2>&1 | grep -v "^tbegen: \(building\|still\)" | tail -n 4 >> "$OUT/extras.log"
  done
fi
# what mode="reduce-overhead" hands the CUDA-graph trees (benchmarks/tools/compile_probe.py), into
# extras.log; COMPILE_PROBE=1 runs it
if [ "${COMPILE_PROBE:-0}" = 1 ]; then
  log "torch.compile reduce-overhead probe"
  timeout $(cap 300) python3 benchmarks/tools/compile_probe.py 2>&1 | grep -E "^step|^== variant|^[0-9]+ steps|^  pointer|^variant|^tuple-ops|^pool check" | tail -n 48 >> "$OUT/extras.log"
fi
[ "${SANITIZE:-1}" = 1 ] && for tool in memcheck racecheck; do
  log "compute-sanitizer --tool $tool"
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout $(cap ${SANITIZE_TIMEOUT:-70}) compute-sanitizer --tool $tool --print-limit 20 \
    python3 benchmarks/sanitize_cases.py rowwise_adagrad adam > "$OUT/sanitize.tmp" 2>&1 || status=1
  { echo "== $tool"; tail -n 60 "$OUT/sanitize.tmp"; } >> "$OUT/extras.log"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/sanitize.tmp" | tail -n 1; rm -f "$OUT/sanitize.tmp"
done
# managed_caching beside all-device placement and FBGEMM's MANAGED_CACHING (benchmarks/bench_cache.py,
# its default shape: a quarter of C2), its table into extras.log; CACHE_BENCH=0 skips
if [ "${CACHE_BENCH:-1}" = 1 ]; then
  log "benchmarks/bench_cache.py"
  PYTHONPATH=/tmp/fbg_site:$PYTHONPATH CUDA_MODULE_LOADING=LAZY timeout $(cap ${CACHE_TIMEOUT:-90}) python3 benchmarks/bench_cache.py \
    ${CACHE_OPTS:-} --out /tmp/cache_bench > /tmp/cache_bench.log 2>&1 || log "bench_cache.py failed or timed out"
  { tail -n 5 /tmp/cache_bench.log; cat /tmp/cache_bench/results.md 2>/dev/null; } >> "$OUT/extras.log"
fi
# (FBGEMM_DIFF=0 skips them: a call that has run them on the same tree)
if [ "${FBGEMM_DIFF:-1}" = 1 ]; then
  log "FBGEMM_GPU differential tests"
  # (FBGEMM's per-call "TBE B200 optimization" warnings left out; a failure's short traceback kept)
  TBEGEN_RESULTS_DIR="$OUT/fbgemm" PYTHONPATH=/tmp/fbg_site:$PYTHONPATH timeout $(cap 120) python3 -m pytest -q -p no:cacheprovider \
    -rf --tb=short -m cuda tests/test_fbgemm_compat.py 2>&1 \
    | grep -v "TBE B200 optimization\|return Variable._execution_engine\|^tests/test_fbgemm_compat.py::test_gpu_matches_fbgemm\|^ *$" \
    | tail -n 40 >> "$OUT/extras.log"
fi
log "TorchRec over NCCL, one rank"
# (benchmarks/fbgemm_subset on PYTHONPATH: every process, the spawned ranks too, imports fbgemm_gpu
# from the bundle, which has FBGEMM_GPU's training libraries only)
TRC_PATH=$PWD/benchmarks/fbgemm_subset:/tmp/site:/tmp/fbg_site:$PYTHONPATH
# FBGEMM's per-library "compat table has no entry" warnings and TorchRec's planner warnings left out
quiet() { grep -v "compat_table\|cannot determine\|\[0m\|\[33m\|^WARNING:root:$\|^WARNING:torchrec\|^ *$"; }
PYTHONPATH=$TRC_PATH timeout $(cap 150) python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_torchrec.py 2>&1 \
  | quiet | tail -n 25 >> "$OUT/extras.log"
# TorchRec's PrefetchTrainPipelineSparseDist with cached tables (its CUDA cases need TorchRec on the
# path; the CUDA test step above skipped them)
PYTHONPATH=$TRC_PATH timeout $(cap 150) python3 -m pytest -q -p no:cacheprovider -m cuda tests/test_prefetch_pipeline.py \
  tests/test_torchrec_vbe.py 2>&1 | quiet | tail -n 15 >> "$OUT/extras.log"
# the TorchRec way against FBGEMM_GPU (adam and row-wise included), -s for its measured differences
PYTHONPATH=$TRC_PATH timeout $(cap 150) python3 -m pytest -q -s -p no:cacheprovider -m cuda tests/test_torchrec_config.py 2>&1 \
  | quiet | grep -v "^\[rank\|^\[W" | tail -n 25 >> "$OUT/extras.log"
PYTHONPATH=$TRC_PATH timeout $(cap 150) torchrun --nproc_per_node=1 examples/torchrec_training.py 2>&1 \
  | quiet | tail -n 40 >> "$OUT/extras.log"
tail -n 30 "$OUT/extras.log"

exit $status
