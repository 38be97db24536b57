"""Compares the GPU machine code (SASS) of two builds of the same CUDA object, kernel by kernel.

    python benchmarks/tools/compare_sass.py OLD.o NEW.o [--cuobjdump PATH]

OLD.o and NEW.o are objects or libraries from tbegen's build cache (for example the
`cuda_forward.cuda.o` of a `runtime_forward-cuda-*` entry, or the `ops_cuda.cuda.o` of an
optimizer's `NAME-cuda-*` entry) built from two versions of the templates. Prints how many
kernels the two have in common and whether each common kernel's SASS is identical, and lists the
kernels only one of them has. A change that adds kernels beside the old ones (as the any-width
kernels were added beside the 4-wide ones) should leave every common kernel identical: then the
old path runs the very same instructions, which needs no GPU to show. Exit status 1 when a common
kernel differs.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict


def find_cuobjdump(given: str | None) -> str:
    """cuobjdump from the argument, PATH, the CUDA toolkit next to nvcc, or triton's copy."""
    candidates = [given, shutil.which("cuobjdump")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent / "cuobjdump"))
    try:
        import triton  # its NVIDIA backend ships a cuobjdump

        candidates.append(str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"))
    except ImportError:
        pass
    for c in candidates:
        if c and Path(c).is_file():
            return c
    sys.exit("compare_sass: no cuobjdump found (pass --cuobjdump PATH)")


def kernels(cuobjdump: str, path: str) -> Dict[str, str]:
    """{mangled kernel name: its SASS text} of every kernel in the object."""
    text = subprocess.run([cuobjdump, "-sass", path], check=True, capture_output=True, text=True).stdout
    out: Dict[str, str] = {}
    name, body = None, []
    for line in text.splitlines(keepends=True):
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            if name:
                out[name] = "".join(body)
            name, body = m.group(1), []
        elif name:
            body.append(line)
    if name:
        out[name] = "".join(body)
    if not out:
        sys.exit(f"compare_sass: no kernels in {path}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--cuobjdump")
    args = ap.parse_args(argv)
    tool = find_cuobjdump(args.cuobjdump)
    old, new = kernels(tool, args.old), kernels(tool, args.new)
    common = sorted(set(old) & set(new))
    differ = [k for k in common if old[k] != new[k]]
    print(f"{len(old)} kernels in {args.old}")
    print(f"{len(new)} kernels in {args.new}")
    print(f"{len(common)} in both: {len(common) - len(differ)} with identical SASS, {len(differ)} different")
    for k in differ:
        print(f"  DIFFERENT: {k}")
    for label, only in (("only in the old", sorted(set(old) - set(new))), ("only in the new", sorted(set(new) - set(old)))):
        print(f"{len(only)} {label}")
        for k in only:
            print(f"  {k}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
