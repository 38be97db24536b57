"""The referee's scripts (../shared/tools/fbgemm-anchor: bench_tbe.py for the GPU, bench_cpu.py for
the CPU), imported as modules so that the project's sweeps time with the referee's own code."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load(filename: str):
    """The referee's `filename` as a module: from $TBEGEN_REFEREE, else .anchor/ (the copy carried to
    the GPU machine), else ../shared/tools/fbgemm-anchor beside the checkout."""
    for folder in (os.environ.get("TBEGEN_REFEREE"), ROOT / ".anchor", ROOT.parent / "shared/tools/fbgemm-anchor"):
        if folder and (Path(folder) / filename).is_file():
            spec = importlib.util.spec_from_file_location(f"referee_{Path(filename).stem}", Path(folder) / filename)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    raise SystemExit(f"the referee's {filename} was not found: carry .anchor/ (benchmarks/README.md), or set TBEGEN_REFEREE")
