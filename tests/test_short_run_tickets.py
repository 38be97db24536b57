"""Tickets of fewer than 32 runs for the short-run kernels (TBEGEN_SHORT_RUN_TICKETS; issue 29, "random 2").

The 4-wide backward's short-run kernels (templates/include/tbegen/cuda_kernels.cuh,
backward_warp_kernel and backward_group_kernel) take their runs 32 at a time by ticket, one warp
updating the 32 one after another. A batch of few runs for the grid (the sweep's "random 2": T=2
tables of 500 K rows, D=64 and 256, B=16384, L=10, Zipf 1.2, fp16: ~39 K runs, ~1.2 K tickets for a
one-wave grid of 4224 warps) leaves most warps without a ticket and the others 32 runs long. With
the switch at 1 a ticket is small_ticket_runs runs (32, 16, 8 or 4: the largest that gives every
warp of the grid two tickets, else 4), lanes past them fetching nothing. A row is still updated by
one warp, its occurrences summed in sorted order: every weight, state and output must be bitwise
those of the default (=0), for batches of many short runs (harness.random_batch draws a feature's
indices from B * max_L / 3 rows: runs of 1 to ~9 occurrences, most of 1-3), with mixed widths (a
64- and a 256-wide table: the group kernel and the warp kernel, one launch per width class), hot
rows (long runs: the segment kernels, which the switch leaves alone), weighted, mean and sum
pooling, fp16 and fp32 weights, int32 and int64 indices.

Where the grid is sized by the occurrences (N / 32 warps, fewer than a resident wave) the count is
4 or 8 (8 needs more than ~half the occurrences to be runs of their own): the small cases here take
4, "larger" 8, as simulated with the same batches; 16 and 32 need a grid capped at one resident
wave ("wave-capped": ~325 K occurrences, ~183 K runs, 4224 warps (3168 for adam's 256-wide kernel)
on an H100 or H200: 16). The profiler names the kernels that ran (the variant's carry a last
template argument `true`), so that the bitwise test cannot pass on a switch that changes nothing.
CUDA only (`pytest -m cuda`; skipped without a GPU).
"""

from __future__ import annotations

import re

import pytest
import torch

from tbegen import harness

from test_any_width import _train, assert_switch_gives_default_bits

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SWITCH = "TBEGEN_SHORT_RUN_TICKETS"
OPTIMIZERS = ["sgd", "rowwise_adagrad", "adagrad", "adam"]

CASES = {
    # random 2's shape, small: a 64- and a 256-wide table, fp16, bags of 0-4 indices over a few
    # hundred rows each (runs of 1-3 occurrences mostly), a hot row of feature 0 (a long run)
    "fp16-D64-256-short-runs": harness.Case(tables=((3000, 64), (2000, 256)), B=512, max_L=4,
                                            weights_dtype=torch.float16, hot=200, steps=2, seed=2901),
    # the same in fp32, weighted, int32 indices
    "fp32-D64-256-weighted-i32": harness.Case(tables=((2500, 64), (1500, 256)), B=384, max_L=5, weighted=True,
                                              index_dtype=torch.int32, hot=20, steps=2, seed=2902),
    # mean pooling, fp16, three features over two tables (one table read by two features)
    "fp16-D64-256-mean-shared": harness.Case(tables=((2000, 256), (2500, 64)), feature_table_map=(0, 1, 1),
                                             B=256, max_L=4, pooling="mean", weights_dtype=torch.float16,
                                             hot=60, steps=2, seed=2903),
    # one 128-wide table: the warp kernel at kVecs = 1 (with its next run's loads ahead for
    # optimizers without per-element state)
    "fp32-D128-short-runs": harness.Case(tables=((4000, 128),), B=768, max_L=3, hot=100, steps=2, seed=2904),
    # narrow rows: the group kernel's rounds of 4 rows (8 lanes each) from a ticket of 4 runs
    "fp16-D16-32-weighted": harness.Case(tables=((3000, 32), (2000, 16)), B=512, max_L=4, weighted=True,
                                         weights_dtype=torch.float16, hot=100, steps=2, seed=2905),
    # more runs (~50 K, ~65 K occurrences over 150 K rows): 8 runs a ticket
    "fp16-D64-256-larger": harness.Case(tables=((100000, 64), (50000, 256)), B=4096, max_L=16,
                                        weights_dtype=torch.float16, hot=300, steps=2, seed=2906),
    # ~2 K occurrences over 500 rows (runs of ~4): 4 runs a ticket
    "fp32-D64-256-small-tables": harness.Case(tables=((300, 64), (200, 256)), B=512, max_L=4, pooling="mean",
                                              hot=50, steps=2, seed=2908),
    # a grid of one resident wave (more warps of work than fit at once): 16 runs a ticket
    "fp16-D64-256-wave-capped": harness.Case(tables=((140000, 64), (140000, 256)), B=16384, max_L=24,
                                             weights_dtype=torch.float16, hot=500, steps=2, seed=2909),
}


# (the wave-capped case's batches and states take seconds to make on the host: two optimizers, one
# without state and the one whose 256-wide kernel fits fewest warps)
WAVE_CAPPED_OPTIMIZERS = ["sgd", "adam"]


@pytest.mark.parametrize("case_id", sorted(CASES))
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_small_tickets_give_the_default_bits(load_ops, monkeypatch, name, case_id):
    if case_id.endswith("wave-capped") and name not in WAVE_CAPPED_OPTIMIZERS:
        pytest.skip("wave-capped: " + ", ".join(WAVE_CAPPED_OPTIMIZERS) + " only")
    spec, ops = load_ops(name)
    assert_switch_gives_default_bits(ops, spec, CASES[case_id], monkeypatch, SWITCH, default="tickets of 32 runs",
                                     variant="small tickets")


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_small_tickets_match_reference(load_ops, monkeypatch, name):
    spec, ops = load_ops(name)
    monkeypatch.setenv(SWITCH, "1")
    result = harness.run_case(spec, ops, CASES["fp32-D64-256-weighted-i32"], device="cuda")
    assert not result.failures, "\n".join(result.failures)


# the short-run kernels' names as the profiler gives them, and their last template argument
# (kSmallTickets: the warp kernel's 4th, the group kernel's 5th)
_SHORT_RUN = re.compile(r"backward_(warp|group)_kernel<(.*)>\(")


@pytest.mark.parametrize("value", ["0", "1"])
@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_switch_picks_the_kernels(load_ops, monkeypatch, name, value):
    """Both width classes' short-run kernels ran, and each is the variant with the switch at 1 (the
    warp kernel's 4th template argument, the group kernel's 5th, is `true`), the default at 0."""
    from torch.profiler import ProfilerActivity, profile

    spec, ops = load_ops(name)
    monkeypatch.setenv(SWITCH, value)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _train(ops, spec, CASES["fp16-D64-256-short-runs"], "cuda")
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages()]
    ran = {}
    for n in names:
        m = _SHORT_RUN.search(n)
        if m:
            args = [s.strip() for s in m.group(2).split(",")]
            ran[(m.group(1), args[2])] = args[-1]  # (kind, kVecs) -> kSmallTickets
    want = "true" if value == "1" else "false"
    # D=256: the warp kernel (kVecs 2); D=64: the group kernel (kVecs 1)
    assert ("warp", "2") in ran and ("group", "1") in ran, f"short-run kernels that ran: {ran}; names: {names}"
    assert set(ran.values()) == {want}, f"kSmallTickets of the kernels that ran: {ran}, expected {want}"


@pytest.mark.parametrize("value", ["2", "yes", "true", " 1"])
def test_switch_refuses_other_values(load_ops, monkeypatch, value):
    spec, ops = load_ops("sgd")
    monkeypatch.setenv(SWITCH, value)
    with pytest.raises(Exception, match=SWITCH):
        _train(ops, spec, CASES["fp32-D128-short-runs"], "cuda")
    # (also where the batch takes the any-width kernels, which have no tickets: a typo is a typo)
    odd = harness.Case(tables=((50, 18),), B=8, max_L=4, steps=1, seed=2907)
    with pytest.raises(Exception, match=SWITCH):
        _train(ops, spec, odd, "cuda")
