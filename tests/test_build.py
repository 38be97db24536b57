"""The build harness: a C++ error inside a snippet is reported at the spec's line, builds are
cached by content, and a changed spec gets a new build."""

import subprocess
import sys
from pathlib import Path

import pytest

from tbegen import build
from tbegen.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent

BROKEN = """\
name: broken_sgd
summary: sgd with a typo in its update.
hyperparameters:
  learning_rate: {type: float, default: 0.01, doc: Step size.}
element: |
  float step_size = learning_rate;
  w -= step_sise * g;
reference: |
  w -= learning_rate * g
"""


def test_compiler_error_points_at_the_yaml_line(tmp_path, monkeypatch):
    spec_path = tmp_path / "broken_sgd.yaml"
    spec_path.write_text(BROKEN)
    code = (
        "import sys; from tbegen import build; from tbegen.spec import load_spec\n"
        f"build.load_spec(load_spec({str(spec_path)!r}), with_cuda=False)\n"
    )
    env = {"TBEGEN_BUILD_DIR": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin:/usr/local/bin",
           "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    # line 7 of the YAML holds `w -= step_sise * g;`
    assert f"{spec_path}:7" in out or "broken_sgd.yaml:7" in out, out[-3000:]
    assert "step_sise" in out


def test_builds_are_cached_by_content(tmp_path, monkeypatch):
    spec = load_spec(str(ROOT / "optimizers" / "sgd.yaml"))
    files = build.spec_files(spec, with_cuda=False)
    key = build.cache_key(spec.name, files, with_cuda=False)
    assert key == build.cache_key(spec.name, dict(files), with_cuda=False)
    changed = dict(files)
    changed["sgd/optimizer.h"] = changed["sgd/optimizer.h"].replace("w -= learning_rate * g;", "w -= 2 * learning_rate * g;")
    assert build.cache_key(spec.name, changed, with_cuda=False) != key
    assert build.cache_key(spec.name, files, with_cuda=True) != key


def test_cpu_arch_flags_and_their_cache_keys(monkeypatch):
    spec = load_spec(str(ROOT / "optimizers" / "sgd.yaml"))
    files = build.spec_files(spec, with_cuda=False)
    keys = {}
    for arch, flag in (("portable", None), ("native", "-march=native"), ("x86-64-v3", "-march=x86-64-v3")):
        monkeypatch.setenv("TBEGEN_CPU_ARCH", arch)
        flags = build.cxx_flags()
        assert [f for f in flags if f.startswith("-march")] == ([flag] if flag else [])
        keys[arch] = build.cache_key(spec.name, files, with_cuda=False)
    assert len(set(keys.values())) == 3  # a build for one instruction set never serves another
    # -march=native builds are keyed by the processor they were built on too
    monkeypatch.setenv("TBEGEN_CPU_ARCH", "native")
    monkeypatch.setattr(build, "_host_cpu", lambda: "model name : another processor")
    assert build.cache_key(spec.name, files, with_cuda=False) != keys["native"]
    monkeypatch.setenv("TBEGEN_CPU_ARCH", "native -fno-strict-aliasing")
    with pytest.raises(ValueError, match="TBEGEN_CPU_ARCH"):
        build.cxx_flags()


def test_a_second_load_hits_the_cache(load_ops, tmp_path):
    import time

    spec, _ = load_ops("sgd")  # built (and loaded) by the session fixture
    t0 = time.perf_counter()
    build.load_spec(spec, with_cuda=build.cuda_wanted(None))
    assert time.perf_counter() - t0 < 5.0


def test_loading_another_build_of_a_loaded_optimizer_is_a_clear_error(load_ops):
    spec, _ = load_ops("sgd")
    other = build.spec_files(spec, with_cuda=build.cuda_wanted(None))
    other["sgd/optimizer.h"] += "\n// changed\n"
    with pytest.raises(RuntimeError, match="already loaded in this process"):
        build.build_files(spec.name, other, build.cuda_wanted(None), load=True)
