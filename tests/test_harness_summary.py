"""The summary `tbegen test` prints: every worst error comes with the tolerance it was judged
against (issue 26: a passing summary gave errors without them, so they could not be read)."""

import math

import torch

from tbegen.harness import Case, Result, summarize, summarize_lane_split


def _result(dtype, notes, int_errors=()):
    r = Result(Case(weights_dtype=dtype))
    for what, err, tol in notes:
        r.note(what, err, tol, step=1)
    for name, frac in int_errors:  # as run_case records an int state: the fraction that differs
        r.errors[name] = frac
    return r


def test_the_summary_names_the_quantity_nearest_its_tolerance_with_that_tolerance():
    results = [
        # the forward's raw error is the largest, but the weights' is nearer their tolerance
        _result(torch.float32, [("forward", 5e-6, 1e-5), ("weights", 8e-5, 1e-4)]),
        _result(torch.float32, [("forward", 1e-6, 1e-5), ("weights", 2e-5, 1e-4)]),
        _result(torch.float16, [("weights", 1e-3, 2.0**-9), ("momentum", 1e-7, 1e-4)]),
    ]
    out = summarize(results)
    lines = out.splitlines()
    assert lines[0] == "3 cases, 3 passed, 0 failed"
    assert lines[1] == "  worst error (float16 weights), nearest its tolerance: weights 0.001, tolerance 0.00195 (51% of it)"
    assert lines[2] == "  worst error (float32 weights), nearest its tolerance: weights 8e-05, tolerance 0.0001 (80% of it)"


def test_a_failure_and_an_int_state_are_shown_against_their_tolerance():
    bad = _result(torch.float32, [("weights", 3e-4, 1e-4)])
    exact = _result(torch.float32, [("weights", 1e-6, 1e-4)], int_errors=[("counter", 0.0)])
    out = summarize([bad, exact])
    assert "1 failed" in out
    assert "weights 0.0003, tolerance 0.0001 (300% of it)" in out
    assert "FAILED" in out and "error 0.0003 > tolerance 0.0001" in out
    # an int state that differs outranks any float error: it must match exactly
    wrong_int = _result(torch.float32, [("weights", 9e-5, 1e-4)], int_errors=[("counter", 0.25)])
    assert "counter 0.25 (exact match required)" in summarize([wrong_int])


def test_nan_is_the_worst_and_the_lane_split_line_has_its_tolerance():
    r = _result(torch.float32, [("weights", math.nan, 1e-4), ("forward", 9e-6, 1e-5)])
    assert "weights nan, tolerance 0.0001" in summarize([r])
    ok = _result(torch.float32, [("weights", 2e-7, 1e-4)])
    line = summarize_lane_split([ok])
    assert line.startswith("lane split (the GPU's division of each row, run on the CPU): 1 of 1 cases agree")
    assert line.endswith("nearest its tolerance: weights 2e-07, tolerance 0.0001 (0% of it)")
    assert "nothing compared" in summarize_lane_split([Result(Case())])
