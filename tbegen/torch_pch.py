"""A precompiled header of the torch headers every host source of tbegen includes.

Each optimizer's CPU operator (ops.cpp) and CUDA operator (ops_cuda.cpp) spends about a third of
its compile time (6 of 18 CPU seconds on the CI machine) parsing the same torch headers. GCC can
load them from a precompiled header instead: `-include tbegen_torch_pch.h`, with
`tbegen_torch_pch.h.gch` beside it, made once per build cache with the very flags the builds use.

It is only a speed-up, never a condition: the header is also a plain header, so where GCC finds
the .gch invalid (another compiler, other flags) or absent, it parses the headers as before, and
the object code is the same either way. That is why the flag is not part of a build's cache key
(tbegen/build.py, `cxx_flags`). The .gch is made from the flags of a build that has finished
(its build.ninja), so the first build of a fresh cache goes without; a build that finds another
process making the .gch goes without too, rather than wait. TBEGEN_PCH=0 turns it off.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import List, Optional

# the headers of templates/include/tbegen that pull in torch (host.h, cpu_kernels.h, the generated
# ops.cpp and ops_cuda.cpp): anything they include again after this is skipped by its include guard
HEADER = """\
// tbegen: the torch headers of every host source, precompiled once per build cache (tbegen/torch_pch.py)
#pragma once
#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
"""

_DEFINE_NAME = re.compile(r"^-DTORCH_EXTENSION_NAME=")


def _torch_include() -> str:
    """The include folder of the torch this process builds against."""
    import torch

    return os.path.join(os.path.dirname(torch.__file__), "include")


def _finished_cflags(root: Path, torch_include: str) -> Optional[List[str]]:
    """The C++ flags of a finished CPU build in the cache (its build.ninja) made with the torch at
    `torch_include`, less what names that build (its extension name, its own source folders). One
    cache may hold builds of several torch installations (the build key has the version), and GCC
    does not check include paths when it takes a .gch: a header precompiled from another torch's
    headers would be taken, and the sources' own includes of this torch's headers then define
    everything twice."""
    for ninja in sorted(root.glob("*-cpu-*/build.ninja")):
        for line in ninja.read_text().splitlines():
            if line.startswith("cflags = "):
                flags = shlex.split(line[len("cflags = "):])
                if torch_include not in flags:
                    break  # (another torch's build)
                out, skip = [], False
                for f in flags:
                    if skip:
                        skip = False
                        continue
                    if _DEFINE_NAME.match(f):
                        continue
                    if f in ("-I", "-include"):  # (and the precompiled header a build used itself)
                        skip = True
                        continue
                    if f.startswith("-I"):  # (the build's own src/ folders; torch comes as -isystem)
                        continue
                    out.append(f)
                return out
    return None


def include_flags(root: Path) -> List[str]:
    """['-include', header] where a valid precompiled header exists or can be made now, else []."""
    if os.environ.get("TBEGEN_PCH", "1") == "0":
        return []
    try:
        return _include_flags(root)
    except OSError:
        return []


def _include_flags(root: Path) -> List[str]:
    cflags = _finished_cflags(root, _torch_include())
    if cflags is None:
        return []
    cxx = os.environ.get("CXX", "c++")
    key = hashlib.sha256("\n".join([cxx, HEADER] + cflags).encode()).hexdigest()[:16]
    folder = root / "pch" / key
    header, gch = folder / "tbegen_torch_pch.h", folder / "tbegen_torch_pch.h.gch"
    if gch.is_file():
        return ["-include", str(header)]
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(folder / "lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return []  # (another process is making it: this build goes without)
        if gch.is_file():
            return ["-include", str(header)]
        header.write_text(HEADER)
        tmp = folder / f"tbegen_torch_pch.h.gch.{os.getpid()}"
        proc = subprocess.run([cxx, *cflags, "-x", "c++-header", str(header), "-o", str(tmp)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            return []
        os.replace(tmp, gch)
    return ["-include", str(header)]
