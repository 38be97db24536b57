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
    assert torch_pch._finished_cflags(tmp_path, "/t/include") == [
        "-DTORCH_API_INCLUDE_EXTENSION_H", "-isystem", "/t/include", "-fPIC", "-std=c++20", "-O3", "-march=native"]


def test_no_finished_build_no_header(tmp_path):
    assert torch_pch.include_flags(tmp_path) == []


def test_only_a_build_of_this_torch(tmp_path, monkeypatch):
    """A cache may hold builds of several torch installations (CI's torch 2.14 suite and FBGEMM's
    suite under torch 2.13 share one): a header precompiled from another torch's headers would
    be taken by GCC (it does not check include paths) and define everything twice."""
    _finished_build(tmp_path, "sgd", "-isystem /other/torch/include -fPIC")
    assert torch_pch._finished_cflags(tmp_path, "/this/torch/include") is None
    _finished_build(tmp_path, "adam", "-isystem /this/torch/include -O3")
    assert torch_pch._finished_cflags(tmp_path, "/this/torch/include") == ["-isystem", "/this/torch/include", "-O3"]
    monkeypatch.setenv("CXX", "false")  # (never reached for the other torch's flags)
    monkeypatch.setattr(torch_pch, "_torch_include", lambda: "/third/torch/include")
    assert torch_pch.include_flags(tmp_path) == []


def this_torch(flags):
    return f"-isystem {torch_pch._torch_include()} {flags}"


def test_turned_off(tmp_path, monkeypatch):
    _finished_build(tmp_path, "sgd", this_torch("-fPIC"))
    monkeypatch.setenv("TBEGEN_PCH", "0")
    assert torch_pch.include_flags(tmp_path) == []


def test_a_compiler_that_fails_leaves_no_header(tmp_path, monkeypatch):
    _finished_build(tmp_path, "sgd", this_torch("-fPIC"))
    monkeypatch.setenv("CXX", "false")  # (a "compiler" that fails)
    assert torch_pch.include_flags(tmp_path) == []
    assert not list(tmp_path.glob("pch/*/*.gch"))


def test_sources_without_torch_headers_neither_make_nor_take_one(tmp_path, monkeypatch):
    """tbegen/build.py: the .gch (~12 CPU s to make) only for sources that include torch; two
    one-function libraries in a fresh cache, the second after a finished build, make none."""
    from tbegen import build

    monkeypatch.setenv("TBEGEN_BUILD_DIR", str(tmp_path / "cache"))
    for name in ("plain_a", "plain_b"):
        build.build_files(name, {f"{name}/ops.cpp": f"int tbegen_{name}() {{ return 1; }}\n"}, with_cuda=False,
                          load=False)
    assert not (tmp_path / "cache" / "pch").exists()
    ninja = next((tmp_path / "cache").glob("plain_b-cpu-*/build.ninja")).read_text()
    assert "tbegen_torch_pch.h" not in ninja
    assert build._TORCH_INCLUDE.search("// x\n#include <torch/library.h>\n")
    assert build._TORCH_INCLUDE.search('  # include <ATen/Parallel.h>')
    assert not build._TORCH_INCLUDE.search('#include "tbegen/common.h"\n// <torch/library.h>\n')
