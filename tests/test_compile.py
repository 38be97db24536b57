"""torch.compile over a model that holds the module, in every mode: the same bits as eager, and
bad input still raises (tbegen/compiled.py). The CUDA cases run on a GPU only:
    python3 -m pytest -q tests/test_compile.py -m cuda
"""

import pytest
import torch

from tbegen.module import TableBatchedEmbeddingBags

MODES = {
    "default": {},
    "reduce-overhead": {"mode": "reduce-overhead"},
    "fullgraph": {"fullgraph": True},
}
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)]
# mode="reduce-overhead" on CUDA: the first H200 run (2026-12-04 14:02 UTC, torch 2.11) failed inside
# inductor's CUDA-graph trees before any step (`assert isinstance(inp, (int, torch.Generator))` on the
# effect token of the opaque operators; once "cudagraph pool not tracked"): an error, not a wrong
# result. benchmarks/tools/compile_probe.py on the H200 (landing7, 2026-12-04 21:30 UTC): with
# inductor's defaults the first step fails in the CUDA-graph trees' memory-pool check ("storage data
# ptrs are not allocated in pool"); with torch._inductor.config.graph_partition = False (no CUDA
# graph for a graph holding a cudagraph-unsafe operator) three steps train. Expected to fail until
# fixed (strict: a pass is reported, so the mark comes off then).
REDUCE_OVERHEAD_CUDA = pytest.mark.xfail(
    reason="reduce-overhead on CUDA fails in inductor's CUDA-graph trees (run of 2026-12-04 14:02 UTC)", strict=True)


def _mark_known_failures(request, device, mode):
    if device == "cuda" and mode == "reduce-overhead":
        request.applymarker(REDUCE_OVERHEAD_CUDA)
TABLES = [(60, 8), (40, 12)]


def _need(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


class Model(torch.nn.Module):
    """A Linear over the module's pooled output (what a new user writes first)."""

    def __init__(self, device, optimizer="rowwise_adagrad", twice=False, **kw):
        super().__init__()
        torch.manual_seed(0)
        self.emb = TableBatchedEmbeddingBags(TABLES, optimizer=optimizer, device=device, **kw)
        self.lin = torch.nn.Linear(sum(d for _, d in TABLES), 1, device=device).requires_grad_(False)
        self.twice = twice

    def forward(self, indices, offsets, psw=None):
        out = self.emb(indices, offsets, psw)
        if self.twice:  # two identical calls: two lookups and two updates, as in eager
            out = out + self.emb(indices, offsets, psw)
        return self.lin(out)


def _batches(device, n=4, B=5, weighted=False):
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(n):
        lengths = torch.randint(0, 5, (len(TABLES) * B,), generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        parts = []
        for t, (rows, _) in enumerate(TABLES):
            parts.append(torch.randint(0, rows, (int(offsets[(t + 1) * B] - offsets[t * B]),), generator=g))
        indices = torch.cat(parts)
        psw = torch.rand(indices.numel(), generator=g) if weighted else None
        out.append((indices.to(device), offsets.to(device), None if psw is None else psw.to(device)))
    return out


def _train(model, call, batches):
    """The Linear stays fixed, so the gradient reaching the module is its weight row (exact in any
    compiled graph): what is compared is then the module's own arithmetic. (A trained Linear's
    weight gradient is a reduction the compiler may order differently from eager, which would
    change the last bits of everything after the first step, compiled or not by tbegen.)"""
    losses = []
    for indices, offsets, psw in batches:
        torch.compiler.cudagraph_mark_step_begin()  # (reduce-overhead on CUDA: a new step)
        loss = call(indices, offsets, psw).sum()
        loss.backward()
        losses.append(loss.detach().clone())  # (a CUDA graph's output is reused by its next replay)
    model.emb.check_errors()
    return torch.stack(losses)


def _state(model):
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def _assert_same_bits(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs from eager"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", [
    dict(optimizer="rowwise_adagrad"),
    dict(optimizer="adam", weighted=True),  # (adam's update depends on the step count)
    dict(optimizer="sgd", twice=True),
    dict(optimizer="none"),  # (the dense weight gradient flows back through the compiled graph)
], ids=["rowwise_adagrad", "adam_weighted", "sgd_two_calls", "dense"])
def test_compiled_training_gives_eager_bits(request, device, mode, case):
    _need(device)
    _mark_known_failures(request, device, mode)
    case = dict(case)
    weighted = case.pop("weighted", False)
    twice = case.pop("twice", False)
    batches = _batches(device, weighted=weighted)
    eager = Model(device, twice=twice, **case)
    compiled = Model(device, twice=twice, **case)
    _assert_same_bits(_state(eager), _state(compiled))

    extra = []
    if case["optimizer"] == "none":  # (the dense gradient trained by a torch optimizer)
        extra = [eager.emb.weights, compiled.emb.weights]
    opt_e = torch.optim.SGD(extra[:1], lr=0.1) if extra else None
    opt_c = torch.optim.SGD(extra[1:], lr=0.1) if extra else None

    def run(model, call, opt):
        losses = _train(model, lambda *a: call(*a), batches)
        if opt is not None:  # one more step of the dense weights (their grad from the last batch)
            opt.step()
        return losses

    loss_e = run(eager, eager, opt_e)
    loss_c = run(compiled, torch.compile(compiled, **MODES[mode]), opt_c)
    # (the loss is reduced by the compiler's own kernels: its last bits may differ from eager's)
    torch.testing.assert_close(loss_e.cpu(), loss_c.cpu(), rtol=1e-6, atol=0)
    _assert_same_bits(_state(eager), _state(compiled))
    if case["optimizer"] != "none":
        assert eager.emb._step == compiled.emb._step == len(batches) * (2 if twice else 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", list(MODES))
def test_bad_index_under_compile_raises_and_updates_nothing(request, device, mode):
    _need(device)
    _mark_known_failures(request, device, mode)
    model = Model(device)
    call = torch.compile(model, **MODES[mode])
    good = _batches(device, n=2)
    _train(model, call, good)  # (compiles and trains)
    before = _state(model)
    indices, offsets, _ = good[0]
    bad = indices.clone()
    bad[1] = TABLES[0][0] + 5  # (out of table 0's rows)
    with pytest.raises(RuntimeError, match="out of range"):
        # CPU: the call raises; CUDA: the next call (or check_errors) raises
        call(bad, offsets).sum().backward()
        model.emb.check_errors()
    after = _state(model)
    for k in before:
        if not k.startswith("lin"):
            assert torch.equal(before[k], after[k]), f"{k} changed by a batch with a bad index"
    # training goes on after the error
    _train(model, call, good)


@pytest.mark.parametrize("device", DEVICES)
def test_each_module_trains_itself(device):
    """Two modules of one compiled graph (the operators name a module by its handle): each gets its
    own updates, as in eager; a third module, not compiled, keeps its weights."""
    _need(device)

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Model(device, "rowwise_adagrad"), Model(device, "sgd")
            self.emb = self.a.emb  # (for _train's check_errors)

        def forward(self, indices, offsets, psw=None):
            return self.a(indices, offsets) + 2 * self.b(indices, offsets)

    eager, compiled, idle = Two(), Two(), Model(device, "sgd")
    assert len({eager.a.emb._compile_handle, compiled.a.emb._compile_handle, compiled.b.emb._compile_handle,
                idle.emb._compile_handle}) == 4
    before = _state(idle)
    batches = _batches(device, n=3)
    _train(eager, eager, batches)
    _train(compiled, torch.compile(compiled, fullgraph=True), batches)
    _assert_same_bits(_state(eager), _state(compiled))
    assert compiled.a.emb._step == compiled.b.emb._step == 3
    _assert_same_bits(before, _state(idle))


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_eval_under_no_grad(device):
    """Evaluation under no_grad compiles too, returns eager's output and updates nothing."""
    _need(device)
    model = Model(device).eval()
    indices, offsets, _ = _batches(device, n=1)[0]
    with torch.no_grad():
        want = model(indices, offsets)
        got = torch.compile(model, fullgraph=True)(indices, offsets)
    assert torch.equal(want, got)
    assert model.emb._step == 0


def test_vbe_under_default_compile_gives_eager_bits():
    """VBE (batch_size_per_feature_per_rank): the default mode breaks the graph around the padding
    plan, built on the host, and trains with eager's bits (fullgraph=True refuses the call: the
    padded offsets' size is data-dependent; docs/module.md)."""
    bsfr = [[3, 1], [2, 2]]
    g = torch.Generator().manual_seed(2)
    n = sum(map(sum, bsfr))
    lengths = torch.randint(0, 4, (n,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    indices = torch.randint(0, min(r for r, _ in TABLES), (int(offsets[-1]),), generator=g)
    dims = {d for _, d in TABLES}
    tables = [(r, min(dims)) for r, _ in TABLES]
    eager = TableBatchedEmbeddingBags(tables, optimizer="rowwise_adagrad", learning_rate=0.1, seed=3)
    compiled = TableBatchedEmbeddingBags(tables, optimizer="rowwise_adagrad", learning_rate=0.1, seed=3)
    call = torch.compile(lambda i, o: compiled(i, o, batch_size_per_feature_per_rank=bsfr))
    for _ in range(3):
        a = eager(indices, offsets, batch_size_per_feature_per_rank=bsfr)
        b = call(indices, offsets)
        assert torch.equal(a, b)
        (a * torch.arange(a.numel())).sum().backward()
        (b * torch.arange(b.numel())).sum().backward()
    assert compiled._step == 3
    assert torch.equal(eager.weights, compiled.weights)
    assert torch.equal(eager.states.momentum, compiled.states.momentum)
