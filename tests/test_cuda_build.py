"""Every generated CUDA extension compiles and links (no GPU needed: CI has none).

Skipped only where no CUDA toolchain exists (no nvcc, or a CPU-only torch build, which lacks
torch's CUDA headers). Builds go to tbegen's content-addressed cache, in parallel processes.
"""

import shutil
import subprocess
import sys

import pytest
import torch

from tbegen import build
from tbegen.spec import list_specs, load_spec

pytestmark = pytest.mark.skipif(
    shutil.which("nvcc") is None or torch.version.cuda is None,
    reason="needs nvcc and a CUDA build of torch to compile the CUDA extensions",
)


@pytest.fixture(scope="module")
def cuda_libraries():
    specs = list_specs()
    build.prebuild(specs, with_cuda=True)
    libs = {}
    for p in specs:
        spec = load_spec(str(p))
        libs[spec.name] = build.build_files(spec.name, build.spec_files(spec, True), True, load=False)
    return libs


@pytest.mark.parametrize("name", [p.stem for p in list_specs()])
def test_cuda_extension_builds_and_registers_its_operators(cuda_libraries, name):
    lib = cuda_libraries[name]
    assert lib.is_file()
    # load in a fresh process (this one may hold the CPU-only build of the same operators) and
    # check that the CUDA implementations are registered
    code = (
        "import torch, sys\n"
        f"torch.ops.load_library({str(lib)!r})\n"
        f"ns = torch.ops.tbegen_{name}\n"
        "for op in ('forward', 'grad_per_sample_weights', 'backward'):\n"
        "    assert torch._C._dispatch_has_kernel_for_dispatch_key(f'tbegen_" + name + "::{op}', 'CUDA'), op\n"
        "    assert torch._C._dispatch_has_kernel_for_dispatch_key(f'tbegen_" + name + "::{op}', 'CPU'), op\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]
