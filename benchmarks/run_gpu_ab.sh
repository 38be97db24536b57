#!/usr/bin/env bash
# Opt-in kernel variants against the defaults, in one device call (from the repository root; carry
# .anchor): each A/B times the sweep's matching cells (benchmarks/sweep_gpu.py, FBGEMM_GPU and tbegen
# in one process) with the defaults, then with the variant's environment switch, so that both
# halves come from the same machine minutes apart and FBGEMM's two timings show the noise.
#
#   SWEEP_ABS   A/Bs separated by ';', each "ENV=VALUE[,ENV2=VALUE2]@REGEX" (REGEX as sweep_gpu --only)
#   VBE         1: bench_vbe.py's whole table beside FBGEMM's padded step (--gathered, VBE_ROUNDS rounds)
#               and vbe_step_ops.py's runtime calls per step, here where nothing builds beside them
#               (the small VBE cases are host-bound: a build at low priority still takes host time)
#   VBE_AB      an environment switch for bench_vbe.py's cases in VBE_CASES (default mild-large),
#               tbegen alone, defaults then the switch (e.g. TBEGEN_VBE_GRAD_OFFSETS=1); with
#               VBE_AB_OPS=1 also vbe_step_ops.py on each side (vbe_step_ops_ab_0.json, _1.json)
#   NCU_ONLY    a sweep cell regex: ncu's SpeedOfLight and MemoryWorkloadAnalysis sections on the
#               backward kernels of both systems in that cell (L2 hit rate, DRAM throughput)
#   NCU_AB      an environment switch (ENV=VALUE[,...]): tbegen's kernels under ncu again with it
#   PROFILE_ONLY a sweep cell regex: each system's kernels per step in those cells (sweep_gpu --profile)
#   TEST_FILES  CUDA tests to run first (the variants' own bitwise tests)
#   BUILD_SPECS the extensions to build first (default the four the sweep times)
#   DEADLINE    seconds for the whole script (default 570)
# Output under $OUT: ab.log (every table), ab.json (each A/B's sweep.json pair), profile.json, build.log,
# vbe.json and vbe_step_ops.json (VBE=1), vbe_ab_0.log / vbe_ab_1.log (VBE_AB's two sides, whole), env.txt.
set -u
OUT=${OUT:-/tmp/tbegen-gpu-out}
mkdir -p "$OUT"
export TORCH_CUDA_ARCH_LIST=9.0 TBEGEN_BUILD_DIR=$PWD/build/tbegen-cache PYTHONPATH=$PWD PYTHONUNBUFFERED=1
t_start=$(date +%s)
cap() { local left=$(( ${DEADLINE:-570} - ($(date +%s) - t_start) )); [ $left -lt 5 ] && left=5; echo $(( $1 < left ? $1 : left )); }
log() { echo "== $*" | tee -a "$OUT/ab.log"; }
# (the env header, FBGEMM's bundle and the build: benchmarks/tools/gpu_common.sh, as run_variants.sh)
source benchmarks/tools/gpu_common.sh
gpu_env_header
unpack_fbgemm | tee -a "$OUT/ab.log"
# shellcheck disable=SC2086
build_specs "$OUT/build.log" ${BUILD_SPECS:-sgd rowwise_adagrad adagrad adam} | tee -a "$OUT/ab.log"

if [ -n "${TEST_FILES:-}" ]; then
  log "tests: $TEST_FILES"
  xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8")
  timeout $(cap ${TESTS_TIMEOUT:-120}) python3 -m pytest -q -p no:cacheprovider $xdist $TEST_FILES 2>&1 | tail -n 8 >> "$OUT/ab.log"
  tail -n 1 "$OUT/ab.log"
fi

echo "{" > "$OUT/ab.json"
IFS=';' read -ra abs <<< "${SWEEP_ABS:-}"
for ab in "${abs[@]}"; do
  [ -z "$ab" ] && continue
  envs=${ab%%@*}; only=${ab#*@}
  for side in defaults "$envs"; do
    log "sweep A/B, $side, cells matching '$only'"
    rm -rf /tmp/sweep_ab
    [ "$side" = defaults ] && e="" || e=$(echo "$side" | tr ',' ' ')
    env $e PYTHONPATH=/tmp/fbg_site:$PYTHONPATH CUDA_MODULE_LOADING=LAZY timeout $(cap ${SWEEP_AB_TIMEOUT:-90}) \
      python3 benchmarks/sweep_gpu.py --only "$only" --out /tmp/sweep_ab >> /tmp/sweep_ab.log 2>&1 || log "failed or timed out"
    cat /tmp/sweep_ab/sweep.md >> "$OUT/ab.log" 2>/dev/null
    # (the defaults' key names the A/B it belongs to: two A/Bs on the same cells keep both halves)
    key=$side; [ "$side" = defaults ] && key="defaults (beside $envs)"
    [ -f /tmp/sweep_ab/sweep.json ] && { printf '"%s | %s": ' "$only" "$key"; cat /tmp/sweep_ab/sweep.json; echo ","; } >> "$OUT/ab.json"
  done
done
echo '"end": null}' >> "$OUT/ab.json"

if [ -n "${PROFILE_ONLY:-}" ]; then
  log "sweep profile, cells matching '$PROFILE_ONLY'"
  PYTHONPATH=/tmp/fbg_site:$PYTHONPATH CUDA_MODULE_LOADING=LAZY timeout $(cap ${PROFILE_TIMEOUT:-60}) \
    python3 benchmarks/sweep_gpu.py --only "$PROFILE_ONLY" --profile --out /tmp/sweep_prof >> /tmp/sweep_ab.log 2>&1 || log "failed or timed out"
  cat /tmp/sweep_prof/sweep.md >> "$OUT/ab.log" 2>/dev/null; cp /tmp/sweep_prof/sweep.json "$OUT/profile.json" 2>/dev/null
fi

if [ "${VBE:-0}" = 1 ]; then
  log "bench_vbe.py beside FBGEMM's padded step"
  PYTHONPATH=$PWD/benchmarks/fbgemm_subset:/tmp/fbg_site:$PYTHONPATH CUDA_MODULE_LOADING=LAZY timeout $(cap ${VBE_TIMEOUT:-100}) \
    python3 benchmarks/bench_vbe.py --gathered --rounds ${VBE_ROUNDS:-3} --out /tmp/vbe_full > /tmp/vbe_full.log 2>&1 || log "failed or timed out"
  tail -n 30 /tmp/vbe_full.log >> "$OUT/ab.log"; cp /tmp/vbe_full/results.json "$OUT/vbe.json" 2>/dev/null
  log "vbe_step_ops.py (runtime calls, Python calls and tbegen lines per step)"
  timeout $(cap 60) python3 benchmarks/vbe_step_ops.py --device cuda --batch 256 --rows 500000 --pooling-factor 10 \
    --python --json "$OUT/vbe_step_ops.json" >> "$OUT/ab.log" 2>&1 || log "failed or timed out"
fi

if [ -n "${VBE_AB:-}" ]; then
  n=0
  for side in defaults "$VBE_AB"; do
    log "bench_vbe.py, $side, cases ${VBE_CASES:-mild-large} (whole output: vbe_ab_$n.log)"
    [ "$side" = defaults ] && e="" || e=$(echo "$side" | tr ',' ' ')
    env $e timeout $(cap ${VBE_TIMEOUT:-90}) python3 benchmarks/bench_vbe.py --cases ${VBE_CASES:-mild-large} --no-fbgemm \
      --rounds ${VBE_ROUNDS:-3} --out /tmp/vbe_ab 2>&1 | tee "$OUT/vbe_ab_$n.log" | tail -n 12 >> "$OUT/ab.log" || log "failed or timed out"
    if [ "${VBE_AB_OPS:-0}" = 1 ]; then
      log "vbe_step_ops.py, $side (vbe_step_ops_ab_$n.json)"
      env $e timeout $(cap 60) python3 benchmarks/vbe_step_ops.py --device cuda --batch 256 --rows 500000 --pooling-factor 10 \
        --python --json "$OUT/vbe_step_ops_ab_$n.json" >> "$OUT/ab.log" 2>&1 || log "failed or timed out"
    fi
    n=$((n + 1))
  done
fi

if [ -n "${NCU_ONLY:-}" ] && command -v ncu > /dev/null; then
  for run in "defaults|regex:backward_(warp|segment|finish|group)_kernel" "defaults|regex:split_embedding_backward_codegen" \
             ${NCU_AB:+"$NCU_AB|regex:backward_(warp|segment|finish|group)_kernel"}; do
    side=${run%%|*}; k=${run#*|}
    [ "$side" = defaults ] && e="" || e=$(echo "$side" | tr ',' ' ')
    log "ncu $k, cell '$NCU_ONLY', $side"
    env $e PYTHONPATH=/tmp/fbg_site:$PYTHONPATH CUDA_MODULE_LOADING=LAZY timeout $(cap ${NCU_TIMEOUT:-100}) ncu --clock-control none \
      -k "$k" --launch-skip ${NCU_SKIP:-2} --launch-count ${NCU_COUNT:-4} --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section Occupancy python3 benchmarks/sweep_gpu.py --only "$NCU_ONLY" --nsets 2 --warmup 2 --iters 2 --rounds 1 \
      --out /tmp/ncu_sweep 2>&1 | grep -vE "^==PROF==|Warning" | grep -E "kernel|Hit Rate|Throughput|Duration|Memory \[%\]|Achieved Occupancy|Registers|Block Size|Grid Size|Theoretical Occ|Mem Busy|Max Bandwidth|L1/TEX|L2" >> "$OUT/ab.log" \
      || log "ncu failed or timed out"
  done
fi
log "done in $(( $(date +%s) - t_start )) s"
