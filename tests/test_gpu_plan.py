"""The next GPU session's commands (benchmarks/run_gpu_plan.sh), checked on the CPU: device time is
scarce (a call is a tenth of a session's), and a typo in a script name, a flag, a switch or a sweep
regex would cost a whole call. The script prints its commands with DRY_RUN=1; every script they run
must exist, every variable they set must be one the called script reads, every flag one the called
Python script defines, every environment switch one that tbegen reads, every sweep regex must pick
some cells, and every test file and optimizer must exist."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "benchmarks" / "run_gpu_plan.sh"


def plan_commands(*calls: str):
    """The commands DRY_RUN=1 prints for `calls`, each split as the shell would."""
    proc = subprocess.run(["bash", str(PLAN), *calls], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "DRY_RUN": "1", "OUT": "/tmp/plan-out"})
    assert proc.returncode == 0, proc.stderr
    lines = [line[2:] for line in proc.stdout.splitlines() if line.startswith("+ ")]
    assert lines, proc.stdout
    return [shlex.split(line) for line in lines]


def split_env(argv):
    """(assignments of a leading `env`, the command after them and any `timeout N`)."""
    env, rest = {}, list(argv)
    if rest and rest[0] == "env":
        rest = rest[1:]
        while rest and re.match(r"^[A-Z_][A-Z0-9_]*=", rest[0]):
            name, value = rest.pop(0).split("=", 1)
            env[name] = value
    if rest and rest[0] == "timeout":
        rest = rest[2:]
    return env, rest


def script_text(path: Path) -> str:
    """A shell script's text with the scripts it sources (benchmarks/tools/gpu_common.sh) and the
    benchmarks' Python scripts it runs (which read their own variables: BENCH_VBE_PROFILE)."""
    text = path.read_text()
    for sourced in re.findall(r"^\s*source\s+(\S+)", text, flags=re.M):
        text += (ROOT / sourced).read_text()
    for script in sorted(set(re.findall(r"benchmarks/[\w/]+\.py", text))):
        if (ROOT / script).is_file():
            text += (ROOT / script).read_text()
    return text


def python_flags(path: Path) -> set:
    return set(re.findall(r"add_argument\(\s*\"(--[a-z0-9-]+)\"", path.read_text()))


def known_switches() -> str:
    """Where tbegen reads its TBEGEN_* switches: the runtime headers and the package."""
    files = list((ROOT / "templates" / "include" / "tbegen").glob("*")) + list((ROOT / "tbegen").rglob("*.py"))
    return "\n".join(f.read_text() for f in files if f.is_file())


def is_read(switch: str, switches: str) -> bool:
    """Whether tbegen reads `switch`: its name as a string literal ("TBEGEN_X": getenv, env_is_zero,
    opt_in_switch, os.environ.get), not a longer name that starts with it."""
    return re.search(r"[\"']" + switch + r"[\"']", switches) is not None


def switch_names(text: str):
    """The TBEGEN_* names of "ENV=VALUE[,ENV2=VALUE2]"."""
    pairs = [p.split("=", 1) for p in text.split(",") if p]
    assert pairs and all(len(p) == 2 and p[0] for p in pairs), text
    return [name for name, _ in pairs]


@pytest.fixture(scope="module")
def sweep_names():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import sweep_gpu
    finally:
        sys.path.pop(0)
    return [f"{s['name']} {opt}" for s, opt in sweep_gpu.cells()]


def picks(regex: str, names) -> int:
    return sum(bool(re.search(regex, n)) for n in names)


def test_every_call_prints_its_commands():
    assert len(plan_commands("1")) == 1 and len(plan_commands("2")) == 1 and len(plan_commands("3")) == 1
    assert len(plan_commands("4")) == 1 and len(plan_commands("5")) == 1 and len(plan_commands("6")) == 1
    assert len(plan_commands("7")) == 1 and len(plan_commands("8")) == 1 and len(plan_commands("9")) == 1
    assert len(plan_commands("10")) == 1 and len(plan_commands("11")) == 1 and len(plan_commands("12")) == 1
    assert len(plan_commands("13")) == 1 and len(plan_commands("14")) == 1
    assert len(plan_commands("15")) == 1
    proc = subprocess.run(["bash", str(PLAN), "16"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "DRY_RUN": "1"})
    assert proc.returncode == 2 and "no call '16'" in proc.stderr


def test_the_plan_names_only_what_exists(sweep_names):
    switches = known_switches()
    specs = {p.stem for p in (ROOT / "optimizers").glob("*.yaml")}
    for argv in plan_commands("1", "2", "3", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13", "14", "15"):
        env, cmd = split_env(argv)
        if cmd[0] == "bash":  # a run script: it must read every variable it is given
            script = ROOT / cmd[1]
            assert script.is_file(), cmd[1]
            text = script_text(script)
            for name in env:
                if name == "TBEGEN_TEST_OPTIMIZERS":  # read by the tests themselves
                    assert is_read(name, (ROOT / "tests" / "conftest.py").read_text()), name
                    continue
                # (as $NAME / ${NAME...} in the shell, or os.environ's 'NAME' in its Python)
                assert re.search(r"\$\{?" + name + r"\b|['\"]" + name + r"['\"]", text), f"{cmd[1]} does not read {name}"
        else:  # python3 <script> <flags>
            assert cmd[0] == "python3", cmd
            script = ROOT / cmd[1]
            assert script.is_file(), cmd[1]
            flags = python_flags(script)
            for arg in cmd[2:]:
                if arg.startswith("--"):
                    assert arg in flags, f"{cmd[1]} has no {arg}"
        for name, value in env.items():
            if name == "SWEEP_ABS":
                for ab in value.split(";"):
                    names, regex = ab.split("@", 1)
                    for switch in switch_names(names):
                        assert is_read(switch, switches), switch
                    assert picks(regex, sweep_names) > 0, f"{regex!r} picks no sweep cell"
            elif name == "NCU_AB":
                for switch in switch_names(value):
                    assert is_read(switch, switches), switch
            elif name == "VBE_AB":  # (a tbegen switch, or one of bench_vbe.py's own: BENCH_VBE_PROFILE)
                bench_vbe = (ROOT / "benchmarks" / "bench_vbe.py").read_text()
                for switch in switch_names(value):
                    assert is_read(switch, switches) or is_read(switch, bench_vbe), switch
            elif name == "VBE_CASES":  # bench_vbe.py's case names
                text = (ROOT / "benchmarks" / "bench_vbe.py").read_text()
                for case in value.split(","):
                    assert f'"{case}":' in text, f"bench_vbe.py has no case {case!r}"
            elif name in ("NCU_ONLY", "PROFILE_ONLY"):
                assert picks(value, sweep_names) > 0, f"{name}={value!r} picks no sweep cell"
            elif name == "TEST_FILES":
                for f in value.split():
                    assert (ROOT / f).is_file(), f
            elif name in ("BUILD_SPECS", "TBEGEN_TEST_OPTIMIZERS"):
                assert set(value.split()) <= specs, value
            elif name == "CACHE_OPTS":  # bench_cache.py's options (run_gpu.sh passes them on)
                flags = python_flags(ROOT / "benchmarks" / "bench_cache.py")
                opts = value.split()
                for k, arg in enumerate(opts):
                    if arg.startswith("--"):
                        assert arg in flags, f"bench_cache.py has no {arg}"
                    if arg == "--variant":
                        for switch in switch_names(opts[k + 1]):
                            assert is_read(switch, switches), switch


def test_the_long_runs_ab_picks_the_cells_the_notes_say(sweep_names):
    """NOTES-gpu's plan (call 5): TBEGEN_LONG_RUNS_BESIDE=0 against the default on the wide-row cells
    (D=256, 512, 1024 fp32; fp16 D=512, 2048) and the controls (base, zipf 1.3, random 3), and
    TBEGEN_SEGMENT_OCCUPANCY=1 on the narrow and skewed cells, 4 optimizers each; kernels per step
    (and call 9 ncu) on D=1024 (a change to the sweep's shapes that moved
    them would be noticed here, not on the GPU)."""
    (argv,) = plan_commands("5")
    env, _ = split_env(argv)
    (long_switch, long_regex), (items_switch, items_regex), (seg_switch, seg_regex) = (
        ab.split("@") for ab in env["SWEEP_ABS"].split(";"))
    assert long_switch == "TBEGEN_LONG_RUNS_BESIDE=0" and seg_switch == "TBEGEN_SEGMENT_OCCUPANCY=1"
    assert items_switch == "TBEGEN_ANY_WIDTH_ITEMS=1" and picks(items_regex, sweep_names) == 4
    assert picks(long_regex, sweep_names) == 32
    assert picks(seg_regex, sweep_names) == 20  # random 3, D=20, D=32, D=8, zipf 1.3: 4 optimizers each
    assert picks(env["PROFILE_ONLY"], sweep_names) == 4
    (argv,) = plan_commands("9")  # (ncu of D=1024 sgd both ways: its own call)
    env, _ = split_env(argv)
    assert picks(env["NCU_ONLY"], sweep_names) == 1 and env["NCU_AB"] == "TBEGEN_LONG_RUNS_BESIDE=0"
