"""The build harness: a C++ error inside a snippet is reported at the spec's line, builds are
cached by content, and a changed spec gets a new build."""

import os
import re
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
        f"build.load_ops(load_spec({str(spec_path)!r}), with_cuda=False)\n"
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
    build.load_ops(spec, with_cuda=build.cuda_wanted(None))
    assert time.perf_counter() - t0 < 5.0


def test_loading_another_build_of_a_loaded_optimizer_is_a_clear_error(load_ops):
    spec, _ = load_ops("sgd")
    other = build.spec_files(spec, with_cuda=build.cuda_wanted(None))
    other["sgd/optimizer.h"] += "\n// changed\n"
    with pytest.raises(RuntimeError, match="already loaded in this process"):
        build.build_files(spec.name, other, build.cuda_wanted(None), load=True)


# ---- the cache's trust: permissions, digests, atomic entries, one build at a time -------------
# These use a tiny library (one C++ function, no torch headers: seconds to build) in a fresh cache.

TINY = {"tiny/ops.cpp": "int tbegen_tiny_answer() { return 42; }\n"}


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("TBEGEN_BUILD_DIR", str(root))
    return root


def test_a_new_cache_folder_is_private(fresh_cache):
    assert build.cache_root() == fresh_cache
    assert fresh_cache.stat().st_mode & 0o777 == 0o700


def test_a_cache_folder_writable_by_others_is_refused(fresh_cache):
    fresh_cache.mkdir(mode=0o700)
    for mode in (0o777, 0o770, 0o702):
        fresh_cache.chmod(mode)
        with pytest.raises(build.CacheError, match="writable by other users.*chmod go-w"):
            build.build_files("tiny", TINY, with_cuda=False, load=False)
    assert list(fresh_cache.iterdir()) == []  # nothing was built or written


def test_a_cache_folder_of_another_user_is_refused(fresh_cache, monkeypatch):
    fresh_cache.mkdir(mode=0o700)
    if os.getuid() == 0:  # really another owner
        os.chown(fresh_cache, 12345, -1)
    else:
        monkeypatch.setattr(build.os, "getuid", lambda: fresh_cache.stat().st_uid + 1)
    with pytest.raises(build.CacheError, match="belongs to another user"):
        build.build_files("tiny", TINY, with_cuda=False, load=False)


def test_a_changed_library_or_digest_is_refused_and_a_leftover_entry_is_rebuilt(fresh_cache, capfd, monkeypatch):
    monkeypatch.setattr(build, "PROGRESS_EVERY_S", 0.01)  # (a warm build worker builds it in a fraction of a second)
    lib = build.build_files("tiny", TINY, with_cuda=False, load=False)
    err = capfd.readouterr().err
    # progress: which extension, that it is still building, and how long it took
    assert "tbegen: building the tiny extension (CPU)" in err
    assert "tbegen: still building the tiny extension (CPU): " in err
    assert re.search(r"tbegen: built the tiny extension \(CPU\) in [0-9]+ s \([0-9]+ s of CPU time\)", err), err
    entry = lib.parent
    assert sorted(p.name for p in fresh_cache.iterdir()) == ["locks", entry.name]  # no temporary folder left
    original = lib.read_bytes()
    lib.write_bytes(original + b"\0")
    with pytest.raises(build.CacheError, match="does not match the digest"):
        build.build_files("tiny", TINY, with_cuda=False, load=True)
    lib.write_bytes(original)
    assert build.build_files("tiny", TINY, with_cuda=False, load=False) == lib  # restored: accepted, not rebuilt
    assert "building" not in capfd.readouterr().err
    digests = entry / build.DIGEST_FILE
    digests.write_text(digests.read_text().replace(build.cache_key("tiny", TINY, False), "0" * 16))
    with pytest.raises(build.CacheError, match="does not match the digest"):
        build.build_files("tiny", TINY, with_cuda=False, load=False)
    # an entry without its digest file was never published (an interrupted build of an older
    # tbegen): it is rebuilt, not used
    digests.unlink()
    lib.write_bytes(b"not a library")
    assert build.build_files("tiny", TINY, with_cuda=False, load=False) == lib
    assert "building the tiny extension (CPU)" in capfd.readouterr().err
    assert lib.read_bytes()[:4] == b"\x7fELF"


def test_concurrent_builds_of_one_extension_compile_it_once(fresh_cache, tmp_path):
    import fcntl
    import time

    code = (
        "import torch; from tbegen import build\n"
        f"print(build.build_files('tiny', {TINY!r}, with_cuda=False, load=True))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT), TBEGEN_BUILD_DIR=str(fresh_cache))
    # hold the entry's lock while the three start, so that all three meet it
    (fresh_cache / "locks").mkdir(parents=True)
    key = build.cache_key("tiny", TINY, False)
    lock = open(fresh_cache / "locks" / f"tiny-cpu-{key}.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    logs = [tmp_path / f"err{i}.txt" for i in range(3)]
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=open(log, "w"),
                              text=True) for log in logs]
    try:
        deadline = time.time() + 120
        while not all("waiting for it" in log.read_text() for log in logs):
            assert time.time() < deadline, [log.read_text() for log in logs]
            time.sleep(0.2)
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()
    outs = [p.communicate(timeout=300)[0] for p in procs]
    errs = [log.read_text() for log in logs]
    assert all(p.returncode == 0 for p in procs), errs
    assert sum(e.count("tbegen: building the tiny extension") for e in errs) == 1, errs
    assert len({o.strip() for o in outs}) == 1  # all three loaded the same library


# ---- the shared CPU runtime object -------------------------------------------------------------
# Stand-in runtime sources (one C++ function) in the runtime's place: the build compiles
# include/tbegen/cpu_ops.cpp once, as its own entry, and links it into every library built from
# those runtime files.


def _with_runtime(name: str, runtime: str) -> dict:
    return {build.RUNTIME_CPU_SOURCE: runtime, "include/tbegen/cpu_ops.h": 'extern "C" int tbegen_shared();\n',
            f"{name}/ops.cpp": f'#include "tbegen/cpu_ops.h"\nextern "C" int tbegen_{name}() {{ return tbegen_shared(); }}\n'}


def _call(lib: Path, function: str) -> int:
    code = "import ctypes, sys; print(getattr(ctypes.CDLL(sys.argv[1]), sys.argv[2])())"
    proc = subprocess.run([sys.executable, "-c", code, str(lib), function], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout)


def test_the_cpu_runtime_object_is_built_once_and_linked_into_every_library(fresh_cache, capfd):
    runtime = 'extern "C" int tbegen_shared() { return 7; }\n'
    a = build.build_files("rt_a", _with_runtime("rt_a", runtime), with_cuda=False, load=False)
    b = build.build_files("rt_b", _with_runtime("rt_b", runtime), with_cuda=False, load=False)
    err = capfd.readouterr().err
    assert err.count("tbegen: building the CPU operators shared by every optimizer") == 1, err
    runtime_entries = [p for p in fresh_cache.iterdir() if p.name.startswith(f"{build.RUNTIME_CPU_NAME}-cpu-")]
    assert len(runtime_entries) == 1 and (runtime_entries[0] / "cpu_ops.o").is_file()
    assert _call(a, "tbegen_rt_a") == 7 and _call(b, "tbegen_rt_b") == 7  # linked into both
    ninja = (a.parent / "build.ninja").read_text()  # linked, not compiled again
    assert "build cpu_ops.o:" not in ninja and str(runtime_entries[0] / "cpu_ops.o") in ninja
    # other runtime sources: another runtime object, and another key for the optimizer's library
    changed = build.build_files("rt_a", _with_runtime("rt_a", runtime.replace("7", "8")), with_cuda=False,
                                load=False)
    assert changed != a and _call(changed, "tbegen_rt_a") == 8
    assert "tbegen: building the CPU operators shared by every optimizer" in capfd.readouterr().err
    # sources without the runtime link nothing (TINY, and the libraries of older renders)
    assert build._reused_objects("tiny", TINY, False, False) == []


def test_a_spec_key_follows_the_cpu_runtime_sources():
    spec = load_spec(str(ROOT / "optimizers" / "sgd.yaml"))
    for with_cuda in (False, True):
        files = build.spec_files(spec, with_cuda=with_cuda)
        assert build.RUNTIME_CPU_SOURCE in files and "include/tbegen/cpu_ops.h" in files
        runtime = build._runtime_files(files)
        assert set(runtime) == {k for k in files if k.startswith("include/")}
        for changed_file in (build.RUNTIME_CPU_SOURCE, "include/tbegen/cpu_kernels.h"):
            changed = dict(files)
            changed[changed_file] = changed[changed_file].replace("namespace cpu {", "namespace cpu {\nint x;", 1)
            assert changed[changed_file] != files[changed_file]
            assert build.cache_key(spec.name, changed, with_cuda) != build.cache_key(spec.name, files, with_cuda)
            assert (build.cache_key(build.RUNTIME_CPU_NAME, build._runtime_files(changed), False)
                    != build.cache_key(build.RUNTIME_CPU_NAME, runtime, False))


# ---- build workers: one process builds many extensions and loads none of them ----------------


def _marking(name: str, marks: Path) -> dict:
    """A tiny library whose loading leaves a file loaded-PID in `marks` (PID: the loading process)."""
    return {f"{name}/ops.cpp": (
        "#include <stdio.h>\n#include <unistd.h>\n"
        "__attribute__((constructor)) static void tbegen_mark() {\n"
        f'  char path[4096]; snprintf(path, sizeof path, "%s/loaded-%d", "{marks}", (int)getpid());\n'
        '  FILE* f = fopen(path, "w"); if (f) fclose(f);\n}\n'
        f"int tbegen_{name}_answer() {{ return 42; }}\n")}


def _idle_worker_pids():
    return [w.proc.pid for w in build._IDLE_WORKERS]


def test_one_worker_builds_several_extensions_without_loading_them(fresh_cache, tmp_path, capfd):
    # (as prebuild's worker builds a spec's CPU and CUDA libraries, which register the same
    # operator namespace: loading both into one process would fail)
    marks = tmp_path / "marks"
    marks.mkdir()
    first = build.build_files("mark_a", _marking("mark_a", marks), with_cuda=False, load=False)
    pids = _idle_worker_pids()
    assert len(pids) == 1  # the worker stays for the next build
    second = build.build_files("mark_b", _marking("mark_b", marks), with_cuda=False, load=False)
    assert _idle_worker_pids() == pids  # the same worker built the second one
    assert first != second and first.is_file() and second.is_file()
    # ... and loaded neither itself; each was loaded once, by a forked copy of it (the load check)
    loaded_by = [p.name for p in marks.iterdir()]
    assert f"loaded-{pids[0]}" not in loaded_by and len(loaded_by) == 2, loaded_by
    for mark in marks.iterdir():
        mark.unlink()
    err = capfd.readouterr().err
    for name in ("mark_a", "mark_b"):
        assert re.search(rf"tbegen: built the {name} extension \(CPU\) in [0-9]+ s \([0-9]+ s of CPU time\)", err), err
    # (the marks do show a load: here, of the first library by another process)
    proc = subprocess.run([sys.executable, "-c", "import ctypes, os, sys; ctypes.CDLL(sys.argv[1]); print(os.getpid())",
                           str(first)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert [p.name for p in marks.iterdir()] == [f"loaded-{proc.stdout.strip()}"]


def test_a_compile_error_in_a_worker_is_reported_and_the_worker_builds_on(fresh_cache):
    from tbegen.compile_errors import CompileError

    with pytest.raises(CompileError) as info:
        build.build_files("tinybad", {"tinybad/ops.cpp": "int f() { return step_sise; }\n"}, with_cuda=False,
                          load=False)
    message = str(info.value)
    assert message.startswith("tbegen: the compiler rejected optimizer 'tinybad' (CPU build):"), message
    assert "ops.cpp:1:18: error:" in message and "step_sise" in message
    assert info.value.log_path == fresh_cache / "tinybad-cpu-compiler-errors.log"
    assert "step_sise" in info.value.log_path.read_text()
    assert not any(p.name.startswith("tinybad-cpu-") and p.is_dir() for p in fresh_cache.iterdir())  # nothing published
    pids = _idle_worker_pids()
    assert len(pids) == 1
    assert build.build_files("tiny", TINY, with_cuda=False, load=False).is_file()
    assert _idle_worker_pids() == pids


def test_a_library_that_does_not_load_fails_its_build(fresh_cache):
    """The worker loads each library in a fork before it is published: an unresolved symbol (which
    linking a shared library allows) fails the build, not the first use from the cache."""
    source = {"unresolved/ops.cpp": "extern int tbegen_nowhere_defined();\n"
                                    "int tbegen_unresolved_answer = tbegen_nowhere_defined();\n"}
    with pytest.raises(RuntimeError, match=r"was built but does not load: .*tbegen_nowhere_defined"):
        build.build_files("unresolved", source, with_cuda=False, load=False)
    assert not any(p.name.startswith("unresolved-cpu-") and p.is_dir() for p in fresh_cache.iterdir())
    # the worker builds on
    assert build.build_files("tiny", TINY, with_cuda=False, load=False).is_file()


def test_a_worker_that_ends_is_replaced(fresh_cache, monkeypatch):
    build.build_files("tiny", TINY, with_cuda=False, load=False)
    (idle,) = build._IDLE_WORKERS
    idle.proc.kill()  # ended while idle: the next build starts another
    idle.proc.wait()
    lib = build.build_files("tiny2", {"tiny2/ops.cpp": "int tbegen_tiny2() { return 2; }\n"}, False, load=False)
    assert lib.is_file() and _idle_worker_pids() != [idle.proc.pid]
    # ended while building: the build fails with a clear error, and the next one gets a new worker
    real = build._Worker.build

    def killed_while_building(self, request, waiting):
        self.proc.kill()
        return real(self, request, waiting)

    monkeypatch.setattr(build._Worker, "build", killed_while_building)
    with pytest.raises(RuntimeError, match="building the tiny3 extension \\(CPU\\) failed: its build worker ended"):
        build.build_files("tiny3", {"tiny3/ops.cpp": "int tbegen_tiny3() { return 3; }\n"}, False, load=False)
    assert build._IDLE_WORKERS == []
    monkeypatch.setattr(build._Worker, "build", real)
    assert build.build_files("tiny3", {"tiny3/ops.cpp": "int tbegen_tiny3() { return 3; }\n"}, False, load=False).is_file()


def test_cpp_extension_is_imported_without_the_no_cuda_runtime_warning(tmp_path):
    # torch logs "No CUDA runtime is found" when cpp_extension is imported where a CUDA toolkit
    # exists but no GPU does (CI): expected there, so tbegen filters exactly that message
    code = "from tbegen import build; build._cpp_extension(); print('imported')"
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_HOME=str(tmp_path))  # a CUDA_HOME that exists
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and "imported" in proc.stdout, proc.stderr
    assert "No CUDA runtime" not in proc.stderr and "NumPy" not in proc.stderr, proc.stderr


def test_prebuild_counts_the_extensions_it_has_built(fresh_cache, capfd, monkeypatch):
    # the session's parallel build says how far it is after each extension (here without
    # compiling: build_files is replaced by a recorder that checks what it is asked for)
    asked = []

    def fake_build(name, files, with_cuda, verbose=False, load=True):
        assert not load
        if name in build.RUNTIMES:  # the code every optimizer links: its headers only
            assert with_cuda == (name == build.RUNTIME_NAME)
            assert build.RUNTIME_CPU_SOURCE in files and all(k.startswith("include/") for k in files)
        else:
            assert f"{name}/ops.cpp" in files and (f"{name}/kernels_cuda.cu" in files) == with_cuda
        asked.append((name, with_cuda))
        return fresh_cache / "unused"

    monkeypatch.setattr(build, "build_files", fake_build)
    monkeypatch.setenv("MAX_JOBS", "1")  # (prebuild sets it where unset: keep this session's as it was)
    specs = [ROOT / "optimizers" / "sgd.yaml", ROOT / "optimizers" / "adam.yaml"]
    build.prebuild(specs, [False, True], jobs=1)
    # the shared objects first (CUDA, CPU), then the CPU builds (whose ops.o the CUDA builds link)
    assert asked == [(build.RUNTIME_NAME, True), (build.RUNTIME_CPU_NAME, False), ("sgd", False), ("adam", False),
                     ("sgd", True), ("adam", True)]
    err = capfd.readouterr().err
    assert "tbegen: building 6 extension(s)" in err
    for k in range(1, 7):
        assert f"tbegen: [{k}/6] " in err
    assert "[6/6] the adam extension (CPU + CUDA) is ready" in err
    assert "tbegen: built 6 extension(s) in " in err

    asked.clear()  # CPU only: no shared CUDA object
    build.prebuild(specs, [False], jobs=1)
    assert asked == [(build.RUNTIME_CPU_NAME, False), ("sgd", False), ("adam", False)]
