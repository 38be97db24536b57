"""Registers and stack of the short-run and long-run update kernels, per optimizer, from ptxas.

Compiles generated/SPEC/kernels_cuda.cu for sm_90 (nvcc -cubin -Xptxas -v, about 15 s a spec on 2
cores, no GPU needed) and prints, for each warp, group and segment kernel (float and half
weights), its registers per thread, stack bytes, and the blocks of 256 threads that fit on one
multiprocessor by registers. With --base, the same for another checkout beside it.

The update kernels wait on memory, so a change that costs them a block per multiprocessor, or a
stack, loses more than the latency it hides (benchmarks/NOTES-gpu.md, runs AA and AB). Run this
before spending device time on a kernel change:

    python benchmarks/tools/kernel_registers.py --specs sgd adagrad --base /tmp/base
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

KERNELS = re.compile(r"backward_(warp|group|segment)_kernel")
REGISTERS_PER_SM = 65536
THREADS = 256


def torch_include_flags() -> list[str]:
    from torch.utils.cpp_extension import include_paths

    return ["-I" + p for p in include_paths("cuda")]


def ptxas_report(repo: Path, spec: str, workdir: Path) -> str:
    """ptxas's verbose output for one spec's kernels (its stderr)."""
    from tbegen.build import CUDA_FLAGS  # (the flags the extensions are built with)

    cmd = [
        "nvcc", "-cubin", "-arch=sm_90", "-std=c++17", *CUDA_FLAGS, "-Xptxas", "-v",
        f"-I{repo}/generated/include", f"-I{repo}/generated/{spec}", *torch_include_flags(),
        "-o", str(workdir / f"{repo.name}-{spec}.cubin"), str(repo / "generated" / spec / "kernels_cuda.cu"),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"nvcc failed for {repo}/{spec}:\n{done.stderr[-4000:]}")
    return done.stderr


def demangle(names: list[str]) -> list[str]:
    if not names or shutil.which("c++filt") is None:
        return names
    return subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()


def kernel_table(report: str) -> dict[str, tuple[int, int]]:
    """{short kernel name: (registers, stack bytes)} for the 4-wide update kernels."""
    entries: dict[str, list[int]] = {}
    current = None
    for line in report.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            current = m.group(1)
            entries[current] = [0, 0]
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame", line)
        if m:
            entries[current][1] = max(entries[current][1], int(m.group(1)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            entries[current][0] = int(m.group(1))
            # a kernel that calls a function: its frame and the callee's together
            m = re.search(r"(\d+) bytes cumulative stack size", line)
            if m:
                entries[current][1] = max(entries[current][1], int(m.group(1)))
            current = None  # (the "Function properties" of a callee follow: not this kernel's)
    table = {}
    for mangled, name in zip(entries, demangle(list(entries))):
        if "any_width" in name or "BFloat16" in name or not KERNELS.search(name):
            continue
        short = re.sub(r"tbegen::(cuda::|opt_[a-z_]*::)", "", name)
        short = re.sub(r"\(BackwardArgs.*", "", short).replace("void ", "").replace("Optimizer, ", "")
        table[short] = tuple(entries[mangled])
    return table


def blocks_per_sm(registers: int) -> int:
    """Blocks of THREADS threads that the register file holds (registers are allocated per warp
    in units of 256, i.e. 8 per thread)."""
    per_thread = -(-max(registers, 1) // 8) * 8
    return REGISTERS_PER_SM // (per_thread * THREADS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[2])
    parser.add_argument("--base", type=Path, help="another checkout to compare with (its generated/ sources)")
    parser.add_argument("--specs", nargs="+", default=["sgd", "rowwise_adagrad", "adagrad", "adam"])
    args = parser.parse_args()
    repos = [args.repo] + ([args.base] if args.base else [])
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max_workers=2) as pool:
        jobs = {(r, s): pool.submit(ptxas_report, r, s, Path(tmp)) for r in repos for s in args.specs}
        tables = {key: kernel_table(job.result()) for key, job in jobs.items()}
    for spec in args.specs:
        print(f"== {spec}" + (f" (base {args.base} -> {args.repo})" if args.base else ""))
        new = tables[(args.repo, spec)]
        old = tables[(args.base, spec)] if args.base else {}
        for name in sorted(new):
            regs, stack = new[name]
            now = f"{regs:3d} regs {stack:3d} B stack {blocks_per_sm(regs)} blocks/SM"
            if name in old:
                oregs, ostack = old[name]
                flag = "  <-- fewer blocks" if blocks_per_sm(regs) < blocks_per_sm(oregs) else ""
                flag += "  <-- more stack" if stack > ostack else ""
                print(f"  {oregs:3d}/{ostack:3d} -> {now}  {name}{flag}")
            else:
                print(f"  {now}  {name}")


if __name__ == "__main__":
    main()
