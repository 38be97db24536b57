"""Starting a build worker process without importing torch (tbegen/build.py runs every build in
one: a child process that imports torch and cpp_extension once, then builds as it is asked).

A worker takes about as long to start as torch takes to import (1-1.5 CPU s). `tbegen test`
calls `prestart()` before it imports torch itself, so that the two imports run side by side on two
cores and the first build finds its worker ready; the next worker build.py needs is the
prestarted one (`take`). One that no build takes (the library was in the cache) is ended when
this process ends.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import List, Tuple

WORKER_CODE = "import sys; from tbegen.build import _worker_main; _worker_main(int(sys.argv[1]), int(sys.argv[2]))"

_LOCK = threading.Lock()
_PRESTARTED: List[Tuple[subprocess.Popen, object, object]] = []


def spawn() -> Tuple[subprocess.Popen, object, object]:
    """Starts a worker: (process, its requests pipe to write, its replies pipe to read)."""
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    try:
        proc = subprocess.Popen([sys.executable, "-c", WORKER_CODE, str(req_r), str(rep_w)], env=env,
                                stdin=subprocess.DEVNULL, pass_fds=(req_r, rep_w))
    except BaseException:
        for fd in (req_w, rep_r):
            os.close(fd)
        raise
    finally:
        os.close(req_r)
        os.close(rep_w)
    return proc, os.fdopen(req_w, "w"), os.fdopen(rep_r, "r")


def prestart() -> None:
    """Starts one worker now for the next build of this process (unless one is waiting already).
    Each request carries the requester's environment, so what is set after this still applies."""
    with _LOCK:
        if not _PRESTARTED:
            _PRESTARTED.append(spawn())


def take() -> Tuple[subprocess.Popen, object, object]:
    """The prestarted worker if there is one (and it is running), else a new one."""
    with _LOCK:
        while _PRESTARTED:
            started = _PRESTARTED.pop()
            if started[0].poll() is None:
                return started
            _end(started)
    return spawn()


def _end(started) -> None:
    """Ends a worker that was never asked to build (it may still be importing torch: not waited for)."""
    proc, requests, replies = started
    proc.kill()
    proc.wait()
    for pipe in (requests, replies):
        try:
            pipe.close()
        except OSError:
            pass


@atexit.register
def _end_unused() -> None:
    with _LOCK:
        unused = list(_PRESTARTED)
        _PRESTARTED.clear()
    for started in unused:
        _end(started)
