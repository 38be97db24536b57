"""The module's per-call host path (issue 29: small steps are host-bound): what a training step
dispatches besides the operators, and that what the module now reads once per module, or reads
from nn.Module's dictionaries instead of its attribute hooks, still follows every change a user
can make between steps (hyperparameters, replaced state buffers, converted dtypes, no_grad).
No timing here: benchmarks/host_overhead_cpu.py measures the per-call time."""

from __future__ import annotations

import collections
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tbegen


class _Dispatched(TorchDispatchMode):
    """Counts the operators dispatched while it is active."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _batch():
    # two features, a batch of 2: bags [3], [1] of table 0 and [4], [] of table 1
    return torch.tensor([3, 1, 4]), torch.tensor([0, 1, 2, 3, 3])


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_a_training_step_dispatches_only_the_operators(optimizer):
    """After the first call, a step's forward is one operator call and its backward one: no anchor
    allocated per call, no detach or conversion of buffers and gradients that need none, no
    reading of the error record through a tensor operator."""
    emb = tbegen.TableBatchedEmbeddingBags([(8, 4), (5, 3)], optimizer=optimizer, device="cpu", seed=0)
    indices, offsets = _batch()
    grad = torch.ones(2, 7)
    emb(indices, offsets).backward(grad)
    for _ in range(2):
        with _Dispatched() as fwd:
            out = emb(indices, offsets)
        with _Dispatched() as bwd:
            out.backward(grad)
        assert dict(fwd.ops) == {f"tbegen_{optimizer}.forward": 1}
        assert dict(bwd.ops) == {f"tbegen_{optimizer}.backward": 1}
    assert emb.step == 3


def test_the_kept_anchor_ties_every_graph_and_no_grad_makes_none():
    """One anchor per module: each output's backward still updates (two graphs alive at once, each
    backward once), the anchor gets no gradient, and under no_grad the output needs none."""
    emb = tbegen.TableBatchedEmbeddingBags([(8, 4)], optimizer="sgd", device="cpu", seed=0, learning_rate=0.5)
    indices, offsets = torch.tensor([3]), torch.tensor([0, 1])
    before = emb.weights[12:16].clone()
    first, second = emb(indices, offsets), emb(indices, offsets)
    assert first.requires_grad and second.requires_grad
    second.backward(torch.ones(1, 4))
    first.backward(torch.ones(1, 4))
    assert emb.step == 2
    torch.testing.assert_close(emb.weights[12:16], before - 1.0, rtol=0, atol=0)
    anchor = emb.__dict__["_anchor"]
    assert anchor.numel() == 0 and anchor.grad is None
    with torch.no_grad():
        assert not emb(indices, offsets).requires_grad
    assert emb.__dict__["_anchor"] is anchor


def test_hyperparameters_changed_between_steps_are_used():
    """The hyperparameters' names are read once per module, their values at every call."""
    emb = tbegen.TableBatchedEmbeddingBags([(8, 4)], optimizer="sgd", device="cpu", seed=0, learning_rate=0.5)
    indices, offsets = torch.tensor([2]), torch.tensor([0, 1])
    row = emb.weights[8:12].clone()
    emb(indices, offsets).backward(torch.ones(1, 4))
    emb.set_learning_rate(0.25)
    emb(indices, offsets).backward(torch.ones(1, 4))
    torch.testing.assert_close(emb.weights[8:12], row - 0.75, rtol=0, atol=0)


def test_a_replaced_state_buffer_is_updated_and_a_converted_one_refused():
    """The states are read from the module's dictionaries at every call: a buffer replaced by
    assignment is the one updated; one converted to another dtype is refused by name."""
    emb = tbegen.TableBatchedEmbeddingBags([(8, 4)], optimizer="rowwise_adagrad", device="cpu", seed=0)
    indices, offsets = torch.tensor([5]), torch.tensor([0, 1])
    emb(indices, offsets).backward(torch.ones(1, 4))
    old = emb.states.momentum
    kept = old.clone()
    emb.states.momentum = torch.full_like(old, 2.0)
    emb(indices, offsets).backward(torch.full((1, 4), 3.0))
    torch.testing.assert_close(old, kept, rtol=0, atol=0)  # (the replaced buffer is left alone)
    expected = torch.full_like(old, 2.0)
    expected[5] += 9.0  # (row_mean(g * g) of a row of 3s)
    torch.testing.assert_close(emb.states.momentum, expected, rtol=0, atol=0)
    emb.states.momentum = emb.states.momentum.double()
    with pytest.raises(RuntimeError, match="optimizer state 'momentum' is torch.float64"):
        emb(indices, offsets)


def test_the_error_record_is_read_at_every_call_on_the_cpu():
    """The cheap read of the record (its bytes) still sees a skipped index at once, call after call."""
    emb = tbegen.TableBatchedEmbeddingBags([(8, 4)], optimizer="sgd", device="cpu", seed=0,
                                           bounds_check_mode="warn")
    offsets = torch.tensor([0, 1])
    for bad in (8, 11):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            emb(torch.tensor([bad]), offsets).backward(torch.ones(1, 4))
        assert len(caught) == 2 and all(f"= {bad}" in str(w.message) for w in caught), [str(w.message) for w in caught]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        emb(torch.tensor([7]), offsets).backward(torch.ones(1, 4))


# ---- CUDA (the GPU run) -------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.cuda
@needs_cuda
def test_a_cuda_training_step_dispatches_the_operators_and_the_record_copies():
    """On CUDA a steady step's forward is its operator call and the error record's copy to the
    host, and so is its backward (the tickets, scratch and events of the backward are the
    operator's own, no torch call from Python)."""
    emb = tbegen.TableBatchedEmbeddingBags([(64, 8), (40, 16)], optimizer="rowwise_adagrad", device="cuda", seed=0)
    indices, offsets = (t.cuda() for t in _batch())
    grad = torch.ones(2, 24, device="cuda")
    emb(indices, offsets).backward(grad)
    torch.cuda.synchronize()
    for _ in range(2):
        with _Dispatched() as fwd:
            out = emb(indices, offsets)
        with _Dispatched() as bwd:
            out.backward(grad)
        assert dict(fwd.ops) == {"tbegen_rowwise_adagrad.forward": 1, "aten.copy_": 1}
        assert dict(bwd.ops) == {"tbegen_rowwise_adagrad.backward": 1, "aten.copy_": 1}
    emb.check_errors()


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("widths", [(8, 16), (32, 200)])  # (one width class; two, on two streams)
def test_cuda_steps_from_several_threads_at_once_match_steps_one_after_another(widths):
    """The CUDA backward's stream events are kept per thread and reused by every call
    (cuda_ops.cuh CallEvents): four threads, each training its own module on its own stream at the
    same time, must end with the bits of the same steps run one module after the other."""
    import threading

    gen = torch.Generator().manual_seed(29)
    tables = [(500, widths[0]), (300, widths[1])]
    batches = []
    for _ in range(6):
        lengths = torch.randint(0, 6, (2 * 64,), generator=gen)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        rows = torch.cat([torch.randint(0, 500, (int(lengths[:64].sum()),), generator=gen),
                          torch.randint(0, 300, (int(lengths[64:].sum()),), generator=gen)])
        grad = torch.randn(64, sum(widths), generator=gen)
        batches.append((rows.cuda(), offsets.cuda(), grad.cuda()))

    def make(seed):
        return tbegen.TableBatchedEmbeddingBags(tables, optimizer="rowwise_adagrad", device="cuda", seed=seed,
                                                learning_rate=0.1)

    def train(emb):
        for rows, offsets, grad in batches:
            emb(rows, offsets).backward(grad)

    expected = []
    for seed in range(4):
        emb = make(seed)
        train(emb)
        expected.append((emb.weights.clone(), emb.states.momentum.clone()))
    torch.cuda.synchronize()

    modules = [make(seed) for seed in range(4)]
    torch.cuda.synchronize()
    errors = []

    def worker(emb):
        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                train(emb)
                torch.cuda.current_stream().synchronize()
        except Exception as e:  # (reported by the main thread)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(emb,)) for emb in modules]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    torch.cuda.synchronize()
    for emb, (weights, momentum) in zip(modules, expected):
        emb.check_errors()
        assert torch.equal(emb.weights, weights)
        assert torch.equal(emb.states.momentum, momentum)
