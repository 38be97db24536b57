"""Numerical checks of generated kernels against the spec's own float64 reference.

A `Case` describes a random problem (tables, features, batch shape, pooling, dtypes, duplicates,
empty bags, a hot row); `run_case` builds fresh random data for it and runs several training
steps through the generated operators. Before each step it computes, independently of the
kernels and in float64, the pooled forward output, the per-sample-weight gradient and the
updated weights and states (the spec's `reference` applied to every touched row). It compares
all of them with the kernels' results and returns the worst errors.

Errors are measured relative to the size of what changed: for float32 tensors
max|kernel - reference| / max|reference - before| (so a wrong update cannot hide behind large
weights); for fp16/bf16 weights max|kernel - reference| / max|reference|, whose rounding alone is
half an ulp (one with stochastic rounding). Rows the batch does not touch must not change at all.
Where a step is ill-conditioned (say, adagrad on a hot row whose gradient nearly cancels), an
error over the tolerance is judged again with an elementwise allowance: how far the float64
reference itself moves when its accumulated gradients are perturbed by float32 rounding
(`gradient_sensitivity`). A wrong kernel still fails: the allowance is of the order of float32
rounding wherever the step is well-conditioned.

Used by `tbegen test` and by the test suite (tests/test_numerics.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .layout import POOLING, VECTOR_MAX_DIM, Layout, make_layout
from .model import STATE_DTYPE_NAMES, OptimizerSpec
from .reference_check import raised_at

# Allowed error per dtype of the tensor compared (see the module docstring for the measure).
TOLERANCE = {
    torch.float32: 1e-4,
    torch.float16: 2.0**-9,  # two ulps
    torch.bfloat16: 2.0**-6,  # two ulps
}
FORWARD_TOLERANCE = 1e-5


_DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def state_dtype(spec: OptimizerSpec, case: "Case", name: str) -> torch.dtype:
    """The storage dtype of state `name` in `case`: the case's override, else the spec's."""
    overrides = dict(case.state_dtypes)
    if next(s for s in spec.states if s.name == name).is_int:
        return torch.int64
    if name in overrides:
        return overrides[name]
    return getattr(torch, STATE_DTYPE_NAMES[next(s.dtype for s in spec.states if s.name == name)])


@dataclass(frozen=True)
class Case:
    tables: Tuple[Tuple[int, int], ...] = ((60, 8), (200, 36), (30, 128))
    feature_table_map: Optional[Tuple[int, ...]] = None
    B: int = 16
    max_L: int = 6
    pooling: str = "sum"
    weighted: bool = False
    weights_dtype: torch.dtype = torch.float32
    index_dtype: torch.dtype = torch.int64
    steps: int = 3
    empty_bags: bool = True
    # extra occurrences of row 0 of feature 0 per step, spread over its bags (a hot row)
    hot: int = 40
    stochastic_rounding: bool = False
    max_segment_length_per_warp: int = 32
    hyper: Tuple[Tuple[str, object], ...] = ()
    # every index of the batch is row 0 of its feature's table
    all_same: bool = False
    seed: int = 0
    # storage dtype overrides per state, as the module's state_dtypes (default: the spec's dtype)
    state_dtypes: Tuple[Tuple[str, torch.dtype], ...] = ()

    @property
    def id(self) -> str:
        dt = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[self.weights_dtype]
        it = "i32" if self.index_dtype == torch.int32 else "i64"
        dims = "D" + "-".join(str(D) for _, D in self.tables)
        parts = [self.pooling, "weighted" if self.weighted else "unweighted", dt, it, dims]
        if self.feature_table_map is not None:
            parts.append("ftm" + "".join(map(str, self.feature_table_map)))
        if self.stochastic_rounding:
            parts.append("sr")
        if self.all_same:
            parts.append("allsame")
        if self.B != 16:
            parts.append(f"B{self.B}")
        if self.hot != 40:
            parts.append(f"hot{self.hot}")
        if self.max_segment_length_per_warp != 32:
            parts.append(f"seg{self.max_segment_length_per_warp}")
        parts += [f"{k}={v}" for k, v in self.hyper]
        parts += [f"{k}:{_DTYPE_IDS[v]}" for k, v in self.state_dtypes]
        return "-".join(parts)


@dataclass
class Result:
    case: Case
    # worst error per compared quantity ("forward", "grad_psw", "weights", state names)
    errors: Dict[str, float] = field(default_factory=dict)
    failures: List[str] = field(default_factory=list)
    # the tolerance each quantity of `errors` was judged against (0 for int states: exact)
    tolerances: Dict[str, float] = field(default_factory=dict)

    @property
    def worst(self) -> float:
        return max(self.errors.values(), default=0.0)

    def closest(self) -> Optional[Tuple[str, float, float]]:
        """(quantity, its worst error, its tolerance) of the quantity nearest its tolerance (the
        largest error / tolerance); None when nothing was compared."""
        def ratio(name):
            err, tol = self.errors[name], self.tolerances.get(name, 0.0)
            if math.isnan(err):
                return math.inf
            return err / tol if tol > 0 else (math.inf if err > 0 else 0.0)
        if not self.errors:
            return None
        name = max(sorted(self.errors), key=ratio)
        return name, self.errors[name], self.tolerances.get(name, 0.0)

    def note(self, what: str, err: float, tol: float, step: int) -> None:
        before = self.errors.get(what, 0.0)
        # (a NaN is kept: max(0.0, nan) would drop it)
        if math.isnan(err) or (not math.isnan(before) and err > before):
            self.errors[what] = err
        else:
            self.errors[what] = before
        self.tolerances[what] = tol
        if not err <= tol:  # NaN fails too
            self.failures.append(f"step {step}: {what}: error {err:.3g} > tolerance {tol:.3g}")


def default_hyperparameters(spec: OptimizerSpec, overrides: Dict[str, object]) -> Dict[str, object]:
    hyper = {h.name: h.default for h in spec.hyperparameters}
    hyper.update(overrides)
    missing = [k for k, v in hyper.items() if v is None]
    if missing:
        raise ValueError(f"tbegen: no value for required hyperparameter(s) {missing} of {spec.name}")
    return hyper


# The references and the random problems work on small tensors, where torch's intra-op threads
# cost far more than they save: on 2 busy cores a [400, 36] float64 index_add_ took 4.5 ms with 2
# threads and 0.014 ms with one (the OpenMP team waits for a core), and the references were half
# of `tbegen test --quick`. So they run on one thread; the kernels keep every thread (their
# parallel paths are under test).


def _one_thread(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        threads = torch.get_num_threads()
        if threads == 1:
            return fn(*args, **kwargs)
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)
    return run


# ---- random problems ---------------------------------------------------------------------------


@dataclass
class Batch:
    indices: torch.Tensor
    offsets: torch.Tensor
    per_sample_weights: Optional[torch.Tensor]


@_one_thread
def random_batch(case: Case, layout: Layout, gen: torch.Generator) -> Batch:
    """Bags of 0..max_L indices (some forced empty), duplicates within and across bags (indices
    drawn from a few rows), and `case.hot` extra occurrences of row 0 of feature 0."""
    F, B = layout.num_features, case.B
    bags: List[List[int]] = []
    for f in range(F):
        E = layout.tables[layout.feature_table_map[f]][0]
        pool = max(1, min(E, case.B * case.max_L // 3))  # few distinct rows: many duplicates
        rows = torch.randperm(E, generator=gen)[:pool]
        for b in range(B):
            L = int(torch.randint(0, case.max_L + 1, (1,), generator=gen))
            if case.empty_bags and b % 5 == 1:
                L = 0
            picks = rows[torch.randint(0, pool, (L,), generator=gen)].tolist()
            if case.all_same:
                picks = [0] * L
            if f == 0 and case.hot and b % 5 != 1:
                picks += [0] * (case.hot // max(1, B - (B + 3) // 5) + 1)
            bags.append(picks)
    lengths = torch.tensor([len(x) for x in bags], dtype=torch.int64)
    offsets = torch.zeros(F * B + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    flat = [i for bag in bags for i in bag]
    indices = torch.tensor(flat, dtype=torch.int64)
    psw = None
    if case.weighted:
        psw = torch.rand(len(flat), generator=gen, dtype=torch.float32) * 2 - 0.5
    return Batch(indices.to(case.index_dtype), offsets.to(case.index_dtype), psw)


@_one_thread
def initial_state(spec: OptimizerSpec, layout: Layout, case: Case, gen: torch.Generator):
    weights = (torch.rand(layout.weights_numel, generator=gen, dtype=torch.float32) - 0.5).to(case.weights_dtype)
    states = {}
    for s in spec.states:
        n = layout.weights_numel if s.per == "element" else layout.total_hash_size
        # start from non-trivial, valid (non-negative) state values so that every term matters
        if s.is_int:
            # small non-negative counts (a step number or counter of 0, 1 or 2)
            states[s.name] = torch.randint(0, 3, (n,), generator=gen, dtype=torch.int64) + int(s.init)
            continue
        value = torch.rand(n, generator=gen, dtype=torch.float32) * 0.1 + float(s.init)
        states[s.name] = value.to(state_dtype(spec, case, s.name))
    for s in spec.table_states:
        # one float32 per table, different per table (a reduce stage over all tables equalises them)
        states[s.name] = torch.rand(len(layout.tables), generator=gen, dtype=torch.float32) * 0.5 + float(s.init)
    return weights, states


# ---- the float64 reference -----------------------------------------------------------------------
# The references see every state as the kernels hold it, and as `tbegen validate` runs them
# (reference_check.py): int states as int64 tensors, the others as float64.


def _reference_states(spec: OptimizerSpec, states: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Copies of `states` for a reference run: int states int64, the others float64."""
    ints = {s.name for s in spec.states if s.is_int}
    return {k: v.to(torch.int64 if k in ints else torch.float64).clone() for k, v in states.items()}


def _reference_value(state, value) -> torch.Tensor:
    """What a reference left in `state`, as the reference copies hold it: an int state as int64
    (a float there, which validate reports, rounded to the nearest integer), others as float64."""
    value = torch.as_tensor(value)
    if not state.is_int:
        return value.to(torch.float64)
    if value.is_floating_point():
        value = value.round()
    return value.to(torch.int64)



def _bag_lists(layout: Layout, B: int, batch: Batch):
    offsets = batch.offsets.to(torch.int64)
    F = layout.num_features
    bag_of = torch.repeat_interleave(torch.arange(F * B), offsets[1:] - offsets[:-1])
    lengths = (offsets[1:] - offsets[:-1])[bag_of]
    return bag_of, lengths


@_one_thread
def reference_forward(layout: Layout, B: int, pooling: str, weights: torch.Tensor, batch: Batch) -> torch.Tensor:
    w = weights.to(torch.float64)
    idx = batch.indices.to(torch.int64)
    bag_of, lengths = _bag_lists(layout, B, batch)
    psw = batch.per_sample_weights.to(torch.float64) if batch.per_sample_weights is not None else torch.ones(len(idx), dtype=torch.float64)
    if pooling == "none":
        out = torch.zeros(len(idx), layout.max_D, dtype=torch.float64)
    else:
        out = torch.zeros(B, layout.total_D, dtype=torch.float64)
    outs = layout.feature_out_offsets()
    for f, t in enumerate(layout.feature_table_map):
        E, D = layout.tables[t]
        table = w[layout.table_offsets[t] : layout.table_offsets[t] + E * D].view(E, D)
        sel = (bag_of // B) == f
        pos = sel.nonzero().flatten()
        rows = table[idx[pos]] * psw[pos, None]
        if pooling == "none":
            out[pos, :D] = rows
            continue
        if pooling == "mean":
            rows = rows / lengths[pos, None].to(torch.float64)
        out[:, outs[f] : outs[f] + D].index_add_(0, bag_of[pos] % B, rows)
    return out


@_one_thread
def reference_grad_psw(layout, B, pooling, weights, batch, grad_output) -> torch.Tensor:
    w = weights.to(torch.float64)
    go = grad_output.to(torch.float64)
    idx = batch.indices.to(torch.int64)
    bag_of, lengths = _bag_lists(layout, B, batch)
    grad = torch.zeros(len(idx), dtype=torch.float64)
    outs = layout.feature_out_offsets()
    for f, t in enumerate(layout.feature_table_map):
        E, D = layout.tables[t]
        table = w[layout.table_offsets[t] : layout.table_offsets[t] + E * D].view(E, D)
        pos = ((bag_of // B) == f).nonzero().flatten()
        g = go[pos, :D] if pooling == "none" else go[bag_of[pos] % B, outs[f] : outs[f] + D]
        dot = (table[idx[pos]] * g).sum(1)
        if pooling == "mean":
            dot = dot / lengths[pos].to(torch.float64)
        grad[pos] = dot
    return grad


@_one_thread
def reference_step(spec, layout, B, pooling, weights, states, batch, grad_output, hyper, step,
                   grad_noise: Optional[Tuple[float, int]] = None):
    """One fused backward step in float64. Returns (weights, states, touched mask over weights).

    grad_noise = (size, sign_seed) perturbs each accumulated gradient element by
    size * sqrt(n) * sum|contributions| with a random sign, n being the row's number of
    occurrences: what accumulating the gradient in float32 may legitimately change
    (see `gradient_sensitivity`)."""
    w = weights.to(torch.float64).clone()
    st = _reference_states(spec, states)
    touched_w = torch.zeros(w.numel(), dtype=torch.bool)
    go = grad_output.to(torch.float64)
    idx = batch.indices.to(torch.int64)
    bag_of, lengths = _bag_lists(layout, B, batch)
    psw = batch.per_sample_weights.to(torch.float64) if batch.per_sample_weights is not None else torch.ones(len(idx), dtype=torch.float64)
    scale = psw / lengths.to(torch.float64) if pooling == "mean" else psw
    outs = layout.feature_out_offsets()
    for t, (E, D) in enumerate(layout.tables):
        grad = torch.zeros(E, D, dtype=torch.float64)
        seen = torch.zeros(E, dtype=torch.bool)
        if grad_noise is not None:
            grad_abs = torch.zeros(E, D, dtype=torch.float64)
            count = torch.zeros(E, dtype=torch.float64)
        for f, tf in enumerate(layout.feature_table_map):
            if tf != t:
                continue
            pos = ((bag_of // B) == f).nonzero().flatten()
            g = go[pos, :D] if pooling == "none" else go[bag_of[pos] % B, outs[f] : outs[f] + D]
            grad.index_add_(0, idx[pos], g * scale[pos, None])
            if grad_noise is not None:
                grad_abs.index_add_(0, idx[pos], (g * scale[pos, None]).abs())
                count.index_add_(0, idx[pos], torch.ones(len(pos), dtype=torch.float64))
            seen[idx[pos]] = True
        rows = seen.nonzero().flatten()
        if len(rows) == 0:
            continue
        if grad_noise is not None:
            size, sign_seed = grad_noise
            signs = torch.randint(0, 2, (E, D), generator=torch.Generator().manual_seed(sign_seed + t)) * 2 - 1
            grad += size * count.sqrt()[:, None] * grad_abs * signs
        base = layout.table_offsets[t]
        wt = w[base : base + E * D].view(E, D)
        ns = dict(hyper)
        ns.update(torch=torch, math=math, step=step, D=D, g=grad[rows].clone(), w=wt[rows].clone())
        for s in spec.states:
            if s.per == "element":
                ns[s.name] = st[s.name][base : base + E * D].view(E, D)[rows].clone()
            else:
                kb = layout.table_key_base[t]
                ns[s.name] = st[s.name][kb + rows].clone()
        for s in spec.table_states:  # read-only: this table's value for each of its touched rows
            ns[s.name] = torch.full((len(rows),), float(st[s.name][t]), dtype=torch.float64)
        run_reference(spec.reference, "reference", ns)
        wt[rows] = ns["w"].to(torch.float64)
        touched_w.view(-1)[base : base + E * D].view(E, D)[rows] = True
        for s in spec.states:
            if s.per == "element":
                st[s.name][base : base + E * D].view(E, D)[rows] = _reference_value(s, ns[s.name])
            else:
                st[s.name][layout.table_key_base[t] + rows] = _reference_value(s, ns[s.name])
    return w, st, touched_w


class ReferenceFailure(Exception):
    """The spec's Python reference raised: said at its line in the YAML file, in the spec's terms
    (`tbegen test` prints it without a traceback)."""


def run_reference(ref, field: str, ns: dict) -> None:
    """Runs the reference snippet `ref` (model.Reference) in the namespace `ns`; an exception it
    raises becomes a ReferenceFailure at the YAML line of the statement that raised it."""
    label = f"{ref.loc.file}:{field}"
    # (float64 as torch's default dtype while it runs: an int64 state combined with a Python float,
    # `since * math.log(2)` or `keep ** since`, is then float64 like the rest of the reference, not
    # float32)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        exec(compile(ref.code, label, "exec"), ns)
    except Exception as e:  # noqa: BLE001 - all of it is the spec's code
        lineno = raised_at(e, label)
        lines = ref.code.splitlines()
        where = f"{ref.loc.file}:{ref.loc.line + lineno - 1}" if lineno else f"{ref.loc}"
        text = f" (in `{lines[lineno - 1].strip()}`)" if lineno and 0 < lineno <= len(lines) else ""
        raise ReferenceFailure(f"{where}: {field}: {type(e).__name__}: {e}{text}") from None
    finally:
        torch.set_default_dtype(default)


@_one_thread
def reference_table_step(spec, layout, weights, states, hyper, step):
    """The whole-table stages of one step in float64: the spec's `table_reference` run once per
    table (each table once, however many features read it) over all of its rows. Returns
    (weights, states) as float64 copies; unchanged when the spec has no `table` stages."""
    w = weights.to(torch.float64).clone()
    st = _reference_states(spec, states)
    if spec.table_stages:
        _reference_table_elements(spec, layout, w, st, hyper, step)
    if spec.table_reductions:
        # then the reduce stages: `table_state_reference`, once over all tables, with each per-row
        # state as a list of [E] tensors (one per table) and each per-table state as a [T] tensor
        ns = dict(hyper)
        ns.update(torch=torch, math=math, step=step)
        for s in spec.states:
            if s.per == "row":
                ns[s.name] = [st[s.name][kb : kb + E].clone()
                              for (E, _), kb in zip(layout.tables, layout.table_key_base)]
        for s in spec.table_states:
            ns[s.name] = st[s.name].clone()
        run_reference(spec.table_state_reference, "table_state_reference", ns)
        for s in spec.table_states:
            st[s.name] = torch.as_tensor(ns[s.name], dtype=torch.float64).reshape(-1).clone()
    return w, st


def _reference_table_elements(spec, layout, w, st, hyper, step) -> None:
    """The `table_reference` of the whole-table element stages, once per table, on `w` and `st`
    (float64) in place."""
    for t, (E, D) in enumerate(layout.tables):
        base, kb = layout.table_offsets[t], layout.table_key_base[t]
        ns = dict(hyper)
        ns.update(torch=torch, math=math, step=step, D=D, w=w[base : base + E * D].view(E, D).clone())
        for s in spec.states:
            view = st[s.name][base : base + E * D].view(E, D) if s.per == "element" else st[s.name][kb : kb + E]
            ns[s.name] = view.clone()
        run_reference(spec.table_reference, "table_reference", ns)
        w[base : base + E * D] = torch.as_tensor(ns["w"], dtype=torch.float64).reshape(-1)
        for s in spec.states:
            value = _reference_value(s, ns[s.name]).reshape(-1)
            if s.per == "element":
                st[s.name][base : base + E * D] = value
            else:
                st[s.name][kb : kb + E] = value


def call_table_update(spec: OptimizerSpec, ops, case: "Case", layout: Layout, feats: torch.Tensor,
                      hyper: Dict[str, object], weights: torch.Tensor, states: Dict[str, torch.Tensor],
                      step: int) -> bool:
    """The whole-table stages of `step` through the extension's `table_update` operator, in place;
    whether a stage ran."""
    return ops.table_update(
        weights, feats, layout.total_hash_size, case.stochastic_rounding, case.seed,
        *state_args(spec, layout, states, feats.device), *[hyper[h.name] for h in spec.hyperparameters], step,
    )


def state_args(spec: OptimizerSpec, layout: Layout, states: Dict[str, torch.Tensor], device) -> list:
    """The operators' state arguments: the element and row states, then the per-table states and
    the table of each feature (specs with per-table states)."""
    args = [states[s.name] for s in spec.states] + [states[s.name] for s in spec.table_states]
    if spec.table_states:
        args.append(torch.tensor(layout.feature_table_map, dtype=torch.int64, device=device))
    return args


# ---- comparison --------------------------------------------------------------------------------


# Relative size of the gradient perturbation used to measure how sensitive a step is to the
# rounding of float32 gradient accumulation: 4 units in the last place of float32, scaled by
# sqrt(occurrences) * sum|contributions| in `reference_step` (the typical size of the rounding
# error of a float32 sum, with a margin).
GRADIENT_ROUNDING = 4 * 2.0**-24


@_one_thread
def gradient_sensitivity(spec, layout, B, pooling, weights, states, batch, grad_output, hyper, step,
                         ref_w, ref_states, seed: int = 0) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """How far the float64 reference step moves, element by element, when each accumulated
    gradient is perturbed by float32 rounding (`GRADIENT_ROUNDING`), up and down independently.

    Where an update is ill-conditioned (a gradient that nearly cancels over a hot row, divided by
    its own root mean square in adagrad-like steps) an exact float32 kernel legitimately differs
    from float64 by about this much; elsewhere this is of the order of float32 rounding and
    allows nothing extra."""
    sens_w = torch.zeros_like(ref_w)
    sens_st = {k: torch.zeros_like(v) for k, v in ref_states.items()}
    for sign_seed in (seed * 2 + 1, seed * 2 + 2):
        w2, st2, _ = reference_step(spec, layout, B, pooling, weights, states, batch, grad_output, hyper,
                                    step, grad_noise=(GRADIENT_ROUNDING, sign_seed))
        sens_w = torch.maximum(sens_w, (w2 - ref_w).abs())
        for k in sens_st:
            sens_st[k] = torch.maximum(sens_st[k], (st2[k] - ref_states[k]).abs())
    return sens_w, sens_st


@_one_thread
def _err(actual: torch.Tensor, ref: torch.Tensor, before: Optional[torch.Tensor],
         allowance: Optional[torch.Tensor] = None) -> float:
    """max|actual - ref| (less an elementwise allowance, if given) relative to the scale of the
    change (float32) or of the values (fp16/bf16); see the module docstring."""
    a = actual.to(torch.float64).cpu()
    if ref.numel() == 0:
        return 0.0
    excess = (a - ref).abs()
    if allowance is not None:
        excess = (excess - allowance).clamp_min(0.0)
    diff = excess.max().item()
    if before is not None:
        scale = (ref - before.to(torch.float64)).abs().max().item()
    else:
        scale = ref.abs().max().item()
    if diff == 0.0:
        return 0.0
    return diff / scale if scale > 0 else math.inf


def layout_args(layout: Layout, device) -> tuple:
    return (layout.features_tensor(device), layout.total_D, layout.max_D)


def call_backward(spec: OptimizerSpec, ops, op: str, case: "Case", layout: Layout, feats: torch.Tensor,
                  hyper: Dict[str, object], grad_output: torch.Tensor, weights: torch.Tensor, states: Dict[str, torch.Tensor],
                  indices: torch.Tensor, offsets: torch.Tensor, psw: Optional[torch.Tensor], step: int) -> None:
    """One fused backward step through the extension's operator `op` ("backward" or
    "backward_lane_split"), updating `weights` and `states` in place; the tensors are on the device
    they are to run on, `feats` too (layout.features_tensor)."""
    getattr(ops, op)(
        grad_output, weights, feats, layout.total_D, layout.max_D, layout.total_hash_size, indices, offsets, psw,
        POOLING[case.pooling], case.max_segment_length_per_warp, case.stochastic_rounding, case.seed,
        *state_args(spec, layout, states, feats.device), *[hyper[h.name] for h in spec.hyperparameters], step,
    )


def run_case(spec: OptimizerSpec, ops, case: Case, device: str = "cpu") -> Result:
    """Runs `case.steps` steps of forward + grad_psw + fused backward and checks each one."""
    gen = torch.Generator().manual_seed(case.seed)
    layout = make_layout(case.tables, case.feature_table_map)
    if case.pooling == "none" and len({D for _, D in layout.tables}) != 1:
        raise ValueError("pooling none needs tables of one dim")
    hyper = default_hyperparameters(spec, dict(case.hyper))
    weights, states = initial_state(spec, layout, case, gen)
    weights, states = weights.to(device), {k: v.to(device) for k, v in states.items()}
    feats, total_D, max_D = layout_args(layout, device)
    pooling = POOLING[case.pooling]
    result = Result(case)
    tol_w = TOLERANCE[case.weights_dtype]
    for step in range(1, case.steps + 1):
        if spec.table_stages or spec.table_reductions:
            _check_table_step(spec, ops, case, layout, feats, hyper, weights, states, step, result)
        batch = random_batch(case, layout, gen)
        dev_psw = batch.per_sample_weights.to(device) if batch.per_sample_weights is not None else None
        ind, off = batch.indices.to(device), batch.offsets.to(device)
        B = case.B

        out = ops.forward(weights, feats, total_D, max_D, ind, off, dev_psw, pooling)
        ref_out = reference_forward(layout, B, case.pooling, weights.cpu(), batch)
        result.note("forward", _err(out, ref_out, None), FORWARD_TOLERANCE, step)

        grad_output = torch.randn(out.shape, generator=gen, dtype=torch.float32)
        grad_output_dev = grad_output.to(device)
        if case.weighted:
            gpsw = ops.grad_per_sample_weights(grad_output_dev, weights, feats, total_D, max_D, ind, off, pooling)
            ref_gpsw = reference_grad_psw(layout, B, case.pooling, weights.cpu(), batch, grad_output)
            result.note("grad_psw", _err(gpsw, ref_gpsw, None), FORWARD_TOLERANCE, step)

        before_w = weights.cpu().clone()
        before_states = {k: v.cpu().clone() for k, v in states.items()}
        ref_w, ref_states, touched = reference_step(
            spec, layout, B, case.pooling, before_w, before_states, batch, grad_output, hyper, step
        )
        call_backward(spec, ops, "backward", case, layout, feats, hyper, grad_output_dev, weights, states, ind, off,
                      dev_psw, step)
        w_now = weights.cpu()
        if not torch.equal(w_now[~touched], before_w[~touched]):
            result.failures.append(f"step {step}: rows outside the batch changed")
        w_before = before_w if case.weights_dtype == torch.float32 else None
        # int states must equal the reference exactly
        for name, ref in ref_states.items():
            if states[name].dtype != torch.int64:
                continue
            mismatch = states[name].cpu() != ref
            # (the error of an int state: the fraction of its entries that differ)
            result.errors[name] = max(result.errors.get(name, 0.0), mismatch.double().mean().item())
            if mismatch.any():
                bad = int(mismatch.nonzero()[0])
                result.failures.append(f"step {step}: int state {name}: {int(states[name].cpu()[bad])} at {bad}, "
                                       f"reference {int(ref[bad])}")
        # a narrow (fp16/bf16) state is measured like narrow weights: against its size
        compared = [("weights", w_now, ref_w, w_before, tol_w)] + [
            (name, states[name].cpu(), ref,
             before_states[name] if states[name].dtype == torch.float32 else None, TOLERANCE[states[name].dtype])
            for name, ref in ref_states.items() if states[name].dtype != torch.int64
        ]
        errors = [_err(a, r, b) for _, a, r, b, _ in compared]
        # an error over the tolerance is judged again with the step's sensitivity to float32
        # gradient rounding allowed for (computed only then: it costs two more reference steps)
        if any(err > tol for err, (*_, tol) in zip(errors, compared)):
            sens_w, sens_st = gradient_sensitivity(
                spec, layout, B, case.pooling, before_w, before_states, batch, grad_output, hyper, step,
                ref_w, ref_states, seed=case.seed * 16 + step)
            allowance = {"weights": sens_w, **sens_st}
            errors = [_err(a, r, b, allowance[name]) for name, a, r, b, _ in compared]
        for err, (name, *_, tol) in zip(errors, compared):
            result.note(name, err, tol, step)
    return result


def _check_table_step(spec, ops, case, layout, feats, hyper, weights, states, step, result) -> None:
    """The whole-table stages of `step` (before its forward, as the module runs them) against the
    spec's `table_reference`, over every row of every table; `weights` and `states` are updated
    in place by the kernel. A step at which the reference changes nothing must change nothing."""
    before_w = weights.cpu().clone()
    before_states = {k: v.cpu().clone() for k, v in states.items()}
    ref_w, ref_states = reference_table_step(spec, layout, before_w, before_states, hyper, step)
    ran = call_table_update(spec, ops, case, layout, feats, hyper, weights, states, step)
    changed = not torch.equal(ref_w, before_w.to(torch.float64)) or any(
        not torch.equal(ref_states[k], before_states[k].to(ref_states[k].dtype)) for k in ref_states)
    if changed and not ran:
        result.failures.append(f"step {step}: table: the reference changed the tables but no whole-table stage ran")
    narrow_w = case.weights_dtype != torch.float32
    compared = [("table weights", weights.cpu(), ref_w, None if narrow_w else before_w, TOLERANCE[case.weights_dtype])]
    for name, ref in ref_states.items():
        dt = states[name].dtype
        if dt == torch.int64:
            if not torch.equal(states[name].cpu(), ref):
                result.failures.append(f"step {step}: table: int state {name} differs from the reference")
            continue
        compared.append((f"table {name}", states[name].cpu(), ref,
                         before_states[name] if dt == torch.float32 else None, TOLERANCE[dt]))
    for name, actual, ref, before, tol in compared:
        result.note(name, _err(actual, ref, before), tol, step)


# ---- lane-split mode ------------------------------------------------------------------------------
# The CUDA kernel splits a row over a warp's 32 lanes, each with its own copy of the per-row
# states and row-stage locals (templates/include/tbegen/cuda_kernels.cuh); the CPU kernel walks
# the row in one loop. The snippet checker (tbegen/snippets.py) rejects every construct it knows
# to depend on the split; this mode checks the rest by running the update the GPU's way on the
# CPU (the `backward_lane_split` operator, cpu_kernels.h's LaneSplit) beside the plain CPU
# kernel, from the same inputs, so that a spec that passes on the CPU in CI passes on the GPU.


def _lane_split_message(spec: OptimizerSpec, error: Exception) -> str:
    message = str(error).splitlines()[0] if str(error) else type(error).__name__
    message = message.replace("tbegen: lane-split mode: ", "")
    for k, s in enumerate(spec.row_states):
        message = message.replace(f"of per-row state {k} ", f"of per-row state {s.name!r} ")
    for k, s in enumerate(spec.int_row_states):
        message = message.replace(f"int per-row state {k} ", f"int per-row state {s.name!r} ")
    return message


def run_lane_split_case(spec: OptimizerSpec, ops, case: Case) -> Result:
    """Runs `case.steps` fused backward steps through the CPU kernel and through its lane-split
    mode from the same weights, states and batch, and compares them after each step (each step
    then continues from the CPU kernel's result). Errors are measured as in `run_case`, the plain
    CPU result taking the reference's place; the two differ only by the rounding of the row
    reductions' summation order unless the spec depends on the split."""
    gen = torch.Generator().manual_seed(case.seed)
    layout = make_layout(case.tables, case.feature_table_map)
    hyper = default_hyperparameters(spec, dict(case.hyper))
    weights, states = initial_state(spec, layout, case, gen)
    feats, total_D, max_D = layout_args(layout, "cpu")
    result = Result(case)
    for step in range(1, case.steps + 1):
        batch = random_batch(case, layout, gen)
        shape = (batch.indices.numel(), max_D) if case.pooling == "none" else (case.B, total_D)
        grad_output = torch.randn(shape, generator=gen, dtype=torch.float32)
        outcome = {}
        for op in ("backward", "backward_lane_split"):
            w, st = weights.clone(), {k: v.clone() for k, v in states.items()}
            try:
                call_backward(spec, ops, op, case, layout, feats, hyper, grad_output, w, st, batch.indices,
                              batch.offsets, batch.per_sample_weights, step)
            except RuntimeError as e:
                if op == "backward":
                    raise
                result.failures.append(f"step {step}: lane-split mode: {_lane_split_message(spec, e)}")
                return result
            outcome[op] = (w, st)
        (w_cpu, st_cpu), (w_lane, st_lane) = outcome["backward"], outcome["backward_lane_split"]
        before_w = weights if case.weights_dtype == torch.float32 else None
        result.note("weights", _err(w_lane, w_cpu.to(torch.float64), before_w), TOLERANCE[case.weights_dtype], step)
        for name in st_cpu:
            if states[name].dtype == torch.int64:
                mismatch = st_lane[name] != st_cpu[name]
                result.errors[name] = max(result.errors.get(name, 0.0), mismatch.double().mean().item())
                if mismatch.any():
                    result.failures.append(f"step {step}: int state {name}: lane-split mode differs from the CPU kernel")
                continue
            narrow = states[name].dtype != torch.float32
            result.note(name, _err(st_lane[name], st_cpu[name].to(torch.float64), None if narrow else states[name]),
                        TOLERANCE[states[name].dtype], step)
        weights, states = w_cpu, st_cpu
    return result


# ---- the standard grid ---------------------------------------------------------------------------

MIXED_TABLES = ((60, 8), (200, 36), (30, 128), (8, 4))
WIDE_TABLES = ((40, VECTOR_MAX_DIM), (25, 516))  # the widest rows the 4-wide kernels take
# widths that are not multiples of 4, so output columns start at odd offsets (on CUDA: the
# any-width kernels), and one row wider than the 4-wide kernels take
ODD_TABLES = ((30, 1), (20, 3), (10, 5), (9, 33), (4, 1031))
NONE_TABLES = ((80, 32), (40, 32))
# rows wider than the 4-wide kernels hold, widths multiples of 4 (on CUDA: the pooled forward's
# chunks of 1024 columns and the any-width backward's 4-wide sums), beside a narrow table
BEYOND_TABLES = ((12, 2048), (6, 1100), (20, 8))
# for specs that need even widths (a whole-table stage reading partner): widths 2 mod 4
EVEN_ODD_TABLES = ((30, 2), (20, 6), (10, 10), (9, 34), (4, 1030))


def standard_cases(spec: OptimizerSpec, dtypes: Sequence[torch.dtype] = (torch.float32, torch.float16)) -> List[Case]:
    """pooling x weighted x weight dtype x index dtype, on mixed dims, with duplicates, empty bags
    and a hot row; plus wide rows, shared tables and odd widths. Hyperparameter variants come from
    `test_hyperparameters` below."""
    cases = []
    seed = 0
    for pooling in ("sum", "mean", "none"):
        for weighted in (False, True):
            for dt in dtypes:
                for it in (torch.int32, torch.int64):
                    seed += 1
                    tables = NONE_TABLES if pooling == "none" else MIXED_TABLES
                    cases.append(Case(tables=tables, pooling=pooling, weighted=weighted, weights_dtype=dt,
                                      index_dtype=it, seed=seed))
    seed += 1
    cases.append(Case(tables=WIDE_TABLES, B=8, max_L=4, pooling="sum", seed=seed))
    seed += 1
    cases.append(Case(tables=MIXED_TABLES, feature_table_map=(0, 1, 1, 2, 0, 3), pooling="mean", weighted=True, seed=seed))
    for hyper in test_hyperparameters(spec):
        seed += 1
        cases.append(Case(tables=MIXED_TABLES, pooling="sum", weighted=True, hyper=hyper, seed=seed))
    # narrow state storage (the module's state_dtypes): every state bf16, then every state fp16
    # (fp32 arithmetic, stochastic rounding on store)
    # (fp16 weights for the fp16 states where the grid has them: `--quick`'s cases are fp32 weights only)
    fp16_states_weights = torch.float16 if torch.float16 in dtypes else dtypes[-1]
    for narrow, wdt, pooling in ((torch.bfloat16, torch.float32, "sum"), (torch.float16, fp16_states_weights, "mean")):
        floats = [s.name for s in spec.states if not s.is_int]
        if floats:
            seed += 1
            cases.append(Case(tables=MIXED_TABLES, pooling=pooling, weighted=True, weights_dtype=wdt, seed=seed,
                              state_dtypes=tuple((name, narrow) for name in floats)))
    # (last, with its own seed, so that the cases above keep theirs). A spec whose whole-table
    # stage pairs columns (partner) needs even widths: it gets widths that are even but not
    # multiples of 4 (on CUDA still the any-width kernels)
    odd_tables = EVEN_ODD_TABLES if spec.table_pairs else ODD_TABLES
    cases.append(Case(tables=odd_tables, B=8, max_L=4, pooling="mean", weighted=True, weights_dtype=dtypes[-1], seed=700))
    # odd widths with every float state bf16 (on CUDA: the any-width kernels' narrow-state path)
    floats = [s.name for s in spec.states if not s.is_int]
    if floats:
        cases.append(Case(tables=odd_tables, B=8, max_L=4, pooling="sum", weighted=True, seed=701,
                          state_dtypes=tuple((name, torch.bfloat16) for name in floats)))
    # rows wider than kVectorMaxD, widths multiples of 4 (on CUDA: the pooled forward in chunks of
    # 1024 columns, the any-width backward's 4-wide sums), fp16 weights where the grid has them
    wide_dtype = torch.float16 if torch.float16 in dtypes else dtypes[-1]
    cases.append(Case(tables=BEYOND_TABLES, B=8, max_L=4, pooling="sum", weighted=True, weights_dtype=wide_dtype,
                      seed=702))
    cases.append(Case(tables=BEYOND_TABLES, B=8, max_L=4, pooling="mean", seed=703))
    return cases


def test_hyperparameters(spec: OptimizerSpec) -> List[Tuple[Tuple[str, object], ...]]:
    """Hyperparameter settings worth a case of their own, all read from the spec: every choice of a
    hyperparameter with `choices`, then every value a hyperparameter lists under `test`, each with
    the `test_base` values of the other hyperparameters (say, a decay switched on); the
    `test_base` values alone when there is nothing else."""
    base = tuple((h.name, h.test_base) for h in spec.hyperparameters if h.test_base is not None)

    def on(name, value):
        return tuple(b for b in base if b[0] != name) + ((name, value),)

    variants = []
    for h in spec.hyperparameters:
        if h.choices:
            variants += [on(h.name, c) for c in h.choices]
    for h in spec.hyperparameters:
        if h.test_values:
            variants += [on(h.name, v) for v in h.test_values]
    if not variants and base:
        variants.append(base)
    return variants


def _nearest_tolerance(results: Sequence[Result]) -> Optional[Tuple[str, float, float]]:
    """Over `results`, (quantity, error, tolerance) of the error nearest its tolerance."""
    def ratio(t):
        _, err, tol = t
        if math.isnan(err):
            return math.inf
        return err / tol if tol > 0 else (math.inf if err > 0 else 0.0)
    picks = [c for c in (r.closest() for r in results) if c is not None]
    return max(picks, key=ratio) if picks else None


def _error_text(nearest: Optional[Tuple[str, float, float]]) -> str:
    if nearest is None:
        return "nothing compared"
    what, err, tol = nearest
    if tol == 0:
        return f"{what} {err:.3g} (exact match required)"
    return f"{what} {err:.3g}, tolerance {tol:.3g} ({err / tol:.0%} of it)" if not math.isnan(err) else \
        f"{what} nan, tolerance {tol:.3g}"


def summarize_lane_split(results: Sequence[Result]) -> str:
    """One line for `tbegen test`, plus one per failed case."""
    failed = [r for r in results if r.failures]
    lines = [f"lane split (the GPU's division of each row, run on the CPU): {len(results) - len(failed)} of "
             f"{len(results)} cases agree with the CPU kernel; nearest its tolerance: "
             f"{_error_text(_nearest_tolerance(results))}"]
    for r in failed:
        lines.append(f"  FAILED {r.case.id}: " + "; ".join(r.failures[:3]))
    return "\n".join(lines)


def summarize(results: Sequence[Result]) -> str:
    """The summary `tbegen test` prints: the count of cases passed and, per weights dtype, the
    error nearest its tolerance (quantity, error, tolerance: errors are relative, see the module
    docstring), then one line per failed case."""
    by_dtype: Dict[str, List[Result]] = {}
    for r in results:
        by_dtype.setdefault(str(r.case.weights_dtype).replace("torch.", ""), []).append(r)
    failed = [r for r in results if r.failures]
    lines = [f"{len(results)} cases, {len(results) - len(failed)} passed, {len(failed)} failed"]
    lines += [f"  worst error ({dt} weights), nearest its tolerance: {_error_text(_nearest_tolerance(rs))}"
              for dt, rs in sorted(by_dtype.items())]
    for r in failed:
        lines.append(f"  FAILED {r.case.id}: " + "; ".join(r.failures[:3]))
    return "\n".join(lines)

