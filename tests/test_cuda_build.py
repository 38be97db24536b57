"""Every generated CUDA extension compiles and links (no GPU needed: CI has none).

Skipped only where no CUDA toolchain exists (no nvcc, or a CPU-only torch build, which lacks
torch's CUDA headers). The session's `prebuilt` fixture builds them, in parallel with the CPU
builds, into tbegen's content-addressed cache; here one fresh process loads them all and reports
which operators each registers.
"""

import json
import subprocess
import sys

import pytest

from conftest import CAN_BUILD_CUDA, SPECS, terminal_output
from tbegen import build
from tbegen.spec import list_specs, load_spec

pytestmark = pytest.mark.skipif(
    not CAN_BUILD_CUDA, reason="needs nvcc and a CUDA build of torch to compile the CUDA extensions"
)

OPS = ("forward", "grad_per_sample_weights", "backward")
# The managed-memory operators of the runtime (include/tbegen/managed_memory.h): defined only in
# CUDA builds, with catch-all kernels (managed_empty has no tensor argument to dispatch on).
MANAGED_OPS = ("managed_empty", "managed_advise", "memory_kind", "managed_preferred_location", "host_empty_huge",
               "split_empty")


@pytest.fixture(scope="module")
def registered(prebuilt, request):
    """{optimizer: {operator: [has a CUDA kernel, has a CPU kernel]}} of every CUDA library, loaded
    in a fresh process (this one may hold the CPU-only builds of the same operators)."""
    specs = list(SPECS.values())  # every spec, unless TBEGEN_TEST_OPTIMIZERS narrows them
    with terminal_output(request):
        build.prebuild(specs, [True])  # (built already by the session's prebuilt fixture)
    libs = {}
    for p in specs:
        spec = load_spec(str(p))
        # (table_update exists for specs with whole-table stages only)
        ops = list(OPS) + (["table_update"] if spec.table_stages or spec.table_reductions else [])
        libs[spec.name] = (str(build.build_files(spec.name, build.spec_files(spec, True), True, load=False)), ops)
    code = (
        "import json, sys, torch\n"
        "libs = json.loads(sys.argv[1]); has = torch._C._dispatch_has_kernel_for_dispatch_key\n"
        "out = {}\n"
        "for name, (lib, ops) in libs.items():\n"
        "    torch.ops.load_library(lib)\n"
        f"    out[name] = {{op: [has(f'tbegen_{{name}}::{{op}}', 'CUDA'), has(f'tbegen_{{name}}::{{op}}', 'CPU')]\n"
        f"                 for op in ops}}\n"
        f"    out[name].update({{op: [has(f'tbegen_{{name}}::{{op}}', 'CompositeImplicitAutograd')]\n"
        f"                      for op in {MANAGED_OPS!r}}})\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(libs)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(SPECS))
def test_cuda_extension_builds_and_registers_its_operators(registered, name):
    ops = OPS + (("table_update",) if load_spec(str(SPECS[name])).table_stages or load_spec(str(SPECS[name])).table_reductions else ())
    assert registered[name] == {**{op: [True, True] for op in ops}, **{op: [True] for op in MANAGED_OPS}}


def test_managed_memory_operators_check_arguments_without_a_gpu(prebuilt):
    """The runtime's managed-memory operators are reachable through the dispatcher (catch-all
    kernels; managed_empty has no tensor argument) and refuse bad arguments before any CUDA call,
    so this runs on a machine without a GPU. What they do on a GPU: tests/test_placements.py."""
    spec = load_spec(str(next(p for p in list_specs() if p.stem == "sgd")))
    lib = str(build.build_files(spec.name, build.spec_files(spec, True), True, load=False))
    code = (
        "import sys, torch\n"
        "torch.ops.load_library(sys.argv[1]); ops = torch.ops.tbegen_sgd\n"
        "for call in (lambda: ops.managed_empty(4, torch.float32, torch.device('cpu')),\n"
        "             lambda: ops.managed_empty(-1, torch.float32, torch.device('cuda')),\n"
        "             lambda: ops.managed_advise(torch.zeros(4), 0, 4, 'hbm'),\n"
        "             lambda: ops.managed_advise(torch.zeros(4), 0, 4, 'host'),\n"
        "             lambda: ops.host_empty_huge(4, torch.float32, torch.device('cpu')),\n"
        "             lambda: ops.host_empty_huge(-1, torch.float32, torch.device('cuda')),\n"
        "             lambda: ops.split_empty(8, torch.float32, torch.device('cuda'), [0, 4, 6]),\n"
        "             lambda: ops.split_empty(8, torch.float32, torch.device('cuda'), [6, 4]),\n"
        "             lambda: ops._exchange_rows(torch.zeros(4, 2), torch.arange(2), None, torch.arange(2), 0),\n"
        "             lambda: ops._exchange_rows_with_states(torch.zeros(4, 2), torch.arange(2), None, torch.arange(2),\n"
        "                                                    [torch.zeros(4)], torch.arange(2), None, torch.arange(2), 0),\n"
        "             lambda: ops._sort_keys(torch.arange(4, dtype=torch.int32), 5)):\n"
        "    try:\n"
        "        call()\n"
        "        print('no error')\n"
        "    except RuntimeError as e:\n"
        "        print(str(e).splitlines()[0])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, lib], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-11:] == [
        "tbegen: managed_empty: device must be a CUDA device, got cpu",
        "tbegen: managed_empty: numel must be >= 0, got -1",
        "tbegen: managed_advise: location must be 'host' or 'device', got 'hbm'",
        "tbegen: managed_advise: the tensor must be a contiguous CUDA tensor",
        "tbegen: host_empty_huge: device must be a CUDA device, got cpu",
        "tbegen: host_empty_huge: numel must be >= 0, got -1",
        "tbegen: split_empty: device_ranges must be (start, count) pairs, got 3 numbers",
        "tbegen: split_empty: device range [6, 10) is not inside the 8 elements",
        "tbegen: _exchange_rows: rows must be on a CUDA device, got cpu",
        "tbegen: _exchange_rows_with_states: rows must be on a CUDA device, got cpu",
        "tbegen: _sort_keys: keys must be on a CUDA device, got cpu",
    ]


def test_the_device_code_is_what_cuda_code_says(registered):
    """Without a GPU (CI) the CUDA builds make PTX only (build.cuda_code); with one, machine code.
    Read from the build file each cache entry keeps."""
    spec = load_spec(str(next(iter(SPECS.values()))))
    lib = build.build_files(spec.name, build.spec_files(spec, True), True, load=False)
    ninja = (lib.parent / "build.ninja").read_text()
    caps = build._compute_capabilities(build.cuda_arch_list())
    if build.cuda_code() == "ptx":
        assert all(f"code=compute_{c}" in ninja for c in caps) and "code=sm_" not in ninja
    else:
        assert all(f"code=sm_{c}" in ninja for c in caps)
