# Shared by the GPU experiment scripts (run_variants.sh, run_gpu_ab.sh): source it from
# the repository root after setting OUT.

# The machine and software of the run, into $OUT/env.txt (and the terminal).
gpu_env_header() {
  {
    date -u +"date: %Y-%m-%d %H:%M UTC"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | sed 's/^/gpu: /'
    python3 -c "import torch, sys; print('python:', sys.version.split()[0]); print('torch:', torch.__version__, 'cuda', torch.version.cuda)"
    nvcc --version | tail -n 2 | head -n 1 | sed 's/^/nvcc: /'
    echo "tree: ${TREE:-unknown}"
  } | tee "$OUT/env.txt"
}

# FBGEMM_GPU from the carried bundle (.anchor) into /tmp/fbg_site.
unpack_fbgemm() {
  python3 .anchor/unpack_bundle.py .anchor/bundle /tmp/fbg_site > /dev/null 2>&1 || echo "FBGEMM bundle did not unpack"
}

# The build cache's entries (NAME-KIND-KEY folders) on one line, for env.txt: a later call that
# rebuilds what an earlier one built shows which key changed (landing11 and landing12 each rebuilt
# specs a call after building them, the cause not yet known).
cache_entries() {
  echo "build cache entries ($1): $(ls -1 "${TBEGEN_BUILD_DIR:-build/tbegen-cache}" 2>/dev/null | grep -v '^locks$' | sort | tr '\n' ' ')"
}

# Builds the named specs' CUDA extensions into the cache, logging to LOG; prints the time taken.
# Returns non-zero if the build failed.
build_specs() {
  local log=$1; shift
  local t0 rc
  cache_entries "before the build" >> "$OUT/env.txt"
  t0=$(date +%s)
  python3 -c "
import sys; from tbegen import build; from tbegen.spec import find_spec
build.prebuild([find_spec(n) for n in sys.argv[1:]], with_cuda=True)" "$@" > "$log" 2>&1
  rc=$?
  [ $rc -ne 0 ] && echo "build failed"
  echo "== build: $(( $(date +%s) - t0 )) s" | tee -a "$log"
  cache_entries "after the build" >> "$OUT/env.txt"
  return $rc
}
