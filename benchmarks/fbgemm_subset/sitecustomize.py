"""On PYTHONPATH, imports fbgemm_gpu from the GPU machine's training-only FBGEMM_GPU bundle at the
start of every Python process, the ones TorchRec's tests spawn included (see
benchmarks/with_fbgemm_subset.py, which does it for one process)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
try:
    from with_fbgemm_subset import import_fbgemm_subset

    import_fbgemm_subset()
finally:
    sys.path.pop(0)
