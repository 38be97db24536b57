"""The precompiled torch headers (tbegen/torch_pch.py): made from a finished build's own flags,
never a condition of a build."""

from __future__ import annotations

from tbegen import torch_pch


def _finished_build(root, name, cflags):
    entry = root / f"{name}-cpu-0123456789abcdef"
    entry.mkdir(parents=True)
    (entry / "build.ninja").write_text(f"ninja_required_version = 1.3\ncxx = c++\n\ncflags = {cflags}\npost_cflags =\n")


def test_the_flags_of_a_finished_build_without_what_names_it(tmp_path):
    _finished_build(tmp_path, "sgd", "-DTORCH_EXTENSION_NAME=tbegen_sgd_cpu_x -DTORCH_API_INCLUDE_EXTENSION_H "
                                     "-I/c/.sgd.tmp/src/include -I /c/.sgd.tmp/src/sgd -isystem /t/include "
                                     "-include /c/pch/k/tbegen_torch_pch.h -fPIC -std=c++20 -O3 -march=native")
    assert torch_pch._finished_cflags(tmp_path) == [
        "-DTORCH_API_INCLUDE_EXTENSION_H", "-isystem", "/t/include", "-fPIC", "-std=c++20", "-O3", "-march=native"]


def test_no_finished_build_no_header(tmp_path):
    assert torch_pch.include_flags(tmp_path) == []


def test_turned_off(tmp_path, monkeypatch):
    _finished_build(tmp_path, "sgd", "-fPIC")
    monkeypatch.setenv("TBEGEN_PCH", "0")
    assert torch_pch.include_flags(tmp_path) == []


def test_a_compiler_that_fails_leaves_no_header(tmp_path, monkeypatch):
    _finished_build(tmp_path, "sgd", "-fPIC")
    monkeypatch.setenv("CXX", "false")  # (a "compiler" that fails)
    assert torch_pch.include_flags(tmp_path) == []
    assert not list(tmp_path.glob("pch/*/*.gch"))
