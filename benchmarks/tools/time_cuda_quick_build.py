"""Times the build part of `tbegen test --device cuda --quick` for a new spec (issue 26).

Writes a starter spec under a fresh name (`tbegen new`'s text), then builds the library that
`tbegen test --device cuda --quick` loads (build.load_ops(..., with_cuda=True,
fp32_weights_only=True)) into $TBEGEN_BUILD_DIR, with the shared runtime objects built first and
not counted. Needs a CUDA build of torch and nvcc; no GPU (the library is built, not loaded).
Prints one line: the wall time, the load average before, and the library's path.

  TBEGEN_BUILD_DIR=/tmp/x python benchmarks/tools/time_cuda_quick_build.py [--full]

--full: the full library instead (every weight dtype: what `tbegen test --device cuda` and the
module build).
"""
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tbegen import build  # noqa: E402
from tbegen.scaffold import write_scaffold  # noqa: E402
from tbegen.spec import load_spec  # noqa: E402


def main() -> None:
    full = "--full" in sys.argv[1:]
    name = f"probe_{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory() as d:
        spec = load_spec(str(write_scaffold(name, Path(d))))
        files = build.spec_files(spec, True, fp32_weights_only=not full)
        # the objects every optimizer shares: built (or found) first, not timed
        runtime = build._runtime_files(files)
        build.build_files(build.RUNTIME_CPU_NAME, runtime, False, load=False)
        build.build_files(build.RUNTIME_NAME, runtime, True, load=False)
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        lib = build.build_files(name, files, True, load=False)
        wall = time.perf_counter() - t0
    print(f"{'full' if full else 'quick'} CUDA build of a new spec: {wall:.1f} s wall "
          f"(load average {load:.2f} before; {os.cpu_count()} cores): {lib}")


if __name__ == "__main__":
    main()
