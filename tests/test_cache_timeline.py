"""The pipelined cached step's order per stream, on the CPU (benchmarks/cache_timeline.py), the
named ranges (tbegen/_ranges.py) and bench_cache's per-stream summary of a profile (issue 27)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def _steps(lines):
    """{step number: its lines} of a cache_timeline log."""
    out, current = {}, None
    for line in lines:
        if line.startswith("step "):
            current = int(line.split()[1].rstrip(":"))
            out[current] = []
        elif current is not None and line.startswith("  "):
            out[current].append(line.strip())
    return out


def test_pipelined_prefetch_waits_for_the_backward_before_not_the_forward():
    """TorchRec's order (forward i on D, prefetch i + 1 on P, backward i on D), the real module on
    the CPU with stand-in streams: the prefetch of batch i + 1 waits for the backward of batch
    i - 1 (whose rows it may evict and write back), not for the forward of batch i, whose
    kernels read only held slots: the two run side by side (before, it waited for the forward's
    end). The forward waits for its prefetch only. The host's one wait of the step (the lookup's
    summary) still comes before the backward of batch i is issued (NOTES-gpu, issue 27)."""
    import cache_timeline

    args = cache_timeline.parse_args(["--steps", "3"])
    steps = _steps(cache_timeline.timeline(args))
    assert sorted(steps) == [1, 2, 3]
    written_back = []
    for i in (2, 3):  # (step 1 follows the first backward, which recorded no event: a stream wait)
        lines = steps[i]
        p_waits = [x for x in lines if x.startswith("[P] waits for e")]
        d_waits = [x for x in lines if x.startswith("[D] waits")]
        assert p_waits and all("after tbegen.backward" in x for x in p_waits), lines
        assert d_waits and all("(P after tbegen.prefetch)" in x for x in d_waits), lines
        host = [k for k, x in enumerate(lines) if x.startswith("HOST WAITS")]
        assert len(host) == 1 and "for P" in lines[host[0]]
        assert host[0] < lines.index("[D] begin tbegen.backward")
        assert lines.index("[D] end   tbegen.forward") < lines.index("[P] begin tbegen.prefetch")
        # evicted rows go back on W, after P's gathers, and P joins W before its fill ends
        w = [k for k, x in enumerate(lines) if x.startswith("[W]")]
        if w:
            written_back.append(i)
            assert len(w) == 2 and lines[w[0]] == "[W] waits for stream P (the evicted rows' gathers)"
            assert w[1] < lines.index("[P] waits for stream W (the write-back)") < lines.index("[P] end   tbegen.cache.fill")
    assert written_back  # (the default shape evicts)


def test_in_step_order_has_no_stream_waits():
    import cache_timeline

    steps = _steps(cache_timeline.timeline(cache_timeline.parse_args(["--steps", "2", "--order", "in-step"])))
    for lines in steps.values():
        # (the only stream waits: the write-back stream's, within the forward's own lookup's fill)
        assert all(x in ("[W] waits for stream D (the evicted rows' gathers)", "[D] waits for stream W (the write-back)")
                   for x in lines if "waits for" in x and not x.startswith("HOST"))
        assert sum(x.startswith("HOST WAITS") for x in lines) == 1


def test_ranges_off_by_default_and_listened_to_when_on(monkeypatch):
    from tbegen import _ranges

    was = _ranges.enabled()
    try:
        _ranges.enable(False)
        assert _ranges.span("a") is _ranges.span("b")  # (one shared do-nothing context)
        seen = []
        remove = _ranges.listen(lambda name, how: seen.append((name, how)))
        with _ranges.span("x"):
            pass
        assert seen == []
        _ranges.enable(True)
        with _ranges.span("x"):
            with _ranges.span("y"):
                pass
        remove()
        with _ranges.span("z"):
            pass
        assert seen == [("x", "begin"), ("y", "begin"), ("y", "end"), ("x", "end")]
    finally:
        _ranges.enable(was)


def test_ranges_flag_is_checked():
    code = "import tbegen._ranges"
    r = subprocess.run([sys.executable, "-c", code], env={**__import__("os").environ, "TBEGEN_RANGES": "yes"},
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode != 0 and "TBEGEN_RANGES must be 0 or 1" in r.stderr


def test_stream_summary_busy_time_and_overlap():
    """bench_cache's per-stream summary of a trace: busy time is the union of a stream's kernels
    and copies; 'beside another stream' the part of it during which another stream was busy;
    tbegen ranges per stream and on the host."""
    import bench_cache

    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "k1", "ts": 0, "dur": 100, "tid": 7, "args": {"stream": 7}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "c", "ts": 50, "dur": 100, "tid": 7, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "k2", "ts": 100, "dur": 200, "tid": 9, "args": {"stream": 9}},
        {"ph": "X", "cat": "kernel", "name": "k3", "ts": 1000, "dur": 400, "tid": 9, "args": {"stream": 9}},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "tbegen.cache.fill", "ts": 100, "dur": 600,
         "tid": 9, "args": {"stream": 9}},
        {"ph": "X", "cat": "user_annotation", "name": "tbegen.cache.host_wait", "ts": 0, "dur": 300, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::sort", "ts": 0, "dur": 5000, "tid": 1},
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 0},
    ]}
    lines = bench_cache.stream_summary(trace, steps=2)
    assert "| 9 | 0.300 | 1 | 0.025 |" in lines  # (600 us busy, 50 beside stream 7: per step / 2)
    assert "| 7 | 0.075 | 1 | 0.025 |" in lines
    assert "| tbegen.cache.fill | stream 9 | 0.300 | 0.5 |" in lines
    assert "| tbegen.cache.host_wait | host | 0.150 | 0.5 |" in lines
    assert not any("aten::sort" in x for x in lines)
    assert any("no GPU activity" in x for x in bench_cache.stream_summary({"traceEvents": []}, 1))
