"""Builds rendered sources into a torch extension and loads it.

Builds are cached by content: the cache key hashes every source file, the torch version, the
build flavour (CPU only, or CPU + CUDA) and the compiler flags (with -march=native, the host
processor's model and features too; see `cpu_arch_flags`), so an unchanged spec is never rebuilt and a changed one
never loads stale code. The cache lives in $TBEGEN_BUILD_DIR (default ~/.cache/tbegen). Two
processes building the same key at once are serialised by torch's build lock in that directory.

A cache hit loads the shared library directly (torch.ops.load_library: milliseconds); only a miss
runs torch.utils.cpp_extension (about a minute for CPU + CUDA, mostly torch's headers).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Union

import torch

from .model import OptimizerSpec

_LOADED: Dict[str, str] = {}  # op namespace -> cache key of the library loaded in this process

# -fno-math-errno: sqrtf and friends need not set errno, which lets the compiler vectorise loops
# that call them (adagrad's update ran 20x slower without); it changes no result.
CXX_FLAGS = ["-O3", "-fno-math-errno"]  # plus openmp_flags() and cpu_arch_flags()
CUDA_SOURCES = ("ops_cuda.cu", "forward_cuda.cu")
CUDA_FLAGS = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]


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


def cache_key(name: str, files: Dict[str, str], with_cuda: bool) -> str:
    h = hashlib.sha256()
    flags = cxx_flags()
    h.update(f"{name}\0{torch.__version__}\0{with_cuda}\0{flags}\0{CUDA_FLAGS}\0".encode())
    if "-march=native" in flags:
        h.update(_host_cpu().encode())
    if with_cuda:
        h.update(cuda_arch_list().encode())
    for rel in sorted(files):
        h.update(rel.encode() + b"\0" + files[rel].encode() + b"\0")
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


def build_files(name: str, files: Dict[str, str], with_cuda: bool, verbose: bool = False,
                load: bool = True) -> Path:
    """Builds {relative path: text} sources (one optimizer) and returns the library's path.

    With `load`, also loads it into this process, registering torch.ops.tbegen_NAME.
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
    libname = _library_name(name, key, with_cuda)
    out_dir = build_root() / f"{name}-{'cuda' if with_cuda else 'cpu'}-{key}"
    lib_path = out_dir / f"{libname}.so"
    if not lib_path.exists():
        if load:
            _compile(name, files, with_cuda, out_dir, libname, verbose)
        else:
            # cpp_extension loads what it builds; build in a child process so that this one
            # does not end up holding a library it did not ask for (its operators could clash
            # with another build of the same optimizer loaded later)
            _compile_in_child(name, files, with_cuda, out_dir, libname, verbose)
    if load:
        torch.ops.load_library(str(lib_path))
        _LOADED[namespace] = key
    return lib_path


def _compile(name: str, files: Dict[str, str], with_cuda: bool, out_dir: Path, libname: str,
             verbose: bool) -> None:
    from torch.utils import cpp_extension

    src = out_dir / "src"
    for rel, text in files.items():
        path = src / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
    sources = [str(src / name / "ops.cpp")]
    if with_cuda:
        sources += [str(src / name / cu) for cu in CUDA_SOURCES]
    flavour = "CPU + CUDA" if with_cuda else "CPU"
    if with_cuda:
        os.environ["TORCH_CUDA_ARCH_LIST"] = cuda_arch_list()
    print(
        f"tbegen: building the {name} extension ({flavour}) in {out_dir}; "
        f"this takes {'a minute or two' if with_cuda else 'about half a minute'} the first time",
        file=sys.stderr,
        flush=True,
    )
    t0 = time.perf_counter()
    cpp_extension.load(
        name=libname,
        sources=sources,
        extra_include_paths=[str(src / "include"), str(src / name)]
        + (_cuda_library_includes() if with_cuda else []),
        extra_cflags=cxx_flags(),
        extra_cuda_cflags=CUDA_FLAGS,
        extra_ldflags=_cuda_link_flags() if with_cuda else [],
        build_directory=str(out_dir),
        with_cuda=with_cuda,
        is_python_module=False,
        is_standalone=False,
        verbose=verbose,
    )
    print(f"tbegen: built {name} ({flavour}) in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def _compile_in_child(name, files, with_cuda, out_dir, libname, verbose) -> None:
    import json
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(dict(name=name, files=files, with_cuda=with_cuda, out_dir=str(out_dir), libname=libname,
                       verbose=verbose), f)
    code = (
        "import json, sys; from pathlib import Path; from tbegen.build import _compile\n"
        "a = json.load(open(sys.argv[1]))\n"
        "_compile(a['name'], a['files'], a['with_cuda'], Path(a['out_dir']), a['libname'], a['verbose'])\n"
    )
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    try:
        proc = subprocess.run([sys.executable, "-c", code, f.name], env=env)
    finally:
        os.unlink(f.name)
    if proc.returncode != 0:
        raise RuntimeError(f"tbegen: building the {name} extension failed (see the compiler output above)")


def load_sources(name: str, src_dir: Union[str, Path], with_cuda: Optional[bool] = None,
                 verbose: bool = False):
    """Builds/loads the committed sources of one optimizer (e.g. generated/adagrad)."""
    src_dir = Path(src_dir)
    use_cuda = cuda_wanted(with_cuda)
    files = _sources_for(name, src_dir, src_dir.parent / "include", use_cuda)
    build_files(name, files, use_cuda, verbose)
    return getattr(torch.ops, f"tbegen_{name}")


def spec_files(spec: OptimizerSpec, with_cuda: bool) -> Dict[str, str]:
    """The sources of one spec, rendered in memory."""
    from .render import render_spec, render_static

    files = {k: v for k, v in render_spec(spec).items() if not k.endswith(".py")}
    if not with_cuda:
        for cu in CUDA_SOURCES:
            files.pop(f"{spec.name}/{cu}")
    files.update(render_static())
    return files


def load_spec(spec: OptimizerSpec, with_cuda: Optional[bool] = None, verbose: bool = False):
    """Renders a spec in memory, builds it (cached) and returns torch.ops.tbegen_NAME."""
    use_cuda = cuda_wanted(with_cuda)
    build_files(spec.name, spec_files(spec, use_cuda), use_cuda, verbose)
    return getattr(torch.ops, f"tbegen_{spec.name}")


def _prebuild_one(args) -> str:
    spec_path, with_cuda = args
    from .spec import load_spec as parse

    spec = parse(spec_path)
    return str(build_files(spec.name, spec_files(spec, with_cuda), with_cuda, load=False))


def prebuild(spec_paths, with_cuda: bool, jobs: Optional[int] = None) -> None:
    """Builds several specs' extensions in parallel processes (into the cache, without loading
    them), so that a test session pays for the slowest build rather than the sum."""
    from concurrent.futures import ProcessPoolExecutor
    import multiprocessing

    todo = [(str(p), with_cuda) for p in spec_paths]
    jobs = jobs or min(len(todo), os.cpu_count() or 1)
    if jobs <= 1:
        for item in todo:
            _prebuild_one(item)
        return
    # each build compiles its files in parallel too (ninja); keep the total near the core count
    os.environ.setdefault("MAX_JOBS", str(max(1, (os.cpu_count() or 1) // jobs)))
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_prebuild_one, todo))
