"""Shared fixtures: each optimizer's extension is built once per test session (in parallel, into
tbegen's content-addressed cache) and loaded once per process."""

import os

import pytest
import torch

from tbegen import build
from tbegen.spec import list_specs, load_spec

SPECS = {p.stem: p for p in list_specs()}
HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def prebuilt():
    """Builds every spec's extension once, in parallel processes, before the first test needs one."""
    build.prebuild(list(SPECS.values()), with_cuda=HAS_CUDA)
    return True


_OPS = {}


@pytest.fixture(scope="session")
def load_ops(prebuilt):
    """load_ops(name) -> (spec, torch.ops.tbegen_NAME), for the device this machine has."""

    def load(name):
        if name not in _OPS:
            spec = load_spec(str(SPECS[name]))
            _OPS[name] = (spec, build.load_spec(spec, with_cuda=HAS_CUDA))
        return _OPS[name]

    return load
