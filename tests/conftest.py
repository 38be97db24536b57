"""Shared fixtures: each optimizer's extension is built once per test session (in parallel, into
tbegen's content-addressed cache) and loaded once per process."""

import os
import shutil

import pytest
import torch

from tbegen import build
from tbegen.spec import list_specs, load_spec

# TBEGEN_TEST_OPTIMIZERS="sgd adam" narrows the optimizer-parametrised tests to those specs (for
# quick runs on the GPU machine); unset, every spec in optimizers/ is tested.
_ONLY = os.environ.get("TBEGEN_TEST_OPTIMIZERS", "").split()
SPECS = {p.stem: p for p in list_specs() if not _ONLY or p.stem in _ONLY}
if _ONLY and sorted(SPECS) != sorted(set(_ONLY)):
    raise pytest.UsageError(f"TBEGEN_TEST_OPTIMIZERS names unknown specs: {sorted(set(_ONLY) - set(SPECS))}")
HAS_CUDA = torch.cuda.is_available()
# CUDA extensions are compiled and linked wherever a CUDA toolchain exists, GPU or not
# (test_cuda_build.py; a CPU-only torch lacks the CUDA headers)
CAN_BUILD_CUDA = shutil.which("nvcc") is not None and torch.version.cuda is not None


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def prebuilt(request):
    """Builds every extension this session needs once, in parallel, before the first test needs
    one: each spec for this machine's device, and for CUDA too where test_cuda_build.py will
    compile them. Progress goes to the terminal (pytest would otherwise hold it back)."""
    flavours = {HAS_CUDA}
    if CAN_BUILD_CUDA and any(item.path.name == "test_cuda_build.py" for item in request.session.items):
        flavours.add(True)
    with terminal_output(request):
        build.prebuild(list(SPECS.values()), sorted(flavours))
    return True


def terminal_output(request):
    """A context in which output (also of child processes) reaches the terminal uncaptured."""
    capture = request.config.pluginmanager.getplugin("capturemanager")
    return capture.global_and_fixture_disabled()


_OPS = {}


@pytest.fixture(scope="session")
def load_ops(prebuilt):
    """load_ops(name) -> (spec, torch.ops.tbegen_NAME), for the device this machine has."""

    def load(name):
        if name not in _OPS:
            spec = load_spec(str(SPECS[name]))
            _OPS[name] = (spec, build.load_ops(spec, with_cuda=HAS_CUDA))
        return _OPS[name]

    return load


# ---- numerical results, for the record -------------------------------------------------------
# Each harness run is appended here; with $TBEGEN_RESULTS_DIR set, every test process writes its
# share as JSON lines at the end of the session (benchmarks/summarize_results.py makes the table).
_RESULTS = []


@pytest.fixture(scope="session")
def record_result():
    def record(name, device, result):
        _RESULTS.append(
            dict(optimizer=name, device=device, case=result.case.id,
                 dtype=str(result.case.weights_dtype).replace("torch.", ""),
                 errors=result.errors, failures=result.failures)
        )

    return record


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("TBEGEN_RESULTS_DIR")
    if not out or not _RESULTS:
        return
    import json
    from pathlib import Path

    Path(out).mkdir(parents=True, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(Path(out) / f"harness_results_{worker}.jsonl", "w") as f:
        for r in _RESULTS:
            f.write(json.dumps(r) + "\n")
