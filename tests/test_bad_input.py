"""Bad input through the module: out-of-range indices in each bounds-check mode, NaN/Inf in the
per-sample weights and in the output gradient. Each rejected call leaves weights and states
exactly as they were; a skipped index contributes nothing and updates nothing. On CUDA the
errors surface without stopping the GPU (tbegen/errors.py), so the CUDA variants also check that
the next call or `check_errors()` raises, and that the module works again afterwards."""

import warnings

import pytest
import torch

from tbegen import TableBatchedEmbeddingBags

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda])]
TABLES = [(20, 8), (30, 4)]


def make(device, optimizer="adagrad", **kw):
    return TableBatchedEmbeddingBags(TABLES, optimizer=optimizer, device=device, learning_rate=0.1, **kw)


def batch(device):
    """2 features x 3 bags; index 5 (feature 0, bag 1) is the one the tests spoil."""
    ind = torch.tensor([1, 2, 3, 4, 1, 0, 5, 6, 7, 8], device=device)
    off = torch.tensor([0, 2, 5, 6, 8, 9, 10], device=device)
    return ind, off


def snapshot(emb):
    return [emb.weights.detach().clone()] + [getattr(emb.states, s.name).clone() for s in emb.spec.states]


def unchanged(emb, before):
    return all(torch.equal(a, b) for a, b in zip(snapshot(emb), before))


def settle(emb, device):
    """On CUDA, surface what the GPU recorded (the CPU raises in the call itself)."""
    if device == "cuda":
        emb.check_errors()


@pytest.mark.parametrize("device", DEVICES)
def test_out_of_range_index_raises_and_updates_nothing(device):
    emb = make(device)
    before = snapshot(emb)
    ind, off = batch(device)
    bad = ind.clone()
    bad[3] = 20  # table 0 has 20 rows
    with pytest.raises(RuntimeError, match=r"indices\[3\] = 20 is out of range"):
        out = emb(bad, off)
        out.backward(torch.ones_like(out))
        settle(emb, device)
    assert unchanged(emb, before)
    # the module is usable again: a good batch trains
    out = emb(ind, off)
    out.backward(torch.ones_like(out))
    settle(emb, device)
    assert not unchanged(emb, before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["warn", "off"])
def test_skipped_index_contributes_and_updates_nothing(device, mode):
    emb = make(device, bounds_check_mode=mode)
    twin = make(device)
    ind, off = batch(device)
    bad = ind.clone()
    bad[3] = -7
    # the same batch without index 3
    keep = torch.arange(ind.numel(), device=device) != 3
    ind_ok = ind[keep]
    off_ok = off - (off > 3).long()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = emb(bad, off)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(device)
        out.backward(g)
        settle(emb, device)
    expected = twin(ind_ok, off_ok)
    expected.backward(g)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for a, b in zip(snapshot(emb), snapshot(twin)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    messages = [str(w.message) for w in caught if "out of range" in str(w.message)]
    if mode == "warn":
        assert messages and "indices[3] = -7" in messages[0] and "skipped" in messages[0]
    else:
        assert not messages


@pytest.mark.parametrize("device", DEVICES)
def test_malformed_offsets_raise_in_every_mode(device):
    emb = make(device, bounds_check_mode="off")
    before = snapshot(emb)
    ind, off = batch(device)
    bad_off = off.clone()
    bad_off[2] = 1  # decreasing
    with pytest.raises(RuntimeError, match="offsets"):
        out = emb(ind, bad_off)
        out.backward(torch.ones_like(out))
        settle(emb, device)
    assert unchanged(emb, before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("position", [1, 2])
def test_an_offset_past_the_last_raises(device, position):
    """An offset beyond offsets[-1] (the number of indices) in the middle of the offsets: a clear
    error naming it, before any index is read (the bag it ends would reach past the indices)."""
    emb = make(device, bounds_check_mode="off")
    before = snapshot(emb)
    ind, off = batch(device)
    bad_off = off.clone()
    bad_off[position] = 10**9
    with pytest.raises(RuntimeError, match="offsets"):
        out = emb(ind, bad_off)
        out.backward(torch.ones_like(out))
        settle(emb, device)
    assert unchanged(emb, before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
def test_non_finite_per_sample_weight_raises(device, bad_value):
    emb = make(device)
    before = snapshot(emb)
    ind, off = batch(device)
    psw = torch.ones(ind.numel(), device=device)
    psw[4] = bad_value
    with pytest.raises(RuntimeError, match=r"per_sample_weights\[4\] is not finite"):
        out = emb(ind, off, psw)
        out.backward(torch.ones_like(out))
        settle(emb, device)
    assert unchanged(emb, before)


@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_gradient_raises_unless_unchecked(device):
    emb = make(device)
    before = snapshot(emb)
    ind, off = batch(device)
    out = emb(ind, off)
    g = torch.ones_like(out)
    g[1, 2] = float("nan")
    with pytest.raises(RuntimeError, match="gradient of the output is not finite"):
        out.backward(g)
        settle(emb, device)
    assert unchanged(emb, before)
    # opted out: the NaN reaches the weights of the rows of bag 1 of feature 0
    loose = make(device, check_finite=False)
    out = loose(ind, off)
    out.backward(g)
    settle(loose, device)
    assert torch.isnan(loose.split_embedding_weights()[0][3]).any()


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_error_surfaces_at_a_later_call_without_waiting():
    emb = make("cuda")
    before = snapshot(emb)
    ind, off = batch("cuda")
    bad = ind.clone()
    bad[0] = 1000
    out = emb(bad, off)  # returns at once: the GPU has not been waited for
    torch.cuda.synchronize()
    # the forward's record has reached the host by now: the next call of the module raises
    # (here the backward, before it launches anything)
    with pytest.raises(RuntimeError, match=r"indices\[0\] = 1000 is out of range.*earlier call"):
        out.backward(torch.ones_like(out))
    assert unchanged(emb, before)
    # the same without waiting: the error surfaces at the backward or at the latest at check_errors()
    with pytest.raises(RuntimeError, match="out of range"):
        out = emb(bad, off)
        out.backward(torch.ones_like(out))
        emb.check_errors()
    assert unchanged(emb, before)
    # and the module trains again afterwards
    out = emb(ind, off)
    out.backward(torch.ones_like(out))
    emb.check_errors()
    assert not unchanged(emb, before)


def test_bad_bounds_check_mode_is_named():
    with pytest.raises(ValueError, match="bounds_check_mode must be one of"):
        make("cpu", bounds_check_mode="fatal")
