"""Builds rendered sources into a torch extension and loads it.

Builds are cached by content: the cache key hashes every source file, the torch version, the
build flavour (CPU only, or CPU + CUDA) and the compiler flags (with -march=native, the host
processor's model and features too; see `cpu_arch_flags`), so an unchanged spec is never rebuilt and a changed one
never loads stale code. The cache lives in $TBEGEN_BUILD_DIR (default ~/.cache/tbegen).

The cache holds shared libraries that are loaded into the process, so it is trusted only as far
as it is checked: its folder must belong to the user and be writable by no one else (`cache_root`);
each entry is built in a temporary folder and renamed into place complete, with the SHA-256 of
its files, which is checked before anything is loaded or linked (`verified`). Processes building
the same entry at once take turns on a file lock: one builds, the others wait and then use it.

A cache hit loads the shared library directly (torch.ops.load_library: milliseconds); only a miss
runs torch.utils.cpp_extension (10-60 s for CPU, 1-4 minutes for CPU + CUDA on 2 cores, depending
on their load), saying which extension it builds and how long it took. It runs in
a build worker: a child process that imports torch and cpp_extension once (3 CPU s) and then
builds extension after extension, one at a time, without loading them (cpp_extension.load would;
a worker builds a spec's CPU and CUDA libraries, which register the same operators, and this
process loads only the verified copy from the cache). There are at most as many workers as builds
running at once (`prebuild`: one per thread); an idle one is kept for the next build and ends
with this process.

Builds compile only what depends on the optimizer. The CPU operators that do not (forward,
grad_per_sample_weights, describe_error: RUNTIME_CPU_SOURCE) are compiled once per set of runtime
headers, as their own cache entry, and their object is linked into every optimizer's library; a
CPU build compiles ops.cpp (the optimizer's backward and the registrations). A CPU + CUDA build
compiles its update kernels (kernels_cuda.cu) and its CUDA operator (ops_cuda.cpp) and links the
CPU build's ops.cpp object, the shared CPU operators' object and the object of the CUDA code
shared by every optimizer (the forward operators, the sort and the backward's host side), also
compiled once for all optimizers (RUNTIME_CUDA_SOURCE).

Where two cores are free for one build, a CPU build compiles ops.cpp as two translation units side
by side (`_ops_sources`: the backward and registrations, and the lane-split backward), about 30%
less wall time for 13-19% more CPU time; builds run two at a time (`prebuild`, MAX_JOBS=1) or on a
busy machine (`split_wanted`: the load average) keep one unit each. `tbegen test --quick` checks
float32 weights only and builds a library of its own that instantiates the backward for them alone
(`spec_files(..., fp32_weights_only=True)`): a third of the compile. Both need the generated
sources' support (TBEGEN_OPS_PART in ops.cpp, TBEGEN_CPU_FP32_WEIGHTS_ONLY in cpu_ops.h); without
it a build compiles ops.cpp whole, as before.

CUDA builds do the same (issue 26: `tbegen test --device cuda --quick`): the float32 library's
update-kernel table holds stubs that raise for the other weights, so their kernels are never
compiled (FP32_KERNELS_SOURCE, `_fp32_kernels_wrapper`); where cores are idle kernels_cuda.cu is
compiled in several translation units side by side (`_kernel_sources`: explicit instantiations,
each kernel compiled once, the same machine code as the whole unit's); and a CUDA build that does
not find the CPU build of its sources compiles their ops.cpp itself, in the same ninja run as its
CUDA units, instead of building the CPU library first (`_reuse_cpu_build`; prebuild of both
flavours, CI, keeps linking the CPU build's objects).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import os
import platform
import re
import stat
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

import torch

from . import build_workers, resources, torch_pch
from .model import OptimizerSpec

_LOADED: Dict[str, str] = {}  # op namespace -> cache key of the library loaded in this process

# -fno-math-errno: sqrtf and friends need not set errno, which lets the compiler vectorise loops
# that call them (adagrad's update ran 20x slower without); it changes no result.
CXX_FLAGS = ["-O3", "-fno-math-errno"]  # plus openmp_flags() and cpu_arch_flags()
# An optimizer's own CUDA sources: its operator (C++ compiler) and its update kernels (nvcc, no
# torch headers: the costly part of nvcc is torch's headers, see benchmarks/NOTES-ci.md).
CUDA_SOURCES = ("ops_cuda.cpp", "kernels_cuda.cu")
# The optimizer-independent CUDA translation unit (the forward operators, the sort, the host side
# of the backward): built once per set of runtime headers, as its own cache entry, and linked
# into every optimizer's CUDA extension.
RUNTIME_CUDA_SOURCE = "include/tbegen/cuda_forward.cu"
RUNTIME_NAME = "runtime_forward"
# The optimizer-independent CPU operators (forward, grad_per_sample_weights, describe_error;
# declared in cpu_ops.h): likewise built once per set of runtime headers, as their own cache
# entry, and linked into every optimizer's extension, CPU and CPU + CUDA (where its sources hold
# this file: a library without the runtime headers links nothing).
RUNTIME_CPU_SOURCE = "include/tbegen/cpu_ops.cpp"
RUNTIME_CPU_NAME = "runtime_ops"
RUNTIMES = (RUNTIME_NAME, RUNTIME_CPU_NAME)
CUDA_FLAGS = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]
# A library for float32 weights only (`tbegen test --quick`): its sources hold this wrapper of
# ops.cpp, which is compiled in its place (so its cache key differs from the full library's).
FP32_WEIGHTS_SOURCE = "ops_fp32_weights.cpp"
FP32_WEIGHTS_MACRO = "TBEGEN_CPU_FP32_WEIGHTS_ONLY"
# ops.cpp as two translation units (`_ops_sources`): wrappers that include it with TBEGEN_OPS_PART
# 1 (the backward, the whole-table stages, the registrations) and 2 (the lane-split backward).
OPS_PART_MACRO = "TBEGEN_OPS_PART"
OPS_PART_SOURCES = ("ops_part1.cpp", "ops_part2.cpp")
# the objects of an optimizer's CPU code, whichever way it was compiled (a CPU + CUDA build links
# those of the CPU build of the same sources)
OPS_OBJECTS = ("ops.o", "ops_fp32_weights.o", "ops_part1.o", "ops_part2.o")
# The CUDA library for float32 weights only (`tbegen test --device cuda --quick`): its sources hold
# this wrapper of kernels_cuda.cu (written by spec_files), whose update-kernel table has, in place of
# the other weight dtypes' kernels, stubs that raise; compiled in place of kernels_cuda.cu.
FP32_KERNELS_SOURCE = "kernels_cuda_fp32_weights.cu"
# kernels_cuda.cu in several translation units side by side (`_kernel_sources`): part 1 is the
# table (kernels_cuda.cu, or its float32 wrapper) with the instantiations of the other parts
# declared `extern template`; each other part instantiates its share explicitly.
KERNEL_PART_SOURCE = "kernels_part{}.cu"
# what the update-kernel table instantiates (include/tbegen/cuda_backward_kernels.cuh,
# backward_kernels_for): launch_backward<Opt, W, kVecs> and launch_any_width<Opt, W>. The split
# and the float32 library are built from these lists; tests/test_cuda_quick_build.py checks that
# they are the table's entries, exactly (a list out of step would only cost compile time: a table
# entry no part instantiates is compiled by part 1, a stub or instantiation the table does not
# use is compiled and never called; the results cannot change).
_LAUNCH_WEIGHTS = ("float", "c10::Half", "c10::BFloat16")
_ANY_WIDTH_WEIGHTS = ("float", "c10::Half", "c10::BFloat16", "uint8_t")
_WIDTHS = (1, 2, 4, 8)
_WEIGHT_NAMES = {"c10::Half": "Half", "c10::BFloat16": "BFloat16", "uint8_t": "Byte (int8 rows)"}


def build_root() -> Path:
    return Path(os.environ.get("TBEGEN_BUILD_DIR", Path.home() / ".cache" / "tbegen"))


def cuda_wanted(with_cuda: Optional[bool]) -> bool:
    return torch.cuda.is_available() if with_cuda is None else with_cuda


def _sources_for(name: str, src_dir: Path, include_dir: Path, with_cuda: bool) -> Dict[str, str]:
    files = {f"{name}/ops.cpp": (src_dir / "ops.cpp").read_text()}
    files[f"{name}/optimizer.h"] = (src_dir / "optimizer.h").read_text()
    files[f"{name}/params.h"] = (src_dir / "params.h").read_text()
    if with_cuda:
        for cu in CUDA_SOURCES:
            files[f"{name}/{cu}"] = (src_dir / cu).read_text()
    for p in sorted(include_dir.rglob("*")):
        if p.is_file():
            files[f"include/{p.relative_to(include_dir).as_posix()}"] = p.read_text()
    return files


def cuda_arch_list() -> str:
    """The GPU architectures CUDA builds target: $TORCH_CUDA_ARCH_LIST, else this machine's GPU
    (torch's own default), else Hopper (9.0), the project's target, on a machine without a GPU."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if env:
        return env
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{major}.{minor}"
    return "9.0"


def cuda_code() -> str:
    """What a CUDA build makes of the device code: "sass" (machine code for cuda_arch_list(), what a
    GPU runs) or "ptx" (the architectures' PTX only, which a driver would compile when the library
    is loaded on a GPU). $TBEGEN_CUDA_CODE chooses; by default "sass" where a GPU is present and
    "ptx" where none is. A CUDA build on a machine without a GPU (CI) can only check that every
    kernel compiles and links: nvcc's front end and optimizer still see all of it, and leaving
    out ptxas, the assembler, halves the time (benchmarks/NOTES-ci.md). The GPU machine builds
    machine code and runs the kernels."""
    code = os.environ.get("TBEGEN_CUDA_CODE")
    if code is None:
        return "sass" if torch.cuda.is_available() else "ptx"
    if code not in ("sass", "ptx"):
        raise ValueError(f"tbegen: TBEGEN_CUDA_CODE={code!r}: expected 'sass' (machine code) or 'ptx'")
    return code


def _compute_capabilities(arch_list: str) -> List[str]:
    """"8.0;9.0+PTX" -> ["80", "90"] (TORCH_CUDA_ARCH_LIST's numeric form; named architectures are
    not accepted here)."""
    found = []
    for item in re.split(r"[;\s]+", arch_list.strip()):
        if not item:
            continue
        m = re.fullmatch(r"([0-9]+)\.([0-9]+)([a-z]?)(\+PTX)?", item)
        if m is None:
            raise ValueError(f"tbegen: TORCH_CUDA_ARCH_LIST={arch_list!r}: {item!r} is not an architecture "
                             "number such as 9.0 (needed to build PTX: TBEGEN_CUDA_CODE=ptx)")
        found.append(f"{m.group(1)}{m.group(2)}{m.group(3)}")
    return found


def cuda_flags() -> List[str]:
    """nvcc's flags for the CUDA sources: CUDA_FLAGS, and for cuda_code() "ptx" a PTX-only
    -gencode per architecture (cpp_extension then adds no architecture flags of its own)."""
    if cuda_code() == "sass":
        return list(CUDA_FLAGS)
    return list(CUDA_FLAGS) + [f"-gencode=arch=compute_{c},code=compute_{c}"
                               for c in _compute_capabilities(cuda_arch_list())]


def cpu_arch_flags() -> List[str]:
    """Instruction-set flags for the C++ sources, from $TBEGEN_CPU_ARCH.

    The default on x86-64 is `native`: the extension is built on the machine that runs it, and
    AVX2/AVX-512 make the CPU kernels about a quarter faster than the baseline x86-64 code
    (docs/cpu-results.md). `portable` adds no flag (the compiler's baseline, the same on every
    x86-64 machine: use it where a build cache is shared by different machines, or where the
    last bits of CPU results must match across them); any other value is passed as -march=VALUE
    (x86-64-v3, znver4, ...). Elsewhere (ARM) the default is `portable`."""
    arch = os.environ.get("TBEGEN_CPU_ARCH")
    if arch is None:
        arch = "native" if platform.machine().lower() in ("x86_64", "amd64") else "portable"
    if not re.fullmatch(r"[A-Za-z0-9_.+-]+", arch):
        raise ValueError(f"tbegen: TBEGEN_CPU_ARCH={arch!r} is not a -march value (or 'native', 'portable')")
    return [] if arch == "portable" else [f"-march={arch}"]


@functools.lru_cache(maxsize=None)
def _host_cpu() -> str:
    """What -march=native compiles for: the processor's model and feature flags (Linux), so that
    a build cache shared by different machines never hands one of them code it cannot run."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f.read().splitlines() if ln.split(":")[0].strip() in ("model name", "flags", "Features")]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def openmp_flags() -> List[str]:
    """-fopenmp where torch parallelises with OpenMP: at::parallel_for is a header template that
    runs serially unless the extension itself is compiled with OpenMP. Compile only: the OpenMP
    runtime calls resolve to the one torch has already loaded (linking another would give the
    process two thread pools, and torch.set_num_threads would not reach ours)."""
    if torch.backends.openmp.is_available() and platform.system() == "Linux":
        return ["-fopenmp"]
    return []


def cxx_flags() -> List[str]:
    return CXX_FLAGS + openmp_flags() + cpu_arch_flags()


_LINE_DIRECTIVE_RE = re.compile(r'#line [0-9]+( "[^"\n]*")?$')
_LINE_COMMENT_RE = re.compile(r"\s*//.*$")


def compiled_text(text: str) -> str:
    """`text` less what cannot change the compiled code: the numbers of `#line` directives (which
    move when a spec's reference, summary or comments change length) and `//` comments (the
    generated files' headers and docs). A line is changed only where that is certain: it has no
    quote (a string could hold `//`), no `/*` or `*/` (a comment inside a block comment could hide
    code after it) and no line continuation."""
    out = []
    for line in text.split("\n"):
        directive = _LINE_DIRECTIVE_RE.match(line.strip())
        if directive:
            out.append("#line" + (directive.group(1) or ""))
            continue
        if '"' in line or "'" in line or "/*" in line or "*/" in line or line.endswith("\\"):
            out.append(line)
            continue
        code = _LINE_COMMENT_RE.sub("", line) if "//" in line else line
        if code.strip() or not line.strip():
            out.append(code)
    return "\n".join(out)


def cache_key(name: str, files: Dict[str, str], with_cuda: bool) -> str:
    h = hashlib.sha256()
    flags = cxx_flags()
    h.update(f"{name}\0{torch.__version__}\0{with_cuda}\0{flags}\0{CUDA_FLAGS}\0".encode())
    if "-march=native" in flags:
        h.update(_host_cpu().encode())
    if with_cuda:
        h.update(f"{cuda_arch_list()}\0{cuda_flags()}".encode())
    for rel in sorted(files):  # what the compiler sees (a reference-only change rebuilds nothing)
        h.update(rel.encode() + b"\0" + compiled_text(files[rel]).encode() + b"\0")
    return h.hexdigest()[:16]


def _cuda_library_includes() -> list:
    """Header folders of the CUDA libraries torch's CUDA headers include (cusparse.h, cublas...).

    A pip-installed torch ships them inside its nvidia packages rather than in CUDA_HOME."""
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME and (Path(CUDA_HOME) / "include" / "cusparse.h").exists():
        return []
    import site

    found = []
    for root in site.getsitepackages() + [site.getusersitepackages()]:
        nvidia = Path(root) / "nvidia"
        if nvidia.is_dir():
            found += sorted(str(p.parent) for p in nvidia.glob("*/include/cusparse.h"))
    return found


def _cuda_link_flags() -> list:
    """-L for libcudart where torch's default (CUDA_HOME/lib64) lacks it, e.g. a toolkit whose
    libraries sit in lib/ next to a CUDA_HOME inferred from nvcc's symlink."""
    import shutil

    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME and (Path(CUDA_HOME) / "lib64" / "libcudart.so").exists():
        return []
    candidates = []
    if CUDA_HOME:
        candidates.append(Path(CUDA_HOME) / "lib")
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = Path(os.path.realpath(nvcc)).parent.parent
        candidates += [real / "lib64", real / "lib"]
    # nvcc may be a wrapper script; look where toolkits are usually installed
    for root in sorted(Path("/usr/local").glob("cuda*"), reverse=True):
        candidates += [root / "lib64", root / "lib"]
    for c in candidates:
        if (c / "libcudart.so").exists():
            return [f"-L{c}"]
    return []


def _library_name(name: str, key: str, with_cuda: bool) -> str:
    return f"tbegen_{name}_{'cuda' if with_cuda else 'cpu'}_{key}"


def _flavour(with_cuda: bool) -> str:
    return "CPU + CUDA" if with_cuda else "CPU"


def _describe(name: str, with_cuda: bool) -> str:
    """What a build makes, for progress messages."""
    if name == RUNTIME_NAME:
        return "the CUDA runtime shared by every optimizer (forward operators, sort, backward launches)"
    if name == RUNTIME_CPU_NAME:
        return "the CPU operators shared by every optimizer (forward, grad_per_sample_weights, describe_error)"
    return f"the {name} extension ({_flavour(with_cuda)})"


# ---- the cache directory and its entries ------------------------------------------------------
# An entry is a folder NAME-{cpu,cuda}-KEY holding the library, the objects other builds reuse,
# and DIGEST_FILE: the key and the SHA-256 of each of those files. It is built in a temporary
# folder and renamed into place complete, digest last, so an entry without its digest file is
# never used (a crash leaves only a temporary folder behind).

DIGEST_FILE = "digests.json"


class CacheError(RuntimeError):
    """The build cache cannot be trusted: wrong owner or permissions, or a changed file."""


def cache_root() -> Path:
    """build_root(), created private (0700) if missing and checked: shared libraries in it are
    loaded into this process, so it must belong to this user and be writable by no one else."""
    root = build_root()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = root.stat()
    if st.st_uid != os.getuid():
        raise CacheError(
            f"tbegen: the build cache {root} belongs to another user (uid {st.st_uid}, you are {os.getuid()}); "
            "the libraries in it are loaded into this process. Set TBEGEN_BUILD_DIR to a folder of your own."
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheError(
            f"tbegen: the build cache {root} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}); "
            f"the libraries in it are loaded into this process. Run `chmod go-w {root}` or set "
            "TBEGEN_BUILD_DIR to a private folder."
        )
    return root


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _is_published(entry: Path) -> bool:
    return (entry / DIGEST_FILE).is_file()


def verified(entry: Path, key: str, filename: str) -> Path:
    """entry/filename, after checking it against the digest recorded when the entry was built."""
    import json

    path = entry / filename
    try:
        record = json.loads((entry / DIGEST_FILE).read_text())
        expected = record["files"][filename] if record.get("key") == key else None
    except (OSError, ValueError, KeyError, TypeError):
        expected = None
    if expected is None or not path.is_file() or _sha256(path) != expected:
        raise CacheError(
            f"tbegen: {path} does not match the digest recorded when it was built (changed, replaced or "
            f"damaged since); refusing to load it. Delete {entry} to rebuild it."
        )
    return path


@contextlib.contextmanager
def _entry_lock(root: Path, entry: Path, what: str):
    """Holds an exclusive lock for building `entry`; says so when another process holds it."""
    import fcntl

    lock_dir = root / "locks"
    lock_dir.mkdir(mode=0o700, exist_ok=True)
    with open(lock_dir / f"{entry.name}.lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"tbegen: another build (of this or another process) is compiling {what}; waiting for it "
                  f"(lock {f.name})", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            fcntl.flock(f, fcntl.LOCK_EX)
            print(f"tbegen: {what} is ready (waited {time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _publish(tmp: Path, entry: Path, key: str, filenames: List[str]) -> None:
    """Records the digests of `filenames` in tmp, then renames tmp to entry (atomic)."""
    import json
    import shutil

    record = {"key": key, "files": {n: _sha256(tmp / n) for n in filenames if (tmp / n).is_file()}}
    (tmp / DIGEST_FILE).write_text(json.dumps(record, indent=1) + "\n")
    if entry.exists():  # an unpublished leftover (no digest file): replaced
        shutil.rmtree(entry)
    os.rename(tmp, entry)


# ---- building ---------------------------------------------------------------------------------


def build_files(name: str, files: Dict[str, str], with_cuda: bool, verbose: bool = False,
                load: bool = True) -> Path:
    """Builds {relative path: text} sources (one optimizer) and returns the library's path.

    With `load`, also loads it into this process, registering torch.ops.tbegen_NAME. A CPU + CUDA
    build links the objects of `_reused_objects` (built first if needed) instead of compiling them
    again.
    """
    key = cache_key(name, files, with_cuda)
    namespace = f"tbegen_{name}"
    if load and namespace in _LOADED:
        if _LOADED[namespace] != key:
            raise RuntimeError(
                f"tbegen: a different build of optimizer '{name}' is already loaded in this process "
                f"(changed spec, or CPU-only vs CUDA build); start a new process to load this one"
            )
        return build_root() / key
    root = cache_root()
    libname = _library_name(name, key, with_cuda)
    entry = root / f"{name}-{'cuda' if with_cuda else 'cpu'}-{key}"
    if not _is_published(entry):
        objects = [] if name in RUNTIMES else _reused_objects(name, files, with_cuda, verbose)
        if with_cuda:
            _say_cuda_code_once()
        with _entry_lock(root, entry, _describe(name, with_cuda)):
            if not _is_published(entry):  # unless another process built it while we waited
                tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=root))
                try:
                    _compile_in_worker(name, files, with_cuda, tmp, libname, verbose, [str(o) for o in objects])
                    _publish(tmp, entry, key, [f"{libname}.so", *OPS_OBJECTS, _object_name(RUNTIME_CUDA_SOURCE),
                                               _object_name(RUNTIME_CPU_SOURCE)])
                finally:
                    if tmp.exists():
                        import shutil

                        shutil.rmtree(tmp)
    lib_path = verified(entry, key, f"{libname}.so")
    if load:
        torch.ops.load_library(str(lib_path))
        _LOADED[namespace] = key
    return lib_path


@functools.lru_cache(maxsize=None)
def _say_cuda_code_once() -> None:
    """Says, once per process, that CUDA builds here make PTX only (see cuda_code)."""
    if cuda_code() == "ptx":
        reason = "TBEGEN_CUDA_CODE=ptx" if os.environ.get("TBEGEN_CUDA_CODE") else "no GPU here"
        print(f"tbegen: {reason}: the CUDA builds compile the device code to PTX only, which checks that it "
              "compiles and links; TBEGEN_CUDA_CODE=sass builds machine code", file=sys.stderr, flush=True)


def _object_name(source: str) -> str:
    """The object file cpp_extension makes of a source: ops.cpp -> ops.o, x.cu -> x.cuda.o."""
    stem, ext = os.path.splitext(os.path.basename(source))
    return f"{stem}.cuda.o" if ext == ".cu" else f"{stem}.o"


def _ops_objects(entry: Path) -> List[str]:
    """The ops.cpp object(s) a published CPU entry holds (OPS_OBJECTS, in that order; verified by
    the caller)."""
    import json

    try:
        recorded = json.loads((entry / DIGEST_FILE).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        recorded = {}
    found = [o for o in OPS_OBJECTS if o in recorded]
    if not found:
        raise CacheError(f"tbegen: {entry} holds no compiled ops.cpp object ({', '.join(OPS_OBJECTS)}); "
                         f"delete {entry} to rebuild it")
    return found


def split_jobs() -> int:
    """How many compiler processes one build may run (cpp_extension's MAX_JOBS where set: prebuild
    sets 1 when it runs builds side by side; else the core count)."""
    value = os.environ.get("MAX_JOBS")
    if value:
        try:
            return max(1, int(value))
        except ValueError:
            raise ValueError(f"tbegen: MAX_JOBS={value!r} is not a number of compiler processes") from None
    return os.cpu_count() or 1


def split_wanted() -> bool:
    """Whether a CPU build compiles ops.cpp in two parts side by side: $TBEGEN_CPU_SPLIT "1" or "0"
    decides; by default ("auto") where the build may run two compiler processes (`split_jobs`)
    and a core is idle (the load average under the core count less one half: on a busy machine,
    CI's two test workers or prebuild's builds side by side, the second part only adds CPU time)."""
    setting = os.environ.get("TBEGEN_CPU_SPLIT", "auto")
    if setting not in ("auto", "0", "1"):
        raise ValueError(f"tbegen: TBEGEN_CPU_SPLIT={setting!r}: expected 'auto', '0' or '1'")
    if setting != "auto":
        return setting == "1"
    return split_jobs() >= 2 and _core_idle()


def _core_idle() -> bool:
    """Whether a core is idle: the load average under the core count less one half (the rule of
    split_wanted and kernel_parts)."""
    try:
        return os.getloadavg()[0] < (os.cpu_count() or 1) - 0.5
    except OSError:
        return False


def _ops_sources(name: str, files: Dict[str, str], src: Path) -> List[str]:
    """The translation units of an optimizer's CPU code: NAME/ops.cpp, or the float32-weights
    wrapper where the sources hold it; split in two (OPS_PART_SOURCES, written here, beside it)
    where ops.cpp supports it and `split_wanted()`. The split makes the same functions from the
    same code with the same flags (tests/test_build_split.py: the same results, bit for bit); only
    their order in the library differs, so it is not part of the cache key."""
    unit = FP32_WEIGHTS_SOURCE if f"{name}/{FP32_WEIGHTS_SOURCE}" in files else "ops.cpp"
    if OPS_PART_MACRO not in files.get(f"{name}/ops.cpp", "") or not split_wanted():
        return [str(src / name / unit)]
    sources = []
    for part, wrapper in enumerate(OPS_PART_SOURCES, 1):
        path = src / name / wrapper
        path.write_text(f"// tbegen/build.py: part {part} of {unit}, compiled beside the other part\n"
                        f"#define {OPS_PART_MACRO} {part}\n#include \"{unit}\"\n")
        sources.append(str(path))
    return sources


def _kernel_instances(name: str, files: Dict[str, str]) -> List[str]:
    """The update-kernel table's instantiations the library compiles (as explicit-instantiation
    declarators): every weight dtype's, or float32's only in a float32 library."""
    opt = f"opt_{name}::Optimizer"
    fp32 = f"{name}/{FP32_KERNELS_SOURCE}" in files
    return ([f"cudaError_t launch_backward<{opt}, {w}, {k}>(const BackwardLaunch&)"
             for w in (_LAUNCH_WEIGHTS[:1] if fp32 else _LAUNCH_WEIGHTS) for k in _WIDTHS]
            + [f"cudaError_t launch_any_width<{opt}, {w}>(const AnyWidthLaunch&)"
               for w in (_ANY_WIDTH_WEIGHTS[:1] if fp32 else _ANY_WIDTH_WEIGHTS)])


def kernel_parts(name: str, files: Dict[str, str], other_units: int) -> int:
    """Into how many translation units a CUDA build splits the optimizer's update kernels, when
    `other_units` others (ops_cuda.cpp, and the ops.cpp units it compiles itself) compile beside
    them: $TBEGEN_CUDA_SPLIT "0" (one), a number (that many), or "auto" (the default): as many as
    the compiler processes the build may run (`split_jobs`) leave beside the others, where a core
    is idle (`_core_idle`); at most one per instantiation (16, or 5 for float32 weights only)."""
    setting = os.environ.get("TBEGEN_CUDA_SPLIT", "auto")
    if setting != "auto" and not setting.isdigit():
        raise ValueError(f"tbegen: TBEGEN_CUDA_SPLIT={setting!r}: expected 'auto' or a number of translation units")
    instances = len(_kernel_instances(name, files))
    if setting != "auto":
        return max(1, min(int(setting), instances))
    return max(1, min(instances, split_jobs() - other_units)) if _core_idle() else 1


def _kernel_sources(name: str, files: Dict[str, str], src: Path, other_units: int) -> List[str]:
    """The translation units of the optimizer's update kernels: NAME/kernels_cuda.cu (or the
    float32 wrapper where the sources hold it), whole, or in `kernel_parts` parts (written here,
    beside it): the table's instantiations dealt round-robin, part 1 the table itself with the
    others' declared `extern template` (so it does not compile them), each other part an explicit
    instantiation of its share. Each kernel is compiled once, from the same code with the same
    flags as in the whole unit: the same machine code (tests/test_cuda_quick_build.py compares
    the PTX; the sm_90 SASS was compared kernel by kernel, benchmarks/NOTES-ci.md), so the split
    is not part of the cache key."""
    unit = FP32_KERNELS_SOURCE if f"{name}/{FP32_KERNELS_SOURCE}" in files else "kernels_cuda.cu"
    parts = kernel_parts(name, files, other_units)
    if parts < 2:
        return [str(src / name / unit)]
    instances = _kernel_instances(name, files)
    shares = [instances[i::parts] for i in range(parts)]
    head = "#include \"tbegen/cuda_backward_kernels.cuh\"\n#include \"optimizer.h\"\n\nnamespace tbegen {\nnamespace cuda {\n"
    tail = "}  // namespace cuda\n}  // namespace tbegen\n"
    sources = []
    for i, share in enumerate(shares, 1):
        path = src / name / KERNEL_PART_SOURCE.format(i)
        if i == 1:
            others = [d for other in shares[1:] for d in other]
            text = (f"// tbegen/build.py: part 1 of {parts} of {unit}: the table, and {len(share)} of its kernel "
                    "instantiations (the others in the other parts)\n" + head
                    + "".join(f"extern template {d};\n" for d in others) + tail + f"\n#include \"{unit}\"\n")
        else:
            text = (f"// tbegen/build.py: part {i} of {parts} of {unit}: {len(share)} of its kernel instantiations\n"
                    + head + "".join(f"template {d};\n" for d in share) + tail)
        path.write_text(text)
        sources.append(str(path))
    return sources


def _runtime_files(files: Dict[str, str]) -> Dict[str, str]:
    """The sources of the runtime objects: the runtime headers (and their two source files)."""
    return {k: v for k, v in files.items() if k.startswith("include/")}


def _reused_objects(name: str, files: Dict[str, str], with_cuda: bool, verbose: bool) -> List[Path]:
    """The compiled objects an optimizer's build links instead of compiling them (each built first
    if needed, and verified): the optimizer-independent CPU operators (RUNTIME_CPU_SOURCE)
    compiled for these runtime headers; for CPU + CUDA also the optimizer-independent CUDA code
    (RUNTIME_CUDA_SOURCE) and, where `_reuse_cpu_build` says so, the ops.cpp object(s) of the
    CPU-only build of the same sources (OPS_OBJECTS: one, or two where it was split); otherwise
    the CUDA build compiles ops.cpp itself, beside its CUDA sources (`_compile`)."""
    runtime_files = _runtime_files(files)
    objects = []
    if RUNTIME_CPU_SOURCE in files:
        runtime_lib = build_files(RUNTIME_CPU_NAME, runtime_files, False, verbose, load=False)
        objects.append(verified(runtime_lib.parent, cache_key(RUNTIME_CPU_NAME, runtime_files, False),
                                _object_name(RUNTIME_CPU_SOURCE)))
    if not with_cuda:
        return objects
    cpu_files = {k: v for k, v in files.items()
                 if k not in {f"{name}/{cu}" for cu in CUDA_SOURCES + (FP32_KERNELS_SOURCE,)}}
    cpu_key = cache_key(name, cpu_files, False)
    if _reuse_cpu_build(cache_root() / f"{name}-cpu-{cpu_key}"):
        cpu_lib = build_files(name, cpu_files, False, verbose, load=False)
        objects += [verified(cpu_lib.parent, cpu_key, o) for o in _ops_objects(cpu_lib.parent)]
    runtime_lib = build_files(RUNTIME_NAME, runtime_files, True, verbose, load=False)
    objects.append(verified(runtime_lib.parent, cache_key(RUNTIME_NAME, runtime_files, True),
                            _object_name(RUNTIME_CUDA_SOURCE)))
    return objects


_PREBUILDS = [0]  # how many prebuild() calls that build CPU libraries are running (any thread)


def _reuse_cpu_build(cpu_entry: Path) -> bool:
    """Whether a CPU + CUDA build links the ops.cpp objects of the CPU build of the same sources
    (built first, if need be) rather than compile ops.cpp itself beside its CUDA sources: where
    that CPU build exists or is being built (its lock is held), where builds run one compiler
    process each (`split_jobs`: MAX_JOBS=1, as prebuild sets on a machine of few cores), and while
    a prebuild of CPU libraries runs (it builds the CPU flavour of the same specs beside: CI's two
    flavours compile ops.cpp once). Otherwise (`tbegen test --device cuda`, the module on a GPU machine) the CPU
    build would only delay the CUDA compile it could run beside: the CUDA build compiles the same
    ops.cpp units itself, in the same ninja run as its CUDA units."""
    import fcntl

    if _is_published(cpu_entry) or _PREBUILDS[0] or split_jobs() < 2:
        return True
    lock = cpu_entry.parent / "locks" / f"{cpu_entry.name}.lock"
    if not lock.is_file():
        return False
    with open(lock, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True  # (being built: wait for it, and link its objects)
        fcntl.flock(f, fcntl.LOCK_UN)
    return False


def _cpp_extension():
    """torch.utils.cpp_extension, without its "No CUDA runtime is found" warning (logged on import
    where nvcc exists but no GPU does: expected here, and not something a user can act on)."""
    import logging

    class _NoCudaRuntimeFilter(logging.Filter):
        def filter(self, record):
            return not str(record.msg).startswith("No CUDA runtime is found")

    logger = logging.getLogger("torch.utils.cpp_extension")
    if not any(isinstance(f, _NoCudaRuntimeFilter) for f in logger.filters):
        logger.addFilter(_NoCudaRuntimeFilter())
    from torch.utils import cpp_extension

    return cpp_extension


def _compile(name: str, files: Dict[str, str], with_cuda: bool, out_dir: Path, libname: str,
             verbose: bool, objects: Sequence[str] = ()) -> None:
    """Compiles and links (torch.utils.cpp_extension, with the load it ends with prevented: run
    it in a build worker, see _compile_in_worker) into out_dir/libname.so, linking `objects` too.

    The sources: NAME/ops.cpp (`_ops_sources`, unless its objects are among `objects`) and, for
    CUDA, CUDA_SOURCES;
    for RUNTIME_NAME, only RUNTIME_CUDA_SOURCE; for RUNTIME_CPU_NAME, only RUNTIME_CPU_SOURCE."""
    cpp_extension = _cpp_extension()
    src = out_dir / "src"
    for rel, text in files.items():
        path = src / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if name == RUNTIME_NAME:
        sources = [str(src / RUNTIME_CUDA_SOURCE)]
    elif name == RUNTIME_CPU_NAME:
        sources = [str(src / RUNTIME_CPU_SOURCE)]
    else:
        linked = {os.path.basename(o) for o in objects}
        sources = [] if linked & set(OPS_OBJECTS) else _ops_sources(name, files, src)
        if with_cuda:
            sources.append(str(src / name / "ops_cuda.cpp"))
            sources += _kernel_sources(name, files, src, len(sources))
    if with_cuda:
        os.environ["TORCH_CUDA_ARCH_LIST"] = cuda_arch_list()
    flavour = "CPU + CUDA" if with_cuda else "CPU"
    # (the precompiled torch headers only for sources that include torch: for others, such as the
    # tests' one-function libraries, making the .gch would cost ~12 CPU s and save nothing)
    pch = torch_pch.include_flags(out_dir.parent) if any(map(_TORCH_INCLUDE.search, files.values())) else []
    try:
        _build_without_loading(cpp_extension, libname, out_dir, lambda: _load_extension(
            cpp_extension, name, libname, sources, src, out_dir, with_cuda, verbose, objects, pch))
    except RuntimeError as e:
        if not str(e).startswith("Error building extension"):
            raise
        raise _compile_error(name, flavour, str(e), files, out_dir) from None


def _compile_error(name: str, flavour: str, log: str, files: Dict[str, str], out_dir: Path):
    """The compiler's complaint in the spec's terms (a few lines), its full output kept in a log."""
    from .compile_errors import CompileError, report

    # (beside the cache entries: a failed build's own folder is a temporary one, removed)
    log_path = out_dir.parent / f"{name}-{'cuda' if 'CUDA' in flavour else 'cpu'}-compiler-errors.log"
    log_path.write_text(log)
    # (#line directives name specs relative to the data root: resources.py)
    return CompileError(report(name, flavour, log, files, log_path, resources.DATA_ROOT), log_path)


_TORCH_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include[ \t]*<(?:torch|ATen|c10)/", re.M)


def _load_extension(cpp_extension, name, libname, sources, src, out_dir, with_cuda, verbose, objects,
                    pch=()) -> None:
    cpp_extension.load(
        name=libname,
        sources=sources,
        extra_include_paths=[str(src / "include"), str(src / name)]
        + (_cuda_library_includes() if with_cuda else []),
        # (+ the precompiled torch headers where they exist: a speed-up only, the same object code,
        # so not part of the cache key; tbegen/torch_pch.py)
        extra_cflags=cxx_flags() + list(pch),
        extra_cuda_cflags=cuda_flags(),
        extra_ldflags=list(objects) + (_cuda_link_flags() if with_cuda else []),
        build_directory=str(out_dir),
        with_cuda=with_cuda,
        is_python_module=False,
        is_standalone=False,
        verbose=verbose,
    )


# how often a running build says it is still running
PROGRESS_EVERY_S = 60.0


# ---- build workers ----------------------------------------------------------------------------
# torch.utils.cpp_extension.load() loads what it builds into the process that calls it, and
# importing torch with it costs about 3 CPU s. The builds therefore run in worker processes: a
# worker imports torch and cpp_extension once, then builds extensions one after another, as it is
# asked (one JSON line per request on one pipe, one JSON line per reply on another; its stdout and
# stderr are this process's, so compiler output shows as before). A worker never loads what it
# builds (`_build_without_loading`): it builds both flavours of a spec, whose libraries register
# the same operator namespace, and this process loads only the verified copy from the cache. A
# build holds one worker at a time (a CPU + CUDA build has its reused objects built before it asks
# for its own), so there are at most as many workers as concurrent builds; idle ones are kept for
# later builds (one, or one per thread while `prebuild` runs) and end with this process.

_WORKER_CODE = build_workers.WORKER_CODE


class _WorkerLost(RuntimeError):
    """The worker process ended (crashed, or was killed) before replying."""


def _cpu_seconds() -> float:
    """User + system CPU time of this process and of its waited-for children (ninja, compilers)."""
    import resource

    use = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in use)


def _build_without_loading(cpp_extension, libname: str, out_dir: Path, build) -> None:
    """Runs build() (which calls cpp_extension.load) without loading the library it makes.

    load() with is_python_module=False ends by loading the library with torch.ops.load_library
    (its documented behaviour); while build() runs, that function is replaced by one that only
    checks the path. Used only in build workers, which load nothing themselves: the library is then
    loaded in a forked copy of the worker (`_load_in_a_fork`), so that one that does not load (an
    unresolved symbol) fails its build, as it did when each build ran in a process of its own. Also forgets what
    cpp_extension remembers of an earlier build of the same name in this process (its versioner
    would otherwise build a second `libname` as `libname_v1`), so that rebuilding an entry
    (after a failure, or of a removed entry) makes out_dir/libname.so again."""
    versioner = getattr(cpp_extension, "JIT_EXTENSION_VERSIONER", None)
    if versioner is not None:
        versioner.entries.pop(libname, None)
    expected = out_dir / f"{libname}{cpp_extension.LIB_EXT}"
    asked = []

    def load_library(path):
        asked.append(path)

    real = torch.ops.load_library
    torch.ops.load_library = load_library
    try:
        build()
    finally:
        torch.ops.load_library = real
    if [os.path.realpath(p) for p in asked] != [os.path.realpath(expected)] or not expected.is_file():
        raise RuntimeError(f"tbegen: cpp_extension did not build {expected} as expected (asked to load {asked})")
    complaint = _load_in_a_fork(expected)
    if complaint:
        raise RuntimeError(f"tbegen: {expected.name} was built but does not load: {complaint}")


def _load_in_a_fork(path: Path) -> str:
    """Loads the library `path` in a forked copy of this process and returns "" or why it failed.

    The worker itself loads nothing (see above), but a library with an unresolved symbol must fail
    its build, not its first use from the cache: the fork has torch imported already, so the check
    costs one dlopen. (Where fork is missing, nothing is checked.)"""
    if not hasattr(os, "fork"):
        return ""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the copy: load, report, and leave without running any of this process's cleanup
        os.close(read_end)
        code = 0
        try:
            import ctypes

            # (what torch.ops.load_library does, without its message that drops the loader's reason)
            ctypes.CDLL(str(path))
        except BaseException as e:  # noqa: BLE001 - everything is reported to the worker
            os.write(write_end, f"{type(e).__name__}: {e}".encode(errors="replace")[:4000])
            code = 1
        os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        message = f.read().decode(errors="replace").strip()
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) == 0:
        return ""
    return message or f"the loading process ended with status {os.waitstatus_to_exitcode(status)}"


def _worker_main(requests_fd: int, replies_fd: int) -> None:
    """A build worker's loop (run with _WORKER_CODE): each request is _compile's arguments and the
    environment of the requesting process (which the build then runs in); each reply says how the
    build ended and its CPU time. Ends when the requests pipe closes or the parent process is gone."""
    import json
    import select
    import traceback

    from .compile_errors import CompileError

    parent = os.getppid()
    _cpp_extension()  # imported once for all the builds of this worker
    with os.fdopen(requests_fd, "r") as requests, os.fdopen(replies_fd, "w") as replies:
        while True:
            if not select.select([requests], [], [], 5.0)[0]:
                if os.getppid() != parent:  # orphaned: nobody will ask again
                    return
                continue
            line = requests.readline()
            if not line:
                return
            a = json.loads(line)
            os.environ.clear()
            os.environ.update(a["env"])
            t0 = _cpu_seconds()
            try:
                _compile(a["name"], a["files"], a["with_cuda"], Path(a["out_dir"]), a["libname"], a["verbose"],
                         a["objects"])
                reply = dict(ok=True)
            except CompileError as e:
                reply = dict(ok=False, message=str(e), log=str(e.log_path))
            except Exception as e:  # said in the reply, traceback included; the worker stays usable
                # (not printed here: the worker's stderr is the terminal of whoever started it, where
                # a failure the requester expects and handles, a library that must not load, would
                # show as a stray traceback in the middle of a passing run)
                reply = dict(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
            reply["cpu"] = _cpu_seconds() - t0
            replies.write(json.dumps(reply) + "\n")
            replies.flush()


class _Worker:
    """One build worker process, seen from the process that asks it to build."""

    def __init__(self):
        # (started by build_workers, which needs no torch: `tbegen test` starts one before it
        # imports torch, and the first build takes it)
        self.proc, self.requests, self.replies = build_workers.take()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def build(self, request: dict, waiting) -> dict:
        """Sends one request and returns its reply, calling waiting() every PROGRESS_EVERY_S."""
        import json
        import select

        try:
            self.requests.write(json.dumps(request) + "\n")
            self.requests.flush()
        except BrokenPipeError:
            raise _WorkerLost() from None
        while not select.select([self.replies], [], [], PROGRESS_EVERY_S)[0]:
            waiting()
        line = self.replies.readline()
        if not line:
            raise _WorkerLost()
        return json.loads(line)

    def close(self, kill: bool = False) -> None:
        import subprocess

        with contextlib.suppress(OSError):
            self.requests.close()  # (end of requests: the worker's loop ends)
        if kill:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.replies.close()


_WORKERS_LOCK = threading.Lock()
_IDLE_WORKERS: List[_Worker] = []
_KEEP_IDLE = [1]  # how many idle workers are kept for later builds (prebuild: one per thread)


def _take_worker() -> _Worker:
    with _WORKERS_LOCK:
        while _IDLE_WORKERS:
            worker = _IDLE_WORKERS.pop()
            if worker.alive():
                return worker
            worker.close()
    return _Worker()


def _give_back_worker(worker: _Worker) -> None:
    with _WORKERS_LOCK:
        if worker.alive() and len(_IDLE_WORKERS) < _KEEP_IDLE[0]:
            _IDLE_WORKERS.append(worker)
            return
    worker.close()


def _keep_idle_workers(n: int) -> None:
    """Keeps at most n idle workers from now on (closing the others)."""
    with _WORKERS_LOCK:
        _KEEP_IDLE[0] = n
        extra = _IDLE_WORKERS[n:]
        del _IDLE_WORKERS[n:]
    for worker in extra:
        worker.close()


atexit.register(_keep_idle_workers, 0)


def _compile_in_worker(name, files, with_cuda, out_dir, libname, verbose, objects=()) -> None:
    """Runs _compile in a build worker (see above), saying what it builds and how long it takes;
    raises the CompileError the worker reports, or a RuntimeError if the build failed otherwise."""
    what = _describe(name, with_cuda)
    # (measured: CPU 10-16 s on 2 idle cores, 37-63 s on 2 busy ones; CPU + CUDA 60-125 s, longer
    # under load: docs/cpu-results.md)
    print(f"tbegen: building {what}; "
          f"{'usually 1-4 minutes' if with_cuda else 'usually 10-60 s'} on 2 cores, depending on their load",
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()

    def waiting():
        print(f"tbegen: still building {what}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

    request = dict(name=name, files=files, with_cuda=with_cuda, out_dir=str(out_dir), libname=libname,
                   verbose=verbose, objects=list(objects), env=dict(os.environ))
    worker = _take_worker()
    try:
        reply = worker.build(request, waiting)
    except BaseException as e:  # (the worker's state is unknown: it goes)
        worker.close(kill=True)
        if isinstance(e, _WorkerLost):
            raise RuntimeError(f"tbegen: building {what} failed: its build worker ended "
                               f"(exit status {worker.proc.returncode}; see the output above)") from None
        raise
    _give_back_worker(worker)
    if "message" in reply:  # the compiler rejected the sources
        from .compile_errors import CompileError

        raise CompileError(reply["message"], Path(reply["log"]))
    if not reply["ok"]:
        error = reply.get("error", "")
        if error.startswith("RuntimeError: tbegen: "):  # tbegen's own words: enough on their own
            raise RuntimeError(f"tbegen: building {what} failed: {error[len('RuntimeError: tbegen: '):]}")
        raise RuntimeError(f"tbegen: building {what} failed (see the compiler output above)"
                           + (f": {error.splitlines()[0][:500]}" if error else "")
                           + (f"\nin the build worker:\n{reply['traceback']}" if reply.get("traceback") else ""))
    print(f"tbegen: built {what} in {time.perf_counter() - t0:.0f} s ({reply['cpu']:.0f} s of CPU time)",
          file=sys.stderr, flush=True)


def load_sources(name: str, src_dir: Union[str, Path], with_cuda: Optional[bool] = None,
                 verbose: bool = False):
    """Builds/loads the committed sources of one optimizer (e.g. generated/adagrad)."""
    src_dir = Path(src_dir)
    use_cuda = cuda_wanted(with_cuda)
    files = _sources_for(name, src_dir, src_dir.parent / "include", use_cuda)
    build_files(name, files, use_cuda, verbose)
    return getattr(torch.ops, f"tbegen_{name}")


def spec_files(spec: OptimizerSpec, with_cuda: bool, fp32_weights_only: bool = False) -> Dict[str, str]:
    """The sources of one spec, rendered in memory. `fp32_weights_only`: a library whose backward
    takes float32 weights only (`tbegen test --quick`): the CPU backward (FP32_WEIGHTS_SOURCE) and,
    with CUDA, the update kernels (FP32_KERNELS_SOURCE), each where the sources support it;
    otherwise the full library's sources."""
    from .render import render_spec, render_static

    files = {k: v for k, v in render_spec(spec).items() if not k.endswith(".py")}
    if not with_cuda:
        for cu in CUDA_SOURCES:
            files.pop(f"{spec.name}/{cu}")
    files.update(render_static())
    if fp32_weights_only:
        if FP32_WEIGHTS_MACRO in files.get("include/tbegen/cpu_ops.h", ""):
            files[f"{spec.name}/{FP32_WEIGHTS_SOURCE}"] = (
                "// tbegen/build.py: ops.cpp with the backward for float32 weights only (tbegen test --quick)\n"
                f"#define {FP32_WEIGHTS_MACRO} 1\n#include \"ops.cpp\"\n")
        if with_cuda:
            files[f"{spec.name}/{FP32_KERNELS_SOURCE}"] = _fp32_kernels_wrapper(spec.name)
    return files


def _fp32_kernels_wrapper(name: str) -> str:
    """kernels_cuda.cu with the table's entries for other weights than float32 specialised as
    stubs that raise, declared before the table is instantiated (so their kernels are never
    compiled)."""
    opt = f"opt_{name}::Optimizer"
    stubs = []
    for w in _LAUNCH_WEIGHTS[1:]:
        for k in _WIDTHS:
            stubs.append(f"template <> cudaError_t launch_backward<{opt}, {w}, {k}>(const BackwardLaunch&) "
                         f"{{ fp32_weights_only(\"{_WEIGHT_NAMES[w]}\"); }}")
    for w in _ANY_WIDTH_WEIGHTS[1:]:
        stubs.append(f"template <> cudaError_t launch_any_width<{opt}, {w}>(const AnyWidthLaunch&) "
                     f"{{ fp32_weights_only(\"{_WEIGHT_NAMES[w]}\"); }}")
        stubs.append(f"template <> int64_t any_width_scratch_slots<{opt}, {w}>(const void*) "
                     f"{{ fp32_weights_only(\"{_WEIGHT_NAMES[w]}\"); }}")
    return ("// tbegen/build.py: kernels_cuda.cu with the update kernels for float32 weights only (tbegen test\n"
            "// --quick); the table's entries for other weights raise\n"
            "#include <stdexcept>\n#include <string>\n\n"
            "#include \"tbegen/cuda_backward_kernels.cuh\"\n#include \"optimizer.h\"\n\n"
            "namespace tbegen {\nnamespace cuda {\n\n"
            "[[noreturn]] static void fp32_weights_only(const char* weights) {\n"
            "  throw std::runtime_error(std::string(\"tbegen: this library was built for float32 weights only \"\n"
            "                           \"(by tbegen test --quick), got \") + weights + \" weights\");\n}\n\n"
            + "\n".join(stubs) + "\n\n}  // namespace cuda\n}  // namespace tbegen\n\n"
            "#include \"kernels_cuda.cu\"\n")


def load_ops(spec: OptimizerSpec, with_cuda: Optional[bool] = None, verbose: bool = False,
             fp32_weights_only: bool = False):
    """Renders a parsed spec in memory, builds it (cached), loads it and returns its operators,
    torch.ops.tbegen_NAME. (tbegen.spec.load_spec parses a spec file; this builds one.)
    `fp32_weights_only`: see spec_files (a library of its own)."""
    use_cuda = cuda_wanted(with_cuda)
    build_files(spec.name, spec_files(spec, use_cuda, fp32_weights_only), use_cuda, verbose)
    return getattr(torch.ops, f"tbegen_{spec.name}")


def prebuild(spec_paths, flavours: Sequence[bool] = (False,), jobs: Optional[int] = None, *,
             with_cuda: Optional[bool] = None) -> None:
    """Builds several specs' extensions into the cache (without loading them), `jobs` builds at a
    time (default: one per core, each compiling one file at a time), so that a test session pays
    for the work once, spread over the cores. `flavours`: False for CPU-only builds, True for
    CPU + CUDA (which reuse the CPU builds' ops.cpp object and the shared CUDA runtime object).
    The shared runtime objects (CPU operators, CUDA runtime) go first, then the CPU builds.
    `with_cuda=X` is the older spelling of `flavours=[X]` (benchmarks/run_gpu.sh uses it)."""
    if with_cuda is not None:
        flavours = [with_cuda]
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from .spec import load_spec as parse

    todo = []
    for with_cuda in sorted(set(flavours)):
        for p in spec_paths:
            spec = parse(str(p))
            files = spec_files(spec, with_cuda)
            entry = build_root() / f"{spec.name}-{'cuda' if with_cuda else 'cpu'}-{cache_key(spec.name, files, with_cuda)}"
            if not _is_published(entry):
                todo.append((spec.name, files, with_cuda))
    # The code shared by every optimizer goes first: the CPU operators (every build links them)
    # and the CUDA code, beside the CPU builds (every CUDA build links it, and would otherwise
    # wait for it with a core idle).
    if any(RUNTIME_CPU_SOURCE in files for _, files, _ in todo):
        runtime_files = _runtime_files(next(files for _, files, _ in todo if RUNTIME_CPU_SOURCE in files))
        if not _is_published(build_root() / f"{RUNTIME_CPU_NAME}-cpu-{cache_key(RUNTIME_CPU_NAME, runtime_files, False)}"):
            todo.insert(0, (RUNTIME_CPU_NAME, runtime_files, False))
    if any(with_cuda for _, _, with_cuda in todo):
        runtime_files = _runtime_files(next(files for _, files, with_cuda in todo if with_cuda))
        if not _is_published(build_root() / f"{RUNTIME_NAME}-cuda-{cache_key(RUNTIME_NAME, runtime_files, True)}"):
            todo.insert(0, (RUNTIME_NAME, runtime_files, True))
    if not todo:
        return
    jobs = jobs or min(len(todo), os.cpu_count() or 1)
    print(f"tbegen: building {len(todo)} extension(s) into {build_root()}, {jobs} at a time",
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    # each build runs ninja; keep the total number of compiler processes near the core count
    os.environ.setdefault("MAX_JOBS", str(max(1, (os.cpu_count() or 1) // jobs)))
    _keep_idle_workers(jobs)  # each thread's build worker serves its next build
    cpu_flavour = any(not with_cuda for _, _, with_cuda in todo)
    with _WORKERS_LOCK:
        _PREBUILDS[0] += cpu_flavour
    try:
        with ThreadPoolExecutor(jobs) as pool:
            futures = {pool.submit(build_files, name, files, with_cuda, False, False): (name, with_cuda)
                       for name, files, with_cuda in todo}
            for done, future in enumerate(as_completed(futures), 1):
                future.result()
                name, with_cuda = futures[future]
                print(f"tbegen: [{done}/{len(todo)}] {_describe(name, with_cuda)} is ready "
                      f"({time.perf_counter() - t0:.0f} s since the start)", file=sys.stderr, flush=True)
    finally:
        with _WORKERS_LOCK:
            _PREBUILDS[0] -= cpu_flavour
        _keep_idle_workers(1)
    print(f"tbegen: built {len(todo)} extension(s) in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
