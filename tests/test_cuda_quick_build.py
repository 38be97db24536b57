"""How a CUDA build compiles an optimizer's update kernels (issue 26, the authoring loop on the GPU;
tbegen/build.py, `_fp32_kernels_wrapper`, `_kernel_sources`, `_reuse_cpu_build`).

- `tbegen test --device cuda --quick` builds a library of its own whose update kernels are
  float32 weights' only (the table's other entries raise), with the float32-only CPU backward.
- Where cores are free, kernels_cuda.cu is compiled as several translation units side by side:
  part 1 the table with the other parts' instantiations declared `extern template`, each other
  part an explicit instantiation of its share. Every kernel is compiled exactly once, from the
  same code with the same flags: here its PTX is compared with the whole unit's (the SASS of
  the same builds for sm_90 was compared too: benchmarks/NOTES-ci.md).
- A CUDA build outside prebuild compiles ops.cpp itself, beside its CUDA units, unless the CPU
  build of the same sources exists or is being built.

Without nvcc only the sources are checked; with it (CI) nvcc compiles the float32 kernels whole and
in two parts, to PTX (about 12 CPU s).
"""

import fcntl
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import CAN_BUILD_CUDA, SPECS
from tbegen import build
from tbegen.spec import load_spec

SPEC = "sgd"  # (the cheapest kernels to compile; the mechanism is the same for every spec)


@pytest.fixture(scope="module")
def spec():
    return load_spec(str(SPECS.get(SPEC) or next(iter(SPECS.values()))))


def _declared(text, kind):
    """The explicit-instantiation declarators of a part: `template X;` or `extern template X;`."""
    prefix = "extern template " if kind == "extern" else "template "
    return [line[len(prefix):-1] for line in text.splitlines()
            if line.startswith(prefix) and not (kind == "explicit" and line.startswith("template <>"))]


def test_the_float32_cuda_library_is_a_build_of_its_own(spec):
    full, quick = build.spec_files(spec, True), build.spec_files(spec, True, fp32_weights_only=True)
    assert set(quick) - set(full) == {f"{spec.name}/{build.FP32_WEIGHTS_SOURCE}",
                                      f"{spec.name}/{build.FP32_KERNELS_SOURCE}"}
    assert build.cache_key(spec.name, full, True) != build.cache_key(spec.name, quick, True)
    # its CPU part is the float32 CPU library `tbegen test --quick` builds (one cache entry for both)
    cuda_only = {f"{spec.name}/{f}" for f in build.CUDA_SOURCES + (build.FP32_KERNELS_SOURCE,)}
    cpu_part = {k: v for k, v in quick.items() if k not in cuda_only}
    assert cpu_part == build.spec_files(spec, False, fp32_weights_only=True)


def test_the_float32_kernel_table_stubs_exactly_the_other_weights(spec):
    text = build.spec_files(spec, True, fp32_weights_only=True)[f"{spec.name}/{build.FP32_KERNELS_SOURCE}"]
    stubs = re.findall(r"^template <> \S+ (\w+)<opt_\w+::Optimizer, ([\w:]+)(?:, (\d))?>", text, re.M)
    assert sorted(stubs) == sorted(
        [("launch_backward", w, k) for w in ("c10::Half", "c10::BFloat16") for k in "1248"]
        + [(f, w, "") for f in ("launch_any_width", "any_width_scratch_slots")
           for w in ("c10::Half", "c10::BFloat16", "uint8_t")])
    assert "float32 weights only" in text and text.rstrip().endswith('#include "kernels_cuda.cu"')


def _table_entries(header):
    """The entries of backward_kernels_for's table, as (function, weights, kVecs or "")."""
    body = header[header.index("const BackwardKernels& backward_kernels_for() {"):]
    body = body[:body.index("return table;")]
    return re.findall(r"&(launch_backward|launch_any_width|any_width_scratch_slots)<Opt, ([\w:]+)(?:, (\d))?>", body)


def test_the_table_is_what_the_build_lists(spec):
    """build.py's lists (the float32 library's stubs, the split's parts) are the table's entries."""
    header = build.spec_files(spec, True)["include/tbegen/cuda_backward_kernels.cuh"]
    entries = _table_entries(header)
    assert len(entries) == len(set(entries)) == 12 + 2 * 4
    assert sorted(entries) == sorted(
        [("launch_backward", w, str(k)) for w in build._LAUNCH_WEIGHTS for k in build._WIDTHS]
        + [(f, w, "") for w in build._ANY_WIDTH_WEIGHTS for f in ("launch_any_width", "any_width_scratch_slots")])
    # (and the check sees a change: an entry more, or one fewer)
    more = header.replace("&launch_backward<Opt, float, 8>}", "&launch_backward<Opt, float, 8>, &launch_backward<Opt, double, 8>}")
    assert more != header and sorted(_table_entries(more)) != sorted(entries)


# a device variable defined in a header (a line that starts `__device__`, `__constant__` or
# `__managed__` and has no parenthesis: not a function)
_DEVICE_VARIABLE = re.compile(r"^[ \t]*(?:static[ \t]+)?(?:__device__|__constant__|__managed__)[^(\n]*$", re.M)


def test_no_runtime_header_defines_a_device_variable(spec):
    """The split compiles the table's kernels in several translation units: a device variable
    defined in a header they include would have one copy per unit, each kernel its own."""
    files = build.spec_files(spec, True)
    headers = {rel: text for rel, text in files.items() if rel.startswith("include/") and rel.endswith((".cuh", ".h"))}
    assert "include/tbegen/cuda_kernels.cuh" in headers
    assert [rel for rel, text in headers.items() if _DEVICE_VARIABLE.search(text)] == []
    for line in ("__device__ int tbegen_counter;", "static __constant__ float tbegen_table[4] = {};"):
        assert _DEVICE_VARIABLE.search(line), line
    for line in ("__device__ inline float f(float x) {", "__device__ __forceinline__ void g("):
        assert not _DEVICE_VARIABLE.search(line), line


def test_no_split_when_asked_for_none(spec, tmp_path, monkeypatch):
    files = build.spec_files(spec, True)
    monkeypatch.setenv("TBEGEN_CUDA_SPLIT", "0")
    assert build._kernel_sources(spec.name, files, tmp_path, 1) == [str(tmp_path / spec.name / "kernels_cuda.cu")]


@pytest.mark.parametrize("quick", [False, True], ids=["full", "fp32"])
@pytest.mark.parametrize("parts", [2, 5, 16])
def test_each_kernel_instantiation_is_in_exactly_one_part(spec, tmp_path, monkeypatch, quick, parts):
    files = build.spec_files(spec, True, fp32_weights_only=quick)
    (tmp_path / spec.name).mkdir()
    monkeypatch.setenv("TBEGEN_CUDA_SPLIT", str(parts))
    sources = build._kernel_sources(spec.name, files, tmp_path, 1)
    instances = build._kernel_instances(spec.name, files)
    assert len(instances) == (5 if quick else 16)
    assert len(sources) == min(parts, len(instances))
    texts = [open(s).read() for s in sources]
    unit = build.FP32_KERNELS_SOURCE if quick else "kernels_cuda.cu"
    assert texts[0].rstrip().endswith(f'#include "{unit}"') and all(f"#include \"{unit}\"" not in t for t in texts[1:])
    explicit = [d for t in texts[1:] for d in _declared(t, "explicit")]
    extern = _declared(texts[0], "extern")
    assert sorted(explicit) == sorted(extern)  # part 1 leaves to the others exactly what they compile
    assert len(set(explicit)) == len(explicit) and set(explicit) < set(instances)
    assert len(instances) - len(extern) >= 1  # part 1 compiles its own share


def test_the_split_settings(spec, monkeypatch):
    files = build.spec_files(spec, True)
    monkeypatch.setattr(build.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr(build.os, "cpu_count", lambda: 16)
    monkeypatch.delenv("TBEGEN_CUDA_SPLIT", raising=False)
    monkeypatch.delenv("MAX_JOBS", raising=False)
    assert build.kernel_parts(spec.name, files, 3) == 13  # (16 compiler processes, 3 other units)
    monkeypatch.setenv("MAX_JOBS", "1")  # (prebuild's builds side by side)
    assert build.kernel_parts(spec.name, files, 1) == 1
    monkeypatch.setenv("MAX_JOBS", "4")
    assert build.kernel_parts(spec.name, files, 1) == 3
    monkeypatch.setattr(build.os, "getloadavg", lambda: (15.8, 0.0, 0.0))  # (no core idle)
    assert build.kernel_parts(spec.name, files, 1) == 1
    monkeypatch.setenv("TBEGEN_CUDA_SPLIT", "0")
    assert build.kernel_parts(spec.name, files, 1) == 1
    monkeypatch.setenv("TBEGEN_CUDA_SPLIT", "40")
    assert build.kernel_parts(spec.name, files, 1) == 16
    monkeypatch.setenv("TBEGEN_CUDA_SPLIT", "many")
    with pytest.raises(ValueError, match="TBEGEN_CUDA_SPLIT='many'"):
        build.kernel_parts(spec.name, files, 1)


def test_a_cuda_build_links_the_cpu_build_only_where_it_exists_or_is_being_built(tmp_path, monkeypatch):
    monkeypatch.setenv("TBEGEN_BUILD_DIR", str(tmp_path))
    monkeypatch.delenv("MAX_JOBS", raising=False)
    monkeypatch.setattr(build.os, "cpu_count", lambda: 4)
    entry = build.cache_root() / "x-cpu-0123456789abcdef"
    assert not build._reuse_cpu_build(entry)  # (nothing there: compiled in the CUDA build)
    monkeypatch.setenv("MAX_JOBS", "1")  # (one compiler process: the CPU build first, as before)
    assert build._reuse_cpu_build(entry)
    monkeypatch.delenv("MAX_JOBS")
    monkeypatch.setattr(build, "_PREBUILDS", [1])  # (prebuild builds the CPU flavour beside)
    assert build._reuse_cpu_build(entry)
    monkeypatch.setattr(build, "_PREBUILDS", [0])
    (tmp_path / "locks").mkdir(mode=0o700)
    with open(tmp_path / "locks" / f"{entry.name}.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # (another process is building it)
        with ThreadPoolExecutor(1) as pool:  # (flock locks are per open file: another one asks)
            assert pool.submit(build._reuse_cpu_build, entry).result()
        fcntl.flock(held, fcntl.LOCK_UN)
    assert not build._reuse_cpu_build(entry)
    entry.mkdir()
    (entry / build.DIGEST_FILE).write_text("{}")
    assert build._reuse_cpu_build(entry)


def _ptx_entries(text):
    """{kernel: its PTX, less line directives and the numbering of labels and local stacks}."""
    out = {}
    for m in re.finditer(r"^(?:\.visible\s+|\.weak\s+)?\.entry\s+(\S+)\(", text, re.M):
        body = text[m.start():text.index("\n}\n", m.start())]
        body = "\n".join(line for line in body.split("\n") if not line.strip().startswith(".loc"))
        body = re.sub(r"\$L__BB\d+_", "$L__BB_", body)
        out[m.group(1)] = re.sub(r"__local_depot\d+", "__local_depot", body)
    return out


@pytest.mark.skipif(not CAN_BUILD_CUDA, reason="needs nvcc and a CUDA build of torch")
def test_the_split_float32_kernels_compile_to_the_whole_units_ptx(spec, tmp_path, monkeypatch):
    from torch.utils import cpp_extension

    files = build.spec_files(spec, True, fp32_weights_only=True)
    src = tmp_path / "src"
    for rel, text in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    # (two parts: the table's and one of explicit instantiations, the two kinds a split has; how
    # the instantiations are dealt to more parts is checked above, without a compiler)
    monkeypatch.setenv("TBEGEN_CUDA_SPLIT", "2")
    parts = build._kernel_sources(spec.name, files, src, 1)
    whole = str(src / spec.name / build.FP32_KERNELS_SOURCE)
    cap = build._compute_capabilities(build.cuda_arch_list())[0]
    flags = ([cpp_extension._join_cuda_home("bin", "nvcc"), "-ptx", f"-arch=compute_{cap}", "-std=c++20"]
             + cpp_extension.COMMON_NVCC_FLAGS + build.CUDA_FLAGS
             + [f"-I{p}" for p in [src / "include", src / spec.name] + cpp_extension.include_paths("cuda")])

    def ptx(source):
        out = tmp_path / (source.rsplit("/", 1)[-1] + ".ptx")
        proc = subprocess.run(flags + [source, "-o", str(out)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return _ptx_entries(out.read_text())

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(ptx, [whole] + parts))
    reference, split = results[0], results[1:]
    shared = {k for k in reference if "check_finite_kernel" in k}  # (a static kernel of the headers: one per unit)
    assert not any(re.search(r"N3c104HalfE|N3c108BFloat16E", k) for k in reference)  # (float32 only)
    assert len(reference) - len(shared) >= 15  # (4 widths x segment, finish, warp + 3 any-width, and variants)
    seen = {}
    for i, entries in enumerate(split, 1):
        assert entries, f"part {i} compiled no kernel"
        for k, body in entries.items():
            if k not in shared:
                assert k not in seen, f"{k} compiled in parts {seen[k]} and {i}"
                seen[k] = i
            assert body == reference[k], f"{k}: part {i}'s PTX differs from the whole unit's"
    assert set(seen) == set(reference) - shared


# `tbegen test --device cuda --quick`'s library on a GPU: every float32 case passes, and weights of
# another dtype get the error that says why (in a fresh process: this one may hold the full library).
QUICK_ON_GPU = r"""
import sys, torch
from tbegen import build, harness
from tbegen.spec import load_spec

spec = load_spec(sys.argv[1])
ops = build.load_ops(spec, with_cuda=True, fp32_weights_only=True)
results = [harness.run_case(spec, ops, c, device="cuda") for c in harness.standard_cases(spec, dtypes=(torch.float32,))]
print("failed:", [r.case.id for r in results if r.failures], "of", len(results))
for dtype in (torch.float16, torch.bfloat16):
    try:
        harness.run_case(spec, ops, harness.Case(weights_dtype=dtype, seed=3), device="cuda")
        print("no error for", dtype)
    except RuntimeError as e:
        print("error:", str(e).splitlines()[0])
"""


@pytest.mark.cuda
def test_the_float32_cuda_library_passes_the_float32_cases_and_refuses_other_weights(spec):
    import sys

    proc = subprocess.run([sys.executable, "-c", QUICK_ON_GPU, str(SPECS.get(SPEC) or next(iter(SPECS.values())))],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()[-3:]
    assert lines[0].startswith("failed: [] of ") and not lines[0].endswith(" 0"), lines
    for line, name in zip(lines[1:], ("Half", "BFloat16")):
        assert line.startswith("error:") and f"built for float32 weights only (by tbegen test --quick), got {name}" in line, line
