"""Compares the PTX of the fused backward's update kernels between two builds of one optimizer.

Used when the CUDA sources were reorganised without a GPU to run them on (benchmarks/NOTES-ci.md):
if every update kernel's PTX is the same, ptxas turns it into the same machine code, and the
kernels behave as the GPU-verified ones did. Line-number directives (.loc) and the numbering of
labels and local stacks (which follow a kernel's position in the file) are ignored.

    nvcc <the build's flags> -ptx OLD.cu -o old.ptx      # e.g. an earlier generated/sgd/ops_cuda.cu
    nvcc <the build's flags> -ptx NEW.cu -o new.ptx      # generated/sgd/kernels_cuda.cu
    python benchmarks/tools/compare_kernel_ptx.py old.ptx new.ptx
    python benchmarks/tools/compare_kernel_ptx.py --all old_runtime.ptx new_runtime.ptx   # every kernel

Exits 1 when a kernel differs or is missing, printing the start of the difference.
"""

import difflib
import re
import sys

KERNELS = re.compile(r"backward_(warp|segment|finish)_kernel")


def entries(path):
    """{mangled kernel name: normalised PTX body} of the .entry functions in a PTX file."""
    text = open(path).read()
    out = {}
    for m in re.finditer(r"^\.(?:visible|weak)?\s*\.entry\s+(\S+)\(", text, re.M):
        end = text.index("\n}\n", m.start()) + 3
        body = "\n".join(line for line in text[m.start():end].split("\n") if not line.strip().startswith(".loc"))
        body = re.sub(r"\$L__BB\d+_", "$L__BB_", body)
        body = re.sub(r"__local_depot\d+", "__local_depot", body)
        out[m.group(1)] = body
    return out


def main(old_path, new_path, every_kernel=False):
    old, new = entries(old_path), entries(new_path)
    names = sorted(k for k in old if every_kernel or KERNELS.search(k))
    if not names:
        print(f"no update kernels in {old_path}")
        return 1
    bad = 0
    for k in names:
        if k not in new:
            print(f"missing from {new_path}: {k}")
            bad += 1
        elif old[k] != new[k]:
            diff = difflib.unified_diff(old[k].split("\n"), new[k].split("\n"), lineterm="", n=0)
            print(f"differs: {k}\n" + "\n".join(list(diff)[:12]))
            bad += 1
    print(f"{len(names) - bad} of {len(names)} {'kernels' if every_kernel else 'update kernels'} have the same PTX")
    return 1 if bad else 0


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--all"]
    if len(args) != 2:
        sys.exit(__doc__)
    sys.exit(main(args[0], args[1], every_kernel="--all" in sys.argv[1:]))
