#!/usr/bin/env python3
"""Placement "managed_caching" on a GPU: step time and hit rate against all-device placement, and
against FBGEMM_GPU's own MANAGED_CACHING in the same run when fbgemm_gpu imports.

    python benchmarks/bench_cache.py --out results/cache                      # the small default
    python benchmarks/bench_cache.py --tables 32 --rows 1000000 --batch 16384 --out results/cache-c2

The batches are C2-like: T tables of E x D fp32, B bags of L indices per table (sum pooling),
each table's indices Zipf(alpha)-distributed over its rows (rank k drawn with probability
proportional to k^-alpha; ranks mapped to rows by a random permutation per table). The referee's
C2 is --tables 32 --rows 1000000 --dim 128 --batch 16384 --pooling-factor 20 --alpha 1.1; the
default is a quarter of its tables and batch, to run in a minute.

For each placement (all "device", then every table "managed_caching" with a cache of each
fraction in --cache of its rows) and each system (tbegen; FBGEMM with --systems fbgemm), it
times --iters training steps (forward + out.backward(grad): the module's lookup, its fused
update, and, for cached tables, the prefetch that forward runs) after --warmup steps, each step
on a batch no earlier step saw. Steps are timed with CUDA events from before the forward to after
the backward (the cache's lookups wait for the GPU, so host time is in the step), and by the wall
clock over all timed steps (until the last one's end event: the prefetch it issues for the batch
after it is not counted). Hit rates: tbegen's `cache_stats()` over the timed steps (per index,
and per batch's distinct row); FBGEMM's unique-miss counter against the batches' distinct rows
(FBGEMM's cache_load_factor sizes one cache shared by all tables: with tables of equal size, the
same number of rows in all).

Writes results.json and results.md into --out. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# tbegen optimizer name -> FBGEMM's EmbOptimType member
FBGEMM_OPTIMIZER = {"sgd": "EXACT_SGD", "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD", "adagrad": "EXACT_ADAGRAD",
                    "adam": "ADAM"}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", type=int, default=8, help="T (C2: 32)")
    ap.add_argument("--rows", type=int, default=1_000_000, help="E, rows per table (C2: 1000000)")
    ap.add_argument("--dim", type=int, default=128, help="D (C2: 128)")
    ap.add_argument("--batch", type=int, default=4096, help="B, bags per table (C2: 16384)")
    ap.add_argument("--pooling-factor", type=int, default=20, help="L, indices per bag (C2: 20)")
    ap.add_argument("--alpha", type=float, default=1.1, help="Zipf exponent (C2: 1.1)")
    ap.add_argument("--optimizer", default="rowwise_adagrad", choices=sorted(FBGEMM_OPTIMIZER))
    ap.add_argument("--cache", default="0.01,0.05,0.2", help="cache sizes, as fractions of each table's rows")
    ap.add_argument("--algorithm", default="lru", choices=["lru", "lfu"],
                    help="both systems' cache algorithm (lfu: its counts need many steps to learn a stream: "
                         "at C2 20%% on an H100 the distinct-row hit rate was 0.611 after 6 warm-up steps, "
                         "0.674 after 40, 0.693 after 150; give lfu a long --warmup)")
    ap.add_argument("--systems", default="tbegen,fbgemm", help="tbegen and/or fbgemm (skipped if it does not import)")
    ap.add_argument("--prefetch-ahead", action="store_true",
                    help="tbegen: also time steps that prefetch the next batch between forward and backward")
    ap.add_argument("--pipelined", action="store_true",
                    help="tbegen: also time steps in TorchRec's prefetch pipeline order: the next batch prefetched on a "
                         "side stream between forward and backward (its prefetch runs beside the backward)")
    ap.add_argument("--row-copy", action="store_true",
                    help="tbegen: time the cached steps both ways: with TBEGEN_CACHE_ROW_COPY=1 (the default on CUDA: "
                         "row moves with _copy_rows, loads and write-backs at once, each on half the SMs; rows "
                         "labelled '(row copy)') and =0 (torch's index kernels; the unlabelled rows)")
    ap.add_argument("--variant", action="append", default=[], metavar="ENV=VALUE[,ENV2=VALUE2]",
                    help="tbegen: also time each cached cell (in-step, and pipelined with --pipelined) with these "
                         "environment switches set while the module is made (where the cache reads them), e.g. "
                         "TBEGEN_CACHE_EXCHANGE=1 or TBEGEN_CACHE_BACKING=host-huge; rows labelled with them. "
                         "Repeatable")
    ap.add_argument("--control", action="store_true",
                    help="tbegen: after a cached cell's variants, time the default again (in-step, and pipelined "
                         "with --pipelined; rows labelled 'control'), so that a variant is compared with the "
                         "default timed both before and after it: the rows of one process may drift (landing14: "
                         "the pipelined 20%% step 16.86 and 19.45 ms for two rows that ran the same code)")
    ap.add_argument("--profile", action="store_true",
                    help="after timing, profile 3 more tbegen steps per cached placement (torch.profiler, tbegen's "
                         "named ranges on): each CUDA stream's busy time and overlap, each range's GPU and host time, "
                         "op by op, and how often the host waits (profile-*.txt; the trace in trace-*.json)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-cache-out"))
    ap.add_argument("--device", default="cuda", help="cuda; or cpu, to check the script on a small shape (tbegen only)")
    args = ap.parse_args(argv)
    args.cache_fractions = [float(x) for x in args.cache.split(",") if x]
    for f in args.cache_fractions:
        if not 0.0 < f <= 1.0:
            ap.error(f"--cache: fractions must be in (0, 1], got {f}")
    args.system_list = [s for s in args.systems.split(",") if s]
    args.variants = []
    for text in args.variant:
        pairs = [p.split("=", 1) for p in text.split(",") if p]
        if not pairs or any(len(p) != 2 or not p[0] for p in pairs):
            ap.error(f"--variant: expected ENV=VALUE[,ENV2=VALUE2], got {text!r}")
        args.variants.append(dict(pairs))
    bad = set(args.system_list) - {"tbegen", "fbgemm"}
    if bad:
        ap.error(f"--systems: unknown {sorted(bad)} (tbegen, fbgemm)")
    return args


# ---- batches ----------------------------------------------------------------------------------------


def zipf_batches(args, count: int, device):
    """`count` batches, each {indices, offsets, distinct}: indices table-major (T*B bags of L),
    distinct = distinct rows per table."""
    T, E, B, L = args.tables, args.rows, args.batch, args.pooling_factor
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed)
    weights = torch.arange(1, E + 1, device=device, dtype=torch.float64).pow(-args.alpha)
    cdf = torch.cumsum(weights, 0)
    cdf /= cdf[-1].item()
    rank_to_row = torch.stack([torch.randperm(E, device=device, generator=gen) for _ in range(T)])
    offsets = torch.arange(T * B + 1, device=device, dtype=torch.int64) * L
    out = []
    for _ in range(count):
        u = torch.rand((T, B * L), device=device, dtype=torch.float64, generator=gen)
        ranks = torch.searchsorted(cdf, u).clamp_(max=E - 1)
        rows = torch.gather(rank_to_row, 1, ranks)
        keys = (rows + torch.arange(T, device=device)[:, None] * E).reshape(-1)
        distinct = torch.bincount(torch.unique(keys) // E, minlength=T).tolist()
        out.append(dict(indices=rows.reshape(-1).contiguous(), offsets=offsets, distinct=distinct))
    return out


# ---- timing -----------------------------------------------------------------------------------------


class _HostTimer:
    """A CUDA event's interface over the host clock (the CPU check of the script)."""

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_steps(step, batches, warmup: int, iters: int, after_warmup=None, cuda=True):
    """Runs step(batch, next_batch) on batches 0..warmup-1, then times iters more."""
    n = len(batches)
    for i in range(warmup):
        step(batches[i % n], batches[(i + 1) % n])
    _sync()
    if after_warmup is not None:
        after_warmup()
    timer = (lambda: torch.cuda.Event(enable_timing=True)) if cuda else _HostTimer
    events = [(timer(), timer()) for _ in range(iters)]
    t0 = time.perf_counter()
    for i in range(iters):
        k = warmup + i
        events[i][0].record()
        step(batches[k % n], batches[(k + 1) % n])
        events[i][1].record()
    # the wall clock stops when the last timed step's end is reached, not when the device is idle:
    # in the pipelined mode the last step also prefetches the batch after it, which no timed step
    # trains (landing13: its exchange, ~10 ms at C2 20%, added ~1.4 ms to the wall time per step
    # over 8 steps; the events' median, 12.79 ms, did not count it)
    last = events[-1][1]
    (last.synchronize if hasattr(last, "synchronize") else _sync)()
    wall = (time.perf_counter() - t0) * 1e3 / iters
    _sync()
    ms = [a.elapsed_time(b) for a, b in events]
    return dict(step_ms=statistics.median(ms), step_ms_min=min(ms), step_ms_max=max(ms), wall_ms_per_step=wall)


def profile_steps(args, step, batches, label: str, steps: int = 3) -> str:
    """Profiles `steps` more steps (torch.profiler, host and GPU) with tbegen's named ranges on
    (tbegen/_ranges.py: forward, backward, prefetch, the cache's lookup, host wait, fill,
    write-back, load; also NVTX ranges under nsys): writes into profile-LABEL.txt under --out the
    per-stream timeline summary (stream_summary: each CUDA stream's busy time, what of it ran
    beside another stream, each range's GPU and host time per step), the ops by host time and by
    GPU time, and the host's waits; and the trace itself (trace-LABEL.json, for chrome://tracing or
    Perfetto). Returns the profile's file name."""
    from torch.profiler import ProfilerActivity, profile

    from tbegen import _ranges

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device != "cpu" else [])
    n = len(batches)
    was_on = _ranges.enabled()
    _ranges.enable(True)
    try:
        with profile(activities=activities) as prof:
            for i in range(steps):
                step(batches[i % n], batches[(i + 1) % n])
            _sync()
    finally:
        _ranges.enable(was_on)
    trace = Path(args.out) / f"trace-{label}.json"
    prof.export_chrome_trace(str(trace))
    events = prof.key_averages()
    waits = {e.key: e.count for e in events
             if any(w in e.key for w in ("Synchronize", "cudaMemcpy", "item", "_local_scalar_dense", "tolist"))}
    lines = [f"# {label}: {steps} steps; the host's waits and copies (name: calls): {waits}", "",
             *stream_summary(json.loads(trace.read_text()), steps), "",
             "## by host time (self)", events.table(sort_by="self_cpu_time_total", row_limit=30)]
    if args.device != "cpu":
        lines += ["## by GPU time", events.table(sort_by="cuda_time_total", row_limit=30)]
    name = f"profile-{label}.txt"
    (Path(args.out) / name).write_text("\n".join(lines))
    return name


_GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


def _merged(intervals):
    """The union of (start, end) intervals, as sorted disjoint intervals."""
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(xs, ys) -> float:
    """Total length of the intersection of two sorted disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, hi - lo)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def stream_summary(trace: dict, steps: int) -> list:
    """Markdown lines from a torch.profiler chrome trace (its traceEvents; times in us): per CUDA
    stream, the time its kernels, copies and fills kept it busy, and how much of that ran while
    another stream was busy (overlap); per tbegen range (tbegen/_ranges.py), its time on each
    stream (gpu_user_annotation: from its first kernel's start to its last one's end) and on the
    host (user_annotation; tbegen.cache.host_wait is the host blocked on the lookup's summary), all
    in ms per step."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    busy = {}
    for e in events:
        if e.get("cat") in _GPU_WORK:
            stream = e.get("args", {}).get("stream", e.get("tid"))
            busy.setdefault(stream, []).append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    lines = [f"## per CUDA stream (ms per step, over {steps} steps)", "",
             "| stream | busy | ops | beside another stream |", "|---|---|---|---|"]
    merged = {s: _merged(v) for s, v in busy.items()}
    for s in sorted(merged, key=lambda k: -_length(merged[k])):
        others = _merged([iv for t, m in merged.items() if t != s for iv in m])
        lines.append(f"| {s} | {_length(merged[s]) / 1e3 / steps:.3f} | {len(busy[s]) / steps:.0f} "
                     f"| {_intersection(merged[s], others) / 1e3 / steps:.3f} |")
    if not merged:
        lines.append("| (no GPU activity in the trace) | | | |")
    ranges = {}
    for e in events:
        name = e.get("name", "")
        if not name.startswith("tbegen."):
            continue
        if e.get("cat") == "gpu_user_annotation":
            where = f"stream {e.get('args', {}).get('stream', e.get('tid'))}"
        elif e.get("cat") == "user_annotation":
            where = "host"
        else:
            continue
        ranges.setdefault((name, where), []).append(float(e["dur"]))
    lines += ["", "## tbegen's ranges (ms per step; calls per step)", "", "| range | where | ms | calls |",
              "|---|---|---|---|"]
    for (name, where), durs in sorted(ranges.items()):
        lines.append(f"| {name} | {where} | {sum(durs) / 1e3 / steps:.3f} | {len(durs) / steps:g} |")
    return lines


# ---- tbegen -------------------------------------------------------------------------------------------


def count_host_waits(step, batches, steps: int = 3) -> float:
    """The mean number of operations per step that make the host wait for the GPU (tbegen's
    sync audit, tbegen/_sync_audit.py: data-sized outputs, values read by the host), over `steps`
    more steps on the last batches (after one more unaudited step, which prefetches the first of
    them in prefetch-ahead mode)."""
    from tbegen._sync_audit import SyncAudit

    step(batches[len(batches) - steps - 2], batches[len(batches) - steps - 1])
    with SyncAudit() as audit:
        for k in range(len(batches) - steps - 1, len(batches) - 1):
            step(batches[k], batches[k + 1])
    _sync()
    return audit.count / steps


def bench_tbegen(args, batches, grad, fraction, prefetch_ahead=False, row_copy=None, pipelined=False, variant=None,
                 control=False):
    from tbegen import TableBatchedEmbeddingBags

    tables = [(args.rows, args.dim)] * args.tables
    kw = dict(optimizer=args.optimizer, device=args.device, learning_rate=0.01, seed=args.seed)
    if fraction is not None:
        kw.update(placements="managed_caching", cache_load_factor=fraction, cache_algorithm=args.algorithm)
    t0 = time.perf_counter()
    switches = dict(variant or {})
    if row_copy is not None:  # (None: the module's default; read when the cache is made)
        switches["TBEGEN_CACHE_ROW_COPY"] = "1" if row_copy else "0"
    saved = {k: os.environ.get(k) for k in switches}
    os.environ.update(switches)
    try:
        emb = TableBatchedEmbeddingBags(tables, **kw)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    _sync()
    construct_s = time.perf_counter() - t0

    main = torch.cuda.current_stream() if pipelined else None
    side = torch.cuda.Stream() if pipelined else None

    def step(batch, following):
        out = emb(batch["indices"], batch["offsets"])
        if pipelined:  # (TorchRec's PrefetchTrainPipelineSparseDist: after the forward, on its prefetch stream)
            with torch.cuda.stream(side):
                emb.prefetch(following["indices"], following["offsets"], forward_stream=main)
        elif prefetch_ahead:
            emb.prefetch(following["indices"], following["offsets"])
        out.backward(grad)

    r = time_steps(step, batches, args.warmup, args.iters, after_warmup=emb.reset_cache_stats,
                   cuda=args.device != "cpu")
    r.update(system="tbegen", construct_s=construct_s, prefetch_ahead=prefetch_ahead, control=control,
             row_copy=bool(emb._cache is not None and emb._cache._row_copy_blocks),
             pipelined=pipelined, variant=",".join(f"{k}={v}" for k, v in (variant or {}).items()) or None,
             row_copy_blocks=emb._cache._row_copy_blocks if emb._cache is not None else None,
             # (TBEGEN_CACHE_LOOKUP_STREAM=1 took: prefetches' exchanges on the cache's own stream)
             exchange_stream=bool(emb._cache is not None and emb._cache._aside),
             peak_gpu_mem_gb=torch.cuda.max_memory_allocated() / 1e9 if args.device != "cpu" else None)
    if fraction is not None:
        s = emb.cache_stats()
        r.update(hit_rate=s["hit_rate"], unique_hit_rate=s["unique_hit_rate"],
                 rows_loaded_per_step=s["rows_loaded"] / args.iters,
                 rows_written_back_per_step=s["rows_written_back"] / args.iters,
                 mb_moved_per_step=(s["bytes_loaded"] + s["bytes_written_back"]) / args.iters / 1e6,
                 backing_lookups_per_step=s["backing_lookups"] / args.iters, bypasses=s["bypasses"],
                 lookups_per_step=s["prepares"] / args.iters, deferred_per_step=s["deferred"] / args.iters,
                 deferred_early_per_step=s.get("deferred_early", 0) / args.iters,
                 # (the warm, LRU's default, TBEGEN_CACHE_PREFETCH_WARM: rows that deferred prefetches loaded
                 # ahead of their forwards)
                 rows_warmed_per_step=s.get("rows_warmed", 0) / args.iters,
                 cache_rows_per_table=next(iter(s["cache_rows"].values())), direct=all(s["direct"].values()))
        r["host_waits_per_step"] = count_host_waits(step, batches)  # (after the statistics: extra steps)
    if args.profile and fraction is not None:  # (after the statistics too: its steps would count in them)
        label = (f"tbegen-{fraction:g}{'-pipelined' if pipelined else ''}{'-ahead' if prefetch_ahead else ''}"
                 f"{'-rowcopy0' if row_copy is False else ''}"
                 + "".join(f"-{k.removeprefix('TBEGEN_').lower()}{v}" for k, v in (variant or {}).items()))
        r["profile"] = profile_steps(args, step, batches, label)
    r["weights_finite"] = bool(torch.isfinite(emb.split_embedding_weights()[0]).all())
    del emb
    if args.device != "cpu":
        torch.cuda.empty_cache()
    return r


# ---- FBGEMM -------------------------------------------------------------------------------------------


def import_fbgemm():
    """fbgemm_gpu's training TBE, or (None, why not). A subset build of fbgemm_gpu (the GPU
    runner's bundle) may lack some of the wheel's libraries: those are skipped at import."""
    load_library = torch.ops.load_library
    skipped = []

    def load_if_present(path):
        try:
            load_library(path)
        except Exception:
            if os.path.exists(str(path)):
                raise
            skipped.append(os.path.basename(str(path)))

    torch.ops.load_library = load_if_present
    try:
        import fbgemm_gpu  # noqa: F401
        from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import (CacheAlgorithm, EmbeddingLocation,
                                                                          PoolingMode, RecordCacheMetrics)
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (ComputeDevice,
                                                                            SplitTableBatchedEmbeddingBagsCodegen)
    except Exception as e:  # (an import error of any kind: the run goes on without FBGEMM)
        return None, f"{type(e).__name__}: {e}"
    finally:
        torch.ops.load_library = load_library
    if skipped:
        print(f"# fbgemm_gpu: libraries not present, skipped: {skipped}", flush=True)
    return dict(EmbOptimType=EmbOptimType, SparseType=SparseType, CacheAlgorithm=CacheAlgorithm,
                EmbeddingLocation=EmbeddingLocation, PoolingMode=PoolingMode, RecordCacheMetrics=RecordCacheMetrics,
                ComputeDevice=ComputeDevice, TBE=SplitTableBatchedEmbeddingBagsCodegen,
                version=getattr(fbgemm_gpu, "__version__", "?")), None


def bench_fbgemm(args, fb, batches, grad, fraction):
    location = fb["EmbeddingLocation"].DEVICE if fraction is None else fb["EmbeddingLocation"].MANAGED_CACHING
    specs = [(args.rows, args.dim, location, fb["ComputeDevice"].CUDA)] * args.tables
    extra = {}
    if fraction is not None:
        extra = dict(cache_load_factor=fraction, record_cache_metrics=fb["RecordCacheMetrics"](True, False),
                     cache_algorithm=fb["CacheAlgorithm"].LRU if args.algorithm == "lru" else fb["CacheAlgorithm"].LFU)
    t0 = time.perf_counter()
    emb = fb["TBE"](specs, optimizer=getattr(fb["EmbOptimType"], FBGEMM_OPTIMIZER[args.optimizer]),
                    weights_precision=fb["SparseType"].FP32, output_dtype=fb["SparseType"].FP32,
                    learning_rate=0.01, eps=1e-8, pooling_mode=fb["PoolingMode"].SUM,
                    device=torch.device("cuda"), **extra)
    for w in (emb.weights_dev, emb.weights_uvm):
        if w.numel():
            w.uniform_(-0.01, 0.01)
    torch.cuda.synchronize()
    construct_s = time.perf_counter() - t0

    def step(batch, following):
        emb(batch["indices"], batch["offsets"]).backward(grad)

    cached = fraction is not None
    r = time_steps(step, batches, args.warmup, args.iters,
                   after_warmup=emb.cache_miss_counter.zero_ if cached else None)
    r.update(system="fbgemm", construct_s=construct_s, peak_gpu_mem_gb=torch.cuda.max_memory_allocated() / 1e9)
    if cached:
        unique_misses = int(emb.get_cache_miss_counter()[1])
        distinct = sum(sum(batches[(args.warmup + i) % len(batches)]["distinct"]) for i in range(args.iters))
        r.update(unique_hit_rate=1.0 - unique_misses / distinct, cache_rows_total=int(emb.lxu_cache_weights.shape[0]))
    del emb
    torch.cuda.empty_cache()
    return r


# ---- report -------------------------------------------------------------------------------------------


def markdown(args, results, env) -> str:
    lines = [
        f"# managed_caching benchmark",
        "",
        f"T={args.tables} tables of {args.rows} x {args.dim} fp32, B={args.batch}, L={args.pooling_factor}, "
        f"Zipf alpha={args.alpha}, optimizer {args.optimizer}, cache algorithm {args.algorithm}; "
        f"{args.iters} timed steps after {args.warmup} (forward + backward with the fused update). "
        f"GPU: {env['gpu']}; torch {env['torch']}; FBGEMM: {env['fbgemm']}.",
        "",
        "| system | placement | cache rows / table | step ms (median) | wall ms / step | vs device | hit rate (indices) "
        "| hit rate (distinct rows) | MB moved / step | rows read in place / step | host waits / step "
        "| lookups / step (prefetches deferred, of them before their lookup) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    device_ms = {r["system"]: r["step_ms"] for r in results if r["placement"] == "device" and "step_ms" in r}

    def fmt(x, spec=".3f"):
        return "" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

    for r in results:
        if "error" in r:
            lines.append(f"| {r['system']} | {r['placement']} | | error: {r['error']} | | | | | | | | |")
            continue
        base = device_ms.get(r["system"])
        rows = r.get("cache_rows_per_table") or (r.get("cache_rows_total", 0) // args.tables if "cache_rows_total" in r else None)
        lines.append(
            f"| {r['system']}{' (row copy)' if r.get('row_copy') else ''}{' (prefetch ahead)' if r.get('prefetch_ahead') else ''}"
            f"{' (pipelined)' if r.get('pipelined') else ''}{' [' + r['variant'] + ']' if r.get('variant') else ''}"
            f"{' (control: the default again)' if r.get('control') else ''} "
            f"| {r['placement']} | {fmt(rows, 'd')} "
            f"| {r['step_ms']:.2f} | {r['wall_ms_per_step']:.2f} | {fmt(r['step_ms'] / base if base else None, '.2f')}x "
            f"| {fmt(r.get('hit_rate'))} | {fmt(r.get('unique_hit_rate'))} | {fmt(r.get('mb_moved_per_step'), '.1f')} "
            f"| {fmt(r.get('backing_lookups_per_step'), '.0f')} | {fmt(r.get('host_waits_per_step'), '.1f')} "
            f"| {fmt(r.get('lookups_per_step'), '.2f')}"
            f"{'' if r.get('deferred_per_step') is None else ' (' + fmt(r['deferred_per_step'], '.2f')}"
            f"{'' if r.get('deferred_per_step') is None else ', ' + fmt(r.get('deferred_early_per_step'), '.2f') + ' early'}"
            f"{', ' + format(r['rows_warmed_per_step'], '.0f') + ' rows warmed' if r.get('rows_warmed_per_step') else ''}"
            f"{'' if r.get('deferred_per_step') is None else ')'} |"
        )
    lines += ["", "tbegen's hit rate (indices): indices of cached tables whose row was cached before the batch; "
              "(distinct rows): the same per batch's distinct rows (FBGEMM's: 1 - unique misses / distinct rows). "
              "Rows read in place: indices served from the tables' managed memory because the batch had more "
              "distinct rows of a table than its cache holds (docs/placements.md). With prefetch ahead, a batch whose rows "
              "a later prefetch moved is looked up again by its backward, and counted again. Host waits: tbegen's "
              "operations per step that make the host wait for the GPU (tbegen/_sync_audit.py), over 3 more steps. "
              "Lookups: batches looked up (by a prefetch or a forward) per step, 1 when each batch is looked up once; "
              "prefetches deferred: those that left their batch to its forward (it did not fit beside the batch in "
              "flight; docs/placements.md), early: without a lookup of their own (no host wait; cache_stats' "
              "deferred_early); rows warmed: rows a step that such prefetches loaded ahead of their forward "
              "(the warm: LRU's default, TBEGEN_CACHE_PREFETCH_WARM=0 turns it off; cache_stats' rows_warmed)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device != "cpu" and not torch.cuda.is_available():
        print("bench_cache.py needs a CUDA GPU (or --device cpu, to check the script)", file=sys.stderr)
        return 2
    if args.device == "cpu":
        args.system_list = ["tbegen"]
        if args.pipelined:  # (it needs a second CUDA stream)
            print("# --pipelined is skipped on the CPU: benchmarks/cache_timeline.py prints that order's work per "
                  "stream and its waits there", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fb, fb_error = (None, "not asked for") if "fbgemm" not in args.system_list else import_fbgemm()
    env = dict(gpu=torch.cuda.get_device_name() if args.device != "cpu" else "none (cpu check)",
               torch=torch.__version__, python=platform.python_version(),
               fbgemm=fb["version"] if fb else f"skipped ({fb_error})")
    print(f"# {env}", flush=True)
    dev = torch.device(args.device)
    batches = zipf_batches(args, args.warmup + args.iters + 1, dev)
    grad = torch.randn(args.batch, args.tables * args.dim, device=dev, generator=torch.Generator(dev).manual_seed(1))
    print(f"# distinct rows per table per batch (batch 0): min {min(batches[0]['distinct'])}, "
          f"max {max(batches[0]['distinct'])} of {args.rows}", flush=True)
    placements = [("device", None)] + [(f"managed_caching {f:g}", f) for f in args.cache_fractions]
    results = []

    def record(system, name, fn):
        try:
            r = fn()
        except Exception as e:  # (one cell failing, e.g. out of memory, does not end the run)
            r = dict(system=system, error=f"{type(e).__name__}: {e}".replace("|", "/")[:300])
            if args.device != "cpu":
                torch.cuda.empty_cache()
        r["placement"] = name
        results.append(r)
        print(json.dumps(r), flush=True)

    for name, fraction in placements:
        if "tbegen" in args.system_list:
            # (with --row-copy these rows are its other half, TBEGEN_CACHE_ROW_COPY=0; else the default)
            plain = False if args.row_copy else None
            record("tbegen", name, lambda: bench_tbegen(args, batches, grad, fraction, row_copy=plain))
            if args.prefetch_ahead and fraction is not None:
                record("tbegen", name, lambda: bench_tbegen(args, batches, grad, fraction, prefetch_ahead=True,
                                                            row_copy=plain))
            if args.pipelined and fraction is not None and args.device != "cpu":
                record("tbegen", name, lambda: bench_tbegen(args, batches, grad, fraction, pipelined=True,
                                                            row_copy=plain))
            if args.row_copy and fraction is not None:
                record("tbegen", name, lambda: bench_tbegen(args, batches, grad, fraction, row_copy=True))
                if args.prefetch_ahead:
                    record("tbegen", name, lambda: bench_tbegen(args, batches, grad, fraction, prefetch_ahead=True,
                                                                row_copy=True))
                if args.pipelined and args.device != "cpu":
                    record("tbegen", name, lambda: bench_tbegen(args, batches, grad, fraction, row_copy=True,
                                                                pipelined=True))
            for variant in args.variants if fraction is not None else ():
                record("tbegen", name, lambda: bench_tbegen(args, batches, grad, fraction, variant=variant))
                if args.pipelined and args.device != "cpu":
                    record("tbegen", name, lambda: bench_tbegen(args, batches, grad, fraction, pipelined=True,
                                                                variant=variant))
            if args.control and fraction is not None:  # (the default again, after everything else of this cell)
                record("tbegen", name, lambda: bench_tbegen(args, batches, grad, fraction, row_copy=plain,
                                                            control=True))
                if args.pipelined and args.device != "cpu":
                    record("tbegen", name, lambda: bench_tbegen(args, batches, grad, fraction, pipelined=True,
                                                                row_copy=plain, control=True))
        if fb is not None:
            record("fbgemm", name, lambda: bench_fbgemm(args, fb, batches, grad, fraction))
    (out / "results.json").write_text(json.dumps(dict(args={k: v for k, v in vars(args).items()}, env=env,
                                                      distinct_rows_batch0=batches[0]["distinct"],
                                                      results=results), indent=1))
    (out / "results.md").write_text(markdown(args, results, env))
    print((out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
