"""A build worker started before torch is imported (tbegen/build_workers.py: `tbegen test` starts
one first, so that its import of torch runs beside the command's own) is the one the next build
uses; one that no build uses ends with the process that started it."""

import os
import subprocess
import sys
import time
from pathlib import Path

from tbegen import build, build_workers

ROOT = Path(__file__).resolve().parent.parent


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # (a zombie, not yet reaped by an init that is slow to, counts as ended)
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_the_next_build_takes_the_prestarted_worker(tmp_path, monkeypatch):
    monkeypatch.setenv("TBEGEN_BUILD_DIR", str(tmp_path / "cache"))
    build._keep_idle_workers(0)  # (no idle worker of an earlier test: the build must take one)
    build_workers.prestart()
    build_workers.prestart()  # (one at a time)
    assert len(build_workers._PRESTARTED) == 1
    pid = build_workers._PRESTARTED[0][0].pid
    files = {"answer/ops.cpp": "int tbegen_answer_answer() { return 42; }\n"}
    try:
        build._keep_idle_workers(1)
        lib = build.build_files("answer", files, with_cuda=False, load=False)
        assert lib.is_file()
        assert build_workers._PRESTARTED == []
        assert [w.proc.pid for w in build._IDLE_WORKERS] == [pid]  # it built, and waits for the next build
    finally:
        build._keep_idle_workers(1)


def test_an_unused_prestarted_worker_ends_with_its_process():
    code = "from tbegen import build_workers; build_workers.prestart(); print(build_workers._PRESTARTED[0][0].pid)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    pid = int(proc.stdout.strip())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), f"the unused worker {pid} outlived the process that started it"
    assert time.perf_counter() - t0 < 30
    assert "Traceback" not in proc.stderr, proc.stderr


def test_prestarting_imports_no_torch():
    code = "import sys; from tbegen import build_workers; build_workers.prestart(); print('torch' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stdout + proc.stderr
