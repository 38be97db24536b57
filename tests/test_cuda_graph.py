"""A device-placed training step captured in a CUDA graph and replayed gives eager's bits
(tbegen/capture.py). The CUDA cases run on a GPU only:
    python3 -m pytest -q tests/test_cuda_graph.py
"""

import pytest
import torch

from tbegen.capture import capture_problems
from tbegen.module import TableBatchedEmbeddingBags

TABLES = [(300, 16), (200, 32), (100, 8)]
B, L = 64, 3  # (a fixed number of indices per batch: a graph replays fixed shapes)

cuda = pytest.mark.cuda


def _need_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def _batches(n, device, seed=3):
    g = torch.Generator().manual_seed(seed)
    F = len(TABLES)
    out = []
    for _ in range(n):
        # varying bag lengths with a fixed total: F*B*L indices
        cuts = torch.sort(torch.randint(0, F * B * L + 1, (F * B - 1,), generator=g)).values
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), cuts, torch.full((1,), F * B * L)])
        owner = torch.searchsorted(offsets[1:], torch.arange(F * B * L), right=True) // B
        rows = torch.tensor([r for r, _ in TABLES])[owner]
        indices = (torch.rand(F * B * L, generator=g) * rows).long()
        out.append((indices.to(device), offsets.to(device)))
    return out


def _module(device, **kw):
    kw.setdefault("optimizer", "rowwise_adagrad")
    kw.setdefault("learning_rate", 0.05)
    return TableBatchedEmbeddingBags(TABLES, device=device, seed=11, **kw)


def _grad(device):
    g = torch.Generator().manual_seed(5)
    return torch.randn(B, sum(d for _, d in TABLES), generator=g).to(device)


def _step(m, indices, offsets, grad):
    m(indices, offsets).backward(grad)


def _bits(m):
    return {k: v.detach().cpu().clone() for k, v in m.state_dict().items() if isinstance(v, torch.Tensor)}


def test_capture_problems_name_what_a_replay_would_repeat():
    """(CPU: what the capture check refuses, without capturing)"""
    assert capture_problems(_module("cpu")) == []
    assert capture_problems(_module("cpu", optimizer="sgd")) == []
    adam = capture_problems(_module("cpu", optimizer="adam"))
    assert any("step count" in p for p in adam), adam
    fp16 = capture_problems(_module("cpu", weights_dtype=torch.float16))
    assert any("stochastic rounding" in p for p in fp16), fp16
    assert capture_problems(_module("cpu", weights_dtype=torch.float16, stochastic_rounding=False)) == []
    cached = capture_problems(_module("cpu", placements="managed_caching"))
    assert any("managed_caching" in p for p in cached), cached


@cuda
@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "sgd", "adagrad"])
def test_captured_step_replays_with_eager_bits(optimizer):
    _need_cuda()
    dev = "cuda"
    batches = _batches(6, dev)
    grad = _grad(dev)
    eager, graphed = _module(dev, optimizer=optimizer), _module(dev, optimizer=optimizer)
    assert _bits(eager).keys() == _bits(graphed).keys()
    for i, o in batches:
        _step(eager, i, o, grad)
    torch.cuda.synchronize()

    # warm-up (a real step: the features table's first read, the extension's load) on a side
    # stream, as torch.cuda.graphs asks
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _step(graphed, *batches[0], grad)
    torch.cuda.current_stream().wait_stream(side)
    static_i, static_o = batches[1][0].clone(), batches[1][1].clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):  # (records the kernels; runs nothing)
        _step(graphed, static_i, static_o, grad)
    for i, o in batches[1:]:
        static_i.copy_(i)
        static_o.copy_(o)
        g.replay()
    torch.cuda.synchronize()
    graphed.check_errors()
    want, got = _bits(eager), _bits(graphed)
    for k in want:
        assert torch.equal(want[k], got[k]), f"{k}: the replayed steps differ from eager"


@cuda
def test_replayed_bad_index_raises_at_check_errors_and_updates_nothing():
    _need_cuda()
    dev = "cuda"
    batches = _batches(2, dev)
    grad = _grad(dev)
    m = _module(dev)
    _step(m, *batches[0], grad)
    torch.cuda.synchronize()
    static_i, static_o = batches[1][0].clone(), batches[1][1].clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        _step(m, static_i, static_o, grad)
    before = _bits(m)
    bad = batches[1][0].clone()
    bad[0] = TABLES[0][0] + 7
    static_i.copy_(bad)
    g.replay()
    with pytest.raises(RuntimeError, match="out of range"):
        m.check_errors()
    after = _bits(m)
    for k in before:
        assert torch.equal(before[k], after[k]), f"{k} changed by a replayed batch with a bad index"
    # the record was cleared: good batches train again
    static_i.copy_(batches[1][0])
    g.replay()
    m.check_errors()
    assert not torch.equal(before["weights"], _bits(m)["weights"])


@cuda
def test_capture_of_a_step_count_reader_is_refused():
    _need_cuda()
    dev = "cuda"
    batches = _batches(2, dev)
    grad = _grad(dev)
    m = _module(dev, optimizer="adam")
    _step(m, *batches[0], grad)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="cannot be captured|capture"):
        with torch.cuda.graph(g):
            _step(m, *batches[1], grad)
