set -u
export TORCH_CUDA_ARCH_LIST=9.0 TBEGEN_BUILD_DIR=$PWD/build/tbegen-cache PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 .anchor/unpack_bundle.py .anchor/bundle /tmp/fbg_site > /dev/null 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > /dev/null 2>&1
t0=$(date +%s)
python3 -c "
from tbegen import build; from tbegen.spec import find_spec
build.prebuild([find_spec(n) for n in ['sgd','adam','rowwise_adagrad','adagrad_with_momentum']], with_cuda=True)" > $OUT/build.log 2>&1
echo "build $(( $(date +%s) - t0 )) s"
timeout 60 python3 -X faulthandler benchmarks/diag_managed.py > $OUT/diag.log 2>&1; echo "diag exit $?" | tee -a $OUT/diag.log
timeout 120 cuda-gdb -batch -ex run -ex bt --args python3 benchmarks/diag_managed.py > $OUT/gdb.log 2>&1; echo "gdb exit $?"
grep -E "^-- |raised|returned|done|SIG|^#" $OUT/diag.log $OUT/gdb.log | head -60
OMP_NUM_THREADS=2 timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 -m cuda tests/test_placements.py > $OUT/placements.log 2>&1; tail -n 5 $OUT/placements.log
PYTHONPATH=/tmp/site:/tmp/fbg_site:$PYTHONPATH timeout 150 python3 benchmarks/with_fbgemm_subset.py -m pytest -q -p no:cacheprovider -m cuda tests/test_torchrec.py > $OUT/torchrec.log 2>&1; tail -n 5 $OUT/torchrec.log
PYTHONPATH=/tmp/site:/tmp/fbg_site:$PYTHONPATH timeout 150 torchrun --nproc_per_node=1 benchmarks/with_fbgemm_subset.py examples/torchrec_training.py > $OUT/torchrec_example.log 2>&1; echo "example exit $?"; tail -n 25 $OUT/torchrec_example.log
