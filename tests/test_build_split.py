"""How a CPU build compiles an optimizer's ops.cpp does not change what it computes (issue 26, the
authoring loop's time; tbegen/build.py, `_ops_sources` and `spec_files(..., fp32_weights_only)`).

- With two cores free, ops.cpp is compiled as two translation units side by side (TBEGEN_OPS_PART
  1 and 2); builds run two at a time (prebuild, MAX_JOBS=1: the test session's own builds)
  compile it whole. Same code, same flags: the same results, bit for bit.
- `tbegen test --quick` builds a library of its own whose backward takes float32 weights only:
  for float32 weights it computes exactly what the full library computes; other weights get an
  error that says why.

One build here in CI (the float32-weights library of one spec, split: about 9 CPU s); the full
library is the session's prebuilt one (whole: prebuild runs builds side by side). Elsewhere the
test builds whichever of the two its cache holds compiled the other way, in a cache of its own.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tbegen import build
from tbegen.spec import load_spec

from conftest import SPECS

ROOT = Path(__file__).resolve().parent.parent
# per-element, per-row, int and per-table states, a whole-table stage (table_update, in part 1)
SPEC = "rowwise_adagrad_with_counter"

# Runs every float32 case of `tbegen test --quick` through `backward` and `backward_lane_split`
# (and `table_update`) of one library, saving what they leave in the weights and states.
RUN = r"""
import json, sys, torch
from tbegen import build, harness
from tbegen.spec import load_spec

spec, quick, out = load_spec(sys.argv[1]), sys.argv[2] == "quick", sys.argv[3]
files = build.spec_files(spec, False, fp32_weights_only=quick)
entry = build.build_root() / f"{spec.name}-cpu-{build.cache_key(spec.name, files, False)}"
ops = build.load_ops(spec, with_cuda=False, fp32_weights_only=quick)
torch.set_num_threads(2)
results = {}
for i, case in enumerate(harness.standard_cases(spec, dtypes=(torch.float32,))):
    gen = torch.Generator().manual_seed(case.seed)
    layout = harness.make_layout(case.tables, case.feature_table_map)
    hyper = harness.default_hyperparameters(spec, dict(case.hyper))
    weights, states = harness.initial_state(spec, layout, case, gen)
    feats, _, max_D = harness.layout_args(layout, "cpu")
    results[f"{i}:{case.id}/initial"] = dict(w=weights)
    for op in ("backward", "backward_lane_split"):
        w, st = weights.clone(), {k: v.clone() for k, v in states.items()}
        g = torch.Generator().manual_seed(case.seed + 1)
        for step in (1, 2):
            if spec.table_stages or spec.table_reductions:
                harness.call_table_update(spec, ops, case, layout, feats, hyper, w, st, step)
            batch = harness.random_batch(case, layout, g)
            shape = (batch.indices.numel(), max_D) if case.pooling == "none" else (case.B, layout.total_D)
            grad_output = torch.randn(shape, generator=g, dtype=torch.float32)
            harness.call_backward(spec, ops, op, case, layout, feats, hyper, grad_output, w, st, batch.indices,
                                  batch.offsets, batch.per_sample_weights, step)
        results[f"{i}:{case.id}/{op}"] = dict(w=w, **st)
fp16 = None
try:
    case = harness.Case(tables=harness.MIXED_TABLES, weights_dtype=torch.float16, seed=5)
    layout = harness.make_layout(case.tables, case.feature_table_map)
    weights, states = harness.initial_state(spec, layout, case, torch.Generator().manual_seed(5))
    feats, _, _ = harness.layout_args(layout, "cpu")
    batch = harness.random_batch(case, layout, torch.Generator().manual_seed(6))
    harness.call_backward(spec, ops, "backward", case, layout, feats,
                          harness.default_hyperparameters(spec, {}), torch.randn(case.B, layout.total_D), weights,
                          states, batch.indices, batch.offsets, batch.per_sample_weights, 1)
except RuntimeError as e:
    fp16 = str(e).splitlines()[0]
torch.save(dict(results=results, objects=build._ops_objects(entry), fp16=fp16,
                wrapper=build.FP32_WEIGHTS_SOURCE in "".join(files)), out)
"""


def _run(tmp_path, kind: str, max_jobs: str, objects: list) -> dict:
    """The RUN script's results for the `kind` library ("full" or "quick"), built with MAX_JOBS=max_jobs
    (and TBEGEN_CPU_SPLIT 0 for one job, 1 for two: whatever the load) into `objects`: in the shared
    cache unless it holds that library compiled the other way (then in a cache of this test's own)."""
    out = tmp_path / f"{kind}.pt"
    spec = load_spec(str(SPECS[SPEC]))
    files = build.spec_files(spec, False, fp32_weights_only=kind == "quick")
    entry = build.build_root() / f"{SPEC}-cpu-{build.cache_key(SPEC, files, False)}"
    cache = str(build.build_root())
    if (entry / build.DIGEST_FILE).is_file() and build._ops_objects(entry) != objects:
        cache = str(tmp_path / f"cache-{kind}")
    env = dict(os.environ, MAX_JOBS=max_jobs, TBEGEN_CPU_SPLIT="0" if max_jobs == "1" else "1", TBEGEN_BUILD_DIR=cache,
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", RUN, str(SPECS[SPEC]), kind, str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return torch.load(out)


@pytest.mark.skipif(SPEC not in SPECS, reason=f"{SPEC} not among the tested specs")
def test_split_and_float32_only_builds_compute_what_the_whole_build_computes(prebuilt, tmp_path):
    # the full library compiled whole (as prebuild compiles it, builds side by side), the float32
    # one with two compiler processes allowed: split in two
    full = _run(tmp_path, "full", "1", ["ops.o"])
    quick = _run(tmp_path, "quick", "2", ["ops_part1.o", "ops_part2.o"])
    assert quick["wrapper"], "the runtime headers lost TBEGEN_CPU_FP32_WEIGHTS_ONLY: --quick builds everything"
    assert full["objects"] == ["ops.o"] and quick["objects"] == ["ops_part1.o", "ops_part2.o"]
    assert sorted(full["results"]) == sorted(quick["results"]) and len(full["results"]) >= 30
    for case, tensors in full["results"].items():
        for name, t in tensors.items():
            q = quick["results"][case][name]
            assert q.dtype == t.dtype and torch.equal(q, t), f"{case}: {name} differs between the two builds"
    moved = [c for c in full["results"] if c.endswith("/backward")
             and not torch.equal(full["results"][c]["w"], full["results"][c.replace("/backward", "/initial")]["w"])]
    # (not vacuous: the steps moved the weights; one of the spec's hyperparameter settings may not)
    assert len(moved) >= 0.9 * (len(full["results"]) // 3), f"only {len(moved)} cases moved the weights"
    assert full["fp16"] is None
    assert quick["fp16"] is not None and "built for float32 weights only" in quick["fp16"], quick["fp16"]


def test_ops_sources_split_only_where_supported_and_two_jobs_are_allowed(tmp_path, monkeypatch):
    name = "toy"
    (tmp_path / name).mkdir()
    whole = {f"{name}/ops.cpp": "// no parts\n"}
    parts = {f"{name}/ops.cpp": "#if !defined(TBEGEN_OPS_PART) || TBEGEN_OPS_PART == 1\n#endif\n"}
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.7, 1.0, 1.0))  # (busy: the second core is taken)
    monkeypatch.setenv("MAX_JOBS", "2")
    monkeypatch.delenv("TBEGEN_CPU_SPLIT", raising=False)
    assert build._ops_sources(name, parts, tmp_path) == [str(tmp_path / name / "ops.cpp")]
    monkeypatch.setenv("TBEGEN_CPU_SPLIT", "1")
    assert len(build._ops_sources(name, parts, tmp_path)) == 2
    monkeypatch.setenv("TBEGEN_CPU_SPLIT", "sometimes")
    with pytest.raises(ValueError, match="TBEGEN_CPU_SPLIT='sometimes'"):
        build._ops_sources(name, parts, tmp_path)
    monkeypatch.delenv("TBEGEN_CPU_SPLIT")
    monkeypatch.setattr(os, "getloadavg", lambda: (0.3, 1.0, 1.0))  # (idle)
    assert build._ops_sources(name, whole, tmp_path) == [str(tmp_path / name / "ops.cpp")]
    split = build._ops_sources(name, parts, tmp_path)
    assert split == [str(tmp_path / name / s) for s in build.OPS_PART_SOURCES]
    assert '#define TBEGEN_OPS_PART 2\n#include "ops.cpp"' in (tmp_path / name / "ops_part2.cpp").read_text()
    quick = dict(parts, **{f"{name}/{build.FP32_WEIGHTS_SOURCE}": "x"})
    build._ops_sources(name, quick, tmp_path)
    assert f'#include "{build.FP32_WEIGHTS_SOURCE}"' in (tmp_path / name / "ops_part1.cpp").read_text()
    monkeypatch.setenv("MAX_JOBS", "1")
    assert build._ops_sources(name, parts, tmp_path) == [str(tmp_path / name / "ops.cpp")]
    assert build._ops_sources(name, quick, tmp_path) == [str(tmp_path / name / build.FP32_WEIGHTS_SOURCE)]
    monkeypatch.setenv("MAX_JOBS", "two")
    with pytest.raises(ValueError, match="MAX_JOBS='two'"):
        build._ops_sources(name, parts, tmp_path)


def test_the_float32_only_library_is_a_build_of_its_own():
    spec = load_spec(str(next(iter(SPECS.values()))))
    full, quick = build.spec_files(spec, False), build.spec_files(spec, False, fp32_weights_only=True)
    assert build.FP32_WEIGHTS_MACRO in full["include/tbegen/cpu_ops.h"]
    assert set(quick) - set(full) == {f"{spec.name}/{build.FP32_WEIGHTS_SOURCE}"}
    assert build.cache_key(spec.name, full, False) != build.cache_key(spec.name, quick, False)
    # (the CUDA float32 library, which links this one's CPU object: tests/test_cuda_quick_build.py)
