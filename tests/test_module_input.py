"""The forward's input check has a shortcut for the common call (TableBatchedEmbeddingBags
._check_input: one expression, for host time per call) in front of the full check
(_check_input_fully: one property at a time, each failure named). The shortcut must be only that:
for every input it accepts, the full check gives the same tensors. Here both run over a grid of
inputs, good and bad in each property the checks look at, and must agree: the same result (the
same dtypes, values and contiguity) or the same error."""

import itertools

import pytest
import torch

from tbegen.module import TableBatchedEmbeddingBags

F = 2  # features (two tables)


@pytest.fixture(scope="module")
def emb():
    return TableBatchedEmbeddingBags([(10, 4), (6, 4)], optimizer="sgd")


def _tensor(kind, dtype, n):
    if kind == "list":
        return list(range(n))
    values = torch.arange(n, dtype=torch.int64)
    if kind == "2-D":
        return values.to(dtype).reshape(1, n)
    if kind == "strided":  # (1-D, not contiguous)
        return torch.arange(2 * n, dtype=torch.int64)[::2].to(dtype)
    return values.to(dtype)


def _outcome(check, *args):
    try:
        out = check(*args)
    except (TypeError, ValueError) as e:
        return type(e).__name__, str(e)
    return tuple(None if t is None else (t.dtype, t.is_contiguous(), t.tolist()) for t in out)


KINDS = ("1-D", "2-D", "strided", "list")
DTYPES = (torch.int32, torch.int64, torch.int16, torch.float32)
OFFSET_COUNTS = (0, 1, 2 * F + 1, 2 * F + 2)  # (F * B + 1 entries for B = 2; empty; wrong)
WEIGHTS = (None, "ok", "float64", "short")


@pytest.mark.parametrize("psw", WEIGHTS)
def test_the_shortcut_gives_what_the_full_check_gives(emb, psw):
    agreed = accepted = 0
    for ik, ok, idt, odt, n_off in itertools.product(KINDS, KINDS, DTYPES, DTYPES, OFFSET_COUNTS):
        indices, offsets = _tensor(ik, idt, 6), _tensor(ok, odt, n_off)
        weights = {None: None, "ok": torch.ones(6), "float64": torch.ones(6, dtype=torch.float64),
                   "short": torch.ones(5)}[psw]
        fast = _outcome(emb._check_input, indices, offsets, weights)
        full = _outcome(emb._check_input_fully, indices, offsets, weights)
        assert fast == full, (ik, ok, idt, odt, n_off, psw)
        agreed += 1
        accepted += not isinstance(fast[0], str)
    # (the grid holds calls each way, accepted and refused; bad per-sample weights refuse them all)
    if psw in (None, "ok"):
        assert 0 < accepted < agreed
    else:
        assert accepted == 0


def test_the_shortcut_takes_the_common_call(emb, monkeypatch):
    calls = []
    full = emb._check_input_fully
    monkeypatch.setattr(emb, "_check_input_fully", lambda *a: calls.append(a) or full(*a))
    indices, offsets = torch.arange(6), torch.tensor([0, 1, 3, 4, 6])
    emb._check_input(indices, offsets, None)
    assert calls == []
    emb._check_input(indices.to(torch.int32), offsets, None)  # (mixed index dtypes: made one)
    assert len(calls) == 1
