#!/usr/bin/env python3
"""Runs a script or module with fbgemm_gpu imported from a subset of its libraries (the GPU
machine's FBGEMM_GPU bundle keeps only the training libraries: ../shared/tools/fbgemm-anchor).
fbgemm_gpu loads every library its package lists; here a listed library that is absent is
skipped instead of failing the import, as the referee (bench_tbe.py) does.

    python3 benchmarks/with_fbgemm_subset.py -m pytest -m cuda tests/test_torchrec.py
    torchrun --nproc_per_node=1 benchmarks/with_fbgemm_subset.py examples/torchrec_training.py
"""

import os
import runpy
import sys

import torch


def import_fbgemm_subset() -> list:
    """Imports fbgemm_gpu (and fbgemm_gpu.sparse_ops, which TorchRec imports) from the subset;
    returns the names of the libraries that were absent."""
    skipped = []
    load = torch.ops.load_library
    has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key

    def load_if_present(path):
        if not os.path.exists(path):
            skipped.append(os.path.basename(str(path)))
            return
        load(path)

    def has_kernel_or_absent(op_name, key):
        # sparse_ops registers fake kernels for every operator, the absent libraries' too; it skips
        # an operator that already has one, so an absent operator is reported as having one
        try:
            return has_kernel(op_name, key)
        except RuntimeError as e:
            if "does not exist" in str(e):
                return True
            raise

    def absent(op_name) -> bool:
        try:
            has_kernel(op_name, "CompositeImplicitAutograd")
            return False
        except RuntimeError as e:
            return "does not exist" in str(e)

    def skipping_absent(register):
        def wrapper(op_name, *args, **kwargs):
            if isinstance(op_name, str) and absent(op_name):
                return None
            return register(op_name, *args, **kwargs)

        return wrapper

    registers = {name: getattr(torch.library, name) for name in ("register_fake", "register_autograd")}
    torch.ops.load_library = load_if_present
    torch._C._dispatch_has_kernel_for_dispatch_key = has_kernel_or_absent
    for name, register in registers.items():
        setattr(torch.library, name, skipping_absent(register))
    try:
        import fbgemm_gpu  # noqa: F401
        import fbgemm_gpu.sparse_ops  # noqa: F401
    finally:
        torch.ops.load_library = load
        torch._C._dispatch_has_kernel_for_dispatch_key = has_kernel
        for name, register in registers.items():
            setattr(torch.library, name, register)
    return skipped


if __name__ == "__main__":
    skipped = import_fbgemm_subset()
    print(f"with_fbgemm_subset: fbgemm_gpu imported; skipped absent libraries {skipped}", flush=True)
    args = sys.argv[1:]
    if args[:1] == ["-m"]:
        sys.argv = [args[1]] + args[2:]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        runpy.run_path(args[0], run_name="__main__")
