"""`TableBatchedEmbeddingBags`: the runtime face of tbegen, one `torch.nn.Module` for many tables.

    emb = tbegen.TableBatchedEmbeddingBags(
        tables=[(1_000_000, 128), (50_000, 64)], optimizer="rowwise_adagrad", pooling="sum",
        weights_dtype=torch.float32, device="cuda", learning_rate=0.05, eps=1e-8)
    out = emb(indices, offsets)          # [B, 192]; offsets has F*B+1 entries, feature-major
    loss_fn(mlp(out)).backward()         # the fused optimizer update happens here

The optimizer update is fused into the backward pass (see docs/module.md): no weight gradient is
ever materialised, and every backward through an output of this module updates the touched rows
once (also a second backward of a retained graph). With optimizer="none" the module instead
behaves like an ordinary layer: its flat weights are an nn.Parameter that receives a dense
gradient, for any torch optimizer.

Layout (shared with the operators, tbegen/layout.py): all tables live in one flat `weights`
buffer, table t at `layout.table_offsets[t]`, row-major [rows, dim]; per-element optimizer states
have the weights' layout, per-row states one float per row of every table (table t's rows start
at `layout.table_key_base[t]`). Where those buffers live is each table's placement
(tbegen/placement.py, docs/placements.md).
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import itertools
import numbers
import os
import struct
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.autograd.graph import increment_version

from . import build
from . import cache as cache_
from . import compiled as compiled_
from .capture import check_capturable
from . import int8 as int8_
from . import placement as placement_
from ._ranges import span
from ._env import env_flag
from .errors import BOUNDS_CHECK_MODES, ErrorRecord
from .init import fill_uniform_
from .layout import POOLING, Layout, make_layout
from .model import STATE_DTYPE_NAMES, OptimizerSpec
from .spec import find_spec, load_spec

__all__ = ["TableBatchedEmbeddingBags", "DTYPES", "INDEX_DTYPES"]

# Weight dtypes the operators support, with the names accepted for them.
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
# int8 rows (docs/layout.md): weights_dtype "int8" (or torch.int8 / torch.uint8, or "uint8"); the
# buffer is uint8, each row its D codes followed by a float32 scale and bias. The module records
# torch.uint8, the storage dtype, as its weights_dtype.
INT8_NAMES = ("int8", "uint8")
INDEX_DTYPES = (torch.int32, torch.int64)

# Keyword arguments of the constructor other than hyperparameters (for error messages).
_MODULE_ARGS = (
    "tables",
    "optimizer",
    "pooling",
    "weights_dtype",
    "output_dtype",
    "stochastic_rounding",
    "device",
    "feature_table_map",
    "seed",
    "max_segment_length_per_warp",
    "bounds_check_mode",
    "check_finite",
    "state_dtypes",
    "placements",
    "cache_load_factor",
    "cache_rows",
    "cache_algorithm",
)

from .model import INT64_MAX as _INT64_MAX, INT64_MIN as _INT64_MIN


# OptimizerSpec -> torch.ops.tbegen_NAME (build.load_ops caches too, but re-renders to hash).
_OPS: Dict[OptimizerSpec, Any] = {}


def _ops_for(spec: OptimizerSpec):
    ops = _OPS.get(spec)
    if ops is None:
        ops = build.load_ops(spec, with_cuda=None)
        _OPS[spec] = ops
    return ops


# ---- argument checking -----------------------------------------------------------------------


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


# (the packers of _vbe_key, one per rank count: struct's "=Rq", R int64s in the native byte order)
_VBE_PACKERS: Dict[int, Any] = {}
_VBE_ROW_TYPES = frozenset((list, tuple))
_join_bytes = b"".join
_starmap = itertools.starmap


def _vbe_key(bsfr, num_features: int) -> Optional[bytes]:
    """A VBE batch's sizes as its kept plan's key, or None: `bsfr` given as F = num_features lists
    (or tuples) of R >= 1 integers becomes its F x R sizes as int64, feature-major, in one bytes
    object (the buffer vbe_plan_tensor reads). One pass in C (struct packs row by row) that also
    checks: a size that is not an integer (a float, even one equal to an int; a string), past
    int64, or a row of another length raises inside struct, and bsfr then goes the checked way
    (_vbe_sizes: converted or refused with a message). bools, numpy ints and one-element integer
    tensors pack as their values, as _vbe_sizes converts them. Negative sizes pack: the plan
    operator refuses them. (A kept plan's lookup at 32 x 16 sizes of ~300, fresh int objects as a
    data loader makes them: 4.9 us, against 9.6 for a tuple-of-tuples key, its hash, its
    comparison and a pass for the type check; benchmarks/NOTES-cpu.md, "VBE host time".)"""
    if type(bsfr) not in _VBE_ROW_TYPES or len(bsfr) != num_features:
        return None
    try:
        if not _VBE_ROW_TYPES.issuperset(map(type, bsfr)):  # (a set's or a tensor's order is not the caller's)
            return None
        R = len(bsfr[0])
        pack = _VBE_PACKERS.get(R)
        if pack is None:
            if R < 1:
                return None
            pack = _VBE_PACKERS[R] = struct.Struct(f"={R}q").pack
        return _join_bytes(_starmap(pack, bsfr))
    except (struct.error, TypeError, ValueError, OverflowError, RuntimeError):
        return None



class _VbePlans(dict):
    """A module's kept VBE plans by key (_vbe_key), and the plan its last VBE forward used
    (`last`): the forward compares its key with that plan's first (a memcmp) before it hashes the
    key for the lookup (0.8 us for the 4 KB key of 32 x 16 sizes). Emptied, it forgets `last` too.
    (A plain dict in its place, as a benchmark may set, works without the shortcut.)"""

    __slots__ = ("last",)

    def __init__(self):
        super().__init__()
        self.last = None

    def clear(self) -> None:
        super().clear()
        self.last = None


def _resolve_spec(optimizer) -> OptimizerSpec:
    if isinstance(optimizer, OptimizerSpec):
        return optimizer
    if not isinstance(optimizer, (str, os.PathLike)):
        raise TypeError(
            f"tbegen: optimizer must be a spec name (e.g. 'rowwise_adagrad'), a path to a YAML spec or "
            f"an OptimizerSpec, got {type(optimizer).__name__}"
        )
    return load_spec(find_spec(optimizer))


def _check_tables(tables) -> Tuple[Tuple[int, int], ...]:
    if isinstance(tables, (str, bytes)) or not isinstance(tables, Sequence):
        raise TypeError(f"tbegen: tables must be a list of (rows, dim) pairs, got {type(tables).__name__}")
    out = []
    for t, entry in enumerate(tables):
        ok = isinstance(entry, Sequence) and len(entry) == 2 and all(_is_int(x) for x in entry)
        if not ok:
            raise TypeError(f"tbegen: tables[{t}] must be a (rows, dim) pair of ints, got {entry!r}")
        out.append((int(entry[0]), int(entry[1])))
    return tuple(out)


def _check_weights_dtype(dtype) -> torch.dtype:
    """A float dtype (as _check_dtype), or torch.uint8 for int8 rows ("int8", torch.int8, ...)."""
    if (isinstance(dtype, str) and dtype in INT8_NAMES) or dtype in (torch.int8, torch.uint8):
        return torch.uint8
    if (isinstance(dtype, str) and dtype in DTYPES) or (isinstance(dtype, torch.dtype) and dtype in DTYPES.values()):
        return _check_dtype(dtype)
    raise ValueError(
        f"tbegen: weights_dtype must be torch.float32, torch.float16, torch.bfloat16 or \"int8\" (int8 rows "
        f"with a float32 scale and bias each; torch.int8 and torch.uint8 mean the same) (or one of the names "
        f"{sorted(DTYPES) + list(INT8_NAMES)}), got {dtype!r}"
    )


def _check_dtype(dtype, argument: str = "weights_dtype") -> torch.dtype:
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    raise ValueError(
        f"tbegen: {argument} must be torch.float32, torch.float16 or torch.bfloat16 "
        f"(or one of the names {sorted(DTYPES)}), got {dtype!r}"
    )


def state_torch_dtype(spec_dtype: str) -> torch.dtype:
    """The torch dtype of a spec's state `dtype` ("fp32", "bf16", "fp16")."""
    return getattr(torch, STATE_DTYPE_NAMES[spec_dtype])


def _check_state_dtypes(spec: OptimizerSpec, state_dtypes) -> Dict[str, torch.dtype]:
    """Each state's storage dtype: the spec's `dtype`, unless `state_dtypes` names the state."""
    out = {s.name: torch.int64 if s.is_int else state_torch_dtype(s.dtype) for s in spec.states}
    int_states = {s.name for s in spec.states if s.is_int}
    if state_dtypes is None:
        return out
    if not isinstance(state_dtypes, Mapping):
        raise TypeError(f"tbegen: state_dtypes must be a dict {{state name: dtype}}, got {state_dtypes!r}")
    allowed = {torch.float32, torch.float16, torch.bfloat16}
    for name, dt in state_dtypes.items():
        if name not in out:
            raise ValueError(f"tbegen: state_dtypes names {name!r}, but optimizer {spec.name!r} has "
                             f"{'the states ' + str(sorted(out)) if out else 'no states'}")
        if name in int_states:
            raise ValueError(f"tbegen: state_dtypes names {name!r}, an int state (always int64)")
        if isinstance(dt, str) and dt in DTYPES:
            dt = DTYPES[dt]
        if isinstance(dt, str) and dt in STATE_DTYPE_NAMES:
            dt = state_torch_dtype(dt)
        if dt not in allowed:
            raise ValueError(f"tbegen: state_dtypes[{name!r}] must be torch.float32, torch.float16 or "
                             f"torch.bfloat16, got {dt!r}")
        out[name] = dt
    return out


def _check_device(device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"tbegen: device must be 'cpu' or 'cuda' (or 'cuda:N'), got {device!r}") from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"tbegen: device must be 'cpu' or 'cuda' (or 'cuda:N'), got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"tbegen: device {device!r} was asked for, but CUDA is not available to torch here")
    return dev


def _describe_hyperparameters(spec: OptimizerSpec) -> str:
    if not spec.hyperparameters:
        return f"optimizer {spec.name!r} has no hyperparameters"
    parts = []
    for h in spec.hyperparameters:
        text = f"{h.name} ({h.type}, " + ("required" if h.required else f"default {h.default!r}")
        if h.choices:
            text += f", one of {list(h.choices)!r}"
        parts.append(text + ")")
    return f"the hyperparameters of optimizer {spec.name!r} are: " + ", ".join(parts)


def _convert_hyperparameter(spec: OptimizerSpec, name: str, value):
    """One hyperparameter value, checked against its declared type (HyperType.convert, the
    loader's conversion too) and choices."""
    h = spec.hyperparameter(name)
    try:
        converted = h.type.convert(value)
    except (TypeError, ValueError) as e:
        raise type(e)(f"tbegen: hyperparameter {name!r} of optimizer {spec.name!r} {e}") from None
    if h.choices is not None and converted not in h.choices:
        raise ValueError(
            f"tbegen: hyperparameter {name!r} of optimizer {spec.name!r} must be one of "
            f"{list(h.choices)!r}, got {value!r}" + (f" ({h.doc})" if h.doc else "")
        )
    return converted


# Names users bring from torch.optim (and elsewhere) for tbegen's hyperparameters: alias -> the
# spec names it stands for. Used for "did you mean" only where the spec has all of those names.
HYPERPARAMETER_ALIASES = {
    "lr": ("learning_rate",),
    "wd": ("weight_decay",),
    "decay": ("weight_decay",),
    "epsilon": ("eps",),
    "betas": ("beta1", "beta2"),
    "momentum": ("beta1",),  # Adam's first-moment decay plays momentum's part
}


def _did_you_mean(name: str, valid: Sequence[str], also: Sequence[str]) -> Optional[str]:
    targets = HYPERPARAMETER_ALIASES.get(name)
    if targets and all(t in valid for t in targets):
        if len(targets) == 1:
            return f"did you mean {targets[0]!r}?"
        # betas=(b1, b2) is two hyperparameters here
        letters = [f"b{i + 1}" for i in range(len(targets))]
        return (f"did you mean {' and '.join(repr(t) for t in targets)}? {name}=({', '.join(letters)}) is "
                + ", ".join(f"{t}={b}" for t, b in zip(targets, letters)))
    close = difflib.get_close_matches(name, list(valid) + list(also), n=1)
    return f"did you mean {close[0]!r}?" if close else None


def _unknown_names_error(spec: OptimizerSpec, unknown: Sequence[str], also: Sequence[str] = ()) -> TypeError:
    valid = [h.name for h in spec.hyperparameters]
    hints = []
    for name in unknown:
        hint = _did_you_mean(name, valid, also)
        hints.append(f"{name!r} ({hint})" if hint else repr(name))
    message = f"tbegen: unknown hyperparameter(s) {', '.join(hints)} for optimizer {spec.name!r}; "
    message += _describe_hyperparameters(spec)
    if also:
        message += f"; the module's other arguments are: {', '.join(also)}"
    return TypeError(message)


def check_hyperparameters(spec: OptimizerSpec, given: Dict[str, Any], *, complete: bool = True,
                          also: Sequence[str] = ()) -> Dict[str, Any]:
    """Checks `given` against the spec's hyperparameters and returns them converted.

    With `complete`, fills in the defaults and requires every hyperparameter without one; the
    result then has one entry per hyperparameter, in the spec's order (the operators' order).
    """
    unknown = [k for k in given if k not in {h.name for h in spec.hyperparameters}]
    if unknown:
        raise _unknown_names_error(spec, unknown, also)
    values = {k: _convert_hyperparameter(spec, k, v) for k, v in given.items()}
    if not complete:
        return values
    missing = [h.name for h in spec.hyperparameters if h.required and h.name not in values]
    if missing:
        raise TypeError(
            f"tbegen: optimizer {spec.name!r} needs a value for the required hyperparameter(s) "
            f"{', '.join(missing)}; {_describe_hyperparameters(spec)}"
        )
    return {h.name: values[h.name] if h.name in values else h.default for h in spec.hyperparameters}


# ---- the autograd function -------------------------------------------------------------------


class _BlocksOf(torch.autograd.Function):
    """The VBE output on the CPU: blocks (row, rows, column, columns) of the padded output, each
    flattened, one after another. The same values as _RowsOf with the plan's element index, from a
    plan of F x R blocks instead of an index of every output value (building that index each step,
    as a new batch's sizes need, took several times the step's lookups on the CPU). Its backward
    copies each block's gradient into zeros."""

    @staticmethod
    def forward(ctx, out, blocks, numel):
        ctx.shape = out.shape
        ctx.blocks = blocks
        flat = out.new_empty(numel)
        at = 0
        for r0, n, c0, d in blocks:
            flat[at: at + n * d].view(n, d).copy_(out[r0: r0 + n, c0: c0 + d])
            at += n * d
        return flat

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        full = grad.new_zeros(ctx.shape)
        at = 0
        for r0, n, c0, d in ctx.blocks:
            full[r0: r0 + n, c0: c0 + d].copy_(grad[at: at + n * d].view(n, d))
            at += n * d
        return full, None, None


class _RowsOf(torch.autograd.Function):
    """out.reshape(-1)[index] for an index without repeats (the VBE output's values of the padded
    output). Its backward writes the gradient into zeros at those positions (index_copy_: one write
    per position; autograd's own backward of indexing would accumulate, which sorts the index on
    CUDA every step)."""

    @staticmethod
    def forward(ctx, out, index):
        ctx.shape = out.shape
        ctx.save_for_backward(index)
        return out.reshape(-1).index_select(0, index)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        full = grad.new_zeros(ctx.shape.numel())
        full.index_copy_(0, index, grad.contiguous())
        return full.view(ctx.shape), None


class _Lookup(torch.autograd.Function):
    """Forward: the pooled lookup. Backward: the per-sample-weight gradient (from the weights as
    they are before the update), then the fused update (or, for optimizer "none", the dense
    weight gradient).

    Its first input is what ties it into the autograd graph: for the fused optimizers a fresh
    zero-size tensor that requires grad (the "anchor": it makes the output require grad, so that
    the engine calls this backward even when nothing else needs a gradient; it gets no gradient);
    for optimizer "none" the flat weights parameter itself, which receives the dense gradient.
    """

    @staticmethod
    def forward(ctx, module: "TableBatchedEmbeddingBags", anchor_or_weights, indices, offsets, per_sample_weights,
                ticket=None, vbe=None):
        # (with cached tables, `indices` are the kernels' indices: see TableBatchedEmbeddingBags._prepare;
        # with `vbe`, a VBE batch's operator arguments (bag_out, the 1-D output's numel[, its padding
        # index, the offsets then the VBE batch's own]): see _forward_vbe)
        ctx.module = module
        ctx.ticket = ticket
        ctx.vbe = vbe
        ctx.save_for_backward(indices, offsets, per_sample_weights)
        errors = module._errors
        # (the module's buffers read from its dictionaries, not through nn.Module.__getattr__: a
        # few microseconds of a small step's host time, _HostConstants)
        features = module._buffers["features"] if ticket is None else ticket.features
        weights = module._buffer("weights")
        layout = module.layout
        out = module._ops.forward(
            weights.detach() if weights.requires_grad else weights, features, layout.total_D, layout.max_D,
            indices, offsets, per_sample_weights, module._pooling_id, errors.record, errors.skip_bad_indices,
            *(() if vbe is None else vbe),
        )
        # (forward_with_grad: set by _lookup, whether this forward's backward will run; with
        # TBEGEN_ERROR_COPY_AFTER_BACKWARD=1 its copy of the record is left to the backward, errors.py)
        errors.after_call(backward_follows=errors.forward_with_grad)
        errors.forward_with_grad = False
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        module: TableBatchedEmbeddingBags = ctx.module
        indices, offsets, per_sample_weights = ctx.saved_tensors
        if grad_output.dtype != torch.float32 or not grad_output.is_contiguous():
            grad_output = grad_output.to(torch.float32).contiguous()
        grad_psw = None
        errors = module._errors
        errors.poll()
        vbe = getattr(ctx, "vbe", None)  # (torch.compile's backward passes a context without one)
        if vbe is None:
            vbe, vbe_kw = (), {}
        else:  # (bag_out[, the padding index]: the forward's arguments less the output's numel)
            vbe = vbe[0::2]
            vbe_kw = {"bag_output_offsets": vbe[0]} if len(vbe) == 1 else {"bag_output_offsets": vbe[0], "bag_pad": vbe[1]}
        features = module._buffers["features"]
        if ctx.ticket is not None:
            # the batch's rows must be in the slots its indices name (a later prefetch may have
            # evicted some), and the slots it updates are dirty
            ticket = module._ticket_for_backward(ctx.ticket)
            indices, features = ticket.indices, ticket.features
        if per_sample_weights is not None and ctx.needs_input_grad[4]:
            grad_psw = module._ops.grad_per_sample_weights(
                grad_output, module._buffer("weights").detach(), features, module.layout.total_D,
                module.layout.max_D, indices, offsets, module._pooling_id, errors.record, errors.skip_bad_indices, *vbe,
            )
        grad_weights = None
        if module.dense_gradient:
            if ctx.needs_input_grad[1]:
                grad_weights = torch.zeros_like(module.weights, memory_format=torch.contiguous_format)
                module._run_backward(grad_output, grad_weights, indices, offsets, per_sample_weights, **vbe_kw)
        else:
            if ctx.ticket is None:  # (subclasses, e.g. TorchRec's, override the five-argument form)
                module._run_backward(grad_output, module._buffer("weights"), indices, offsets, per_sample_weights,
                                     **vbe_kw)
            else:
                module._run_backward(grad_output, module._buffer("weights"), indices, offsets, per_sample_weights,
                                     features=features, **vbe_kw)
        if ctx.ticket is not None:  # (CUDA: what the next user of the cache on another stream waits for)
            module._cache_order.leave(grad_output.device)
        return None, grad_weights, None, None, grad_psw, None, None


class _CacheStreams:
    """How the uses of the row cache are ordered on CUDA when they run on more than one stream
    (docs/placements.md, "Prefetching on another stream"), without the host waiting. Four kinds
    of use:
    - a *lookup* (a prefetch, a forward's own lookup) reads and changes which row is in which
      slot but leaves the slots of held batches alone (`RowCache.hold`);
    - a *settling* use touches any slot or dirty flag: a backward (its batch's slots), flush,
      drop, the statistics;
    - a *read*: the kernels of a forward whose batch is held read only that batch's slots and
      change nothing (`leave(..., read=True)`);
    - the kernels of a forward given a prefetched batch begin with a wait for that prefetch only
      (`wait_for`).
    Every lookup and settling use first waits, on the device, for the latest use on every other
    stream (`enter`), with two exceptions. A backward whose ticket is valid waits only for the
    latest settling use on every other stream (`enter(..., wait="settling")`), since lookups leave
    its held slots alone; so the prefetch of batch i + 1, issued on a side stream after the forward
    of batch i (TorchRec's prefetch pipeline), runs beside the backward of batch i. A prefetch
    waits only for the latest lookup or settling use on every other stream (`wait="changes"`),
    not for reads: its lookup leaves held slots alone, so the prefetch of batch i + 1 runs beside
    the forward of batch i as well (it needs the backward of batch i - 1, whose rows it may evict
    and write back). Where a lookup does move rows that a read may be using (holds let go:
    `RowCache._before_unheld_move`), it first waits for every other stream's latest use
    (`wait_all`). With TBEGEN_CACHE_LOOKUP_STREAM on a prefetch's row exchange runs on the cache's
    exchange stream (RowCache._launch_aside): `moved` makes every use that waits for all other
    streams (wait=True, wait_all) wait for its latest event, and the forward that takes the batch
    waits for the exchange stream's latest event at that prefetch (the point's third element, `wait_for`);
    a prefetch and a valid ticket's backward (wait="settling") do not (RowCache orders the
    exchange stream after the fill's bookkeeping, and each move of rows on another stream after
    the exchange stream: _join_aside). The prefetch's lookup then waits only for other streams'
    bookkeeping (wait="marks": a backward's `mark`, after its dirty flags, before its kernels);
    its moves of rows wait for the rest (`wait_rows`). `leave` records the end of a use on the
    current stream: an event, once a second stream has been seen (before that, or for a use that
    has not left, a later use on another stream waits for all that stream had queued:
    wait_stream). On the CPU: nothing. A copy of the
    module starts with none (streams and events are not copied)."""

    __slots__ = ("last", "changes", "settling", "marks", "marked", "several")
    # streams remembered; past this, the one seen first is waited for by the current stream and
    # forgotten (a loop that makes a new stream per step would otherwise make every use wait for
    # every stream it ever saw)
    _MAX_STREAMS = 8

    def __init__(self) -> None:
        self.last: Dict[Any, Any] = {}  # stream -> the event after its latest use (None: wait for the stream)
        self.changes: Dict[Any, Any] = {}  # stream -> the event after its latest lookup or settling use (likewise)
        self.settling: Dict[Any, Any] = {}  # stream -> the event after its latest settling use (likewise)
        # stream -> the event after the bookkeeping of its latest lookup or settling use: its end,
        # or, for a backward, the point after its dirty flags (`mark`), before its kernels; what a
        # prefetch's lookup waits for with TBEGEN_CACHE_LOOKUP_STREAM on (wait="marks")
        self.marks: Dict[Any, Any] = {}
        self.marked = set()  # streams whose use in progress recorded its mark
        self.several = False  # (events are recorded only once a second stream has been seen)

    def __deepcopy__(self, memo) -> "_CacheStreams":
        return _CacheStreams()

    def __reduce__(self):
        return (_CacheStreams, ())

    def _point(self, device: torch.device):
        """(the current stream, an event recorded on it now): the event only once a second stream
        has used the cache (None: a stream that waits for this point waits for the stream)."""
        current = torch.cuda.current_stream(device)
        event = None
        if self.several:
            event = torch.cuda.Event()
            event.record(current)
        return current, event

    def _wait(self, current, stream, event) -> None:
        if event is not None:
            current.wait_event(event)
        else:
            current.wait_stream(stream)
        self.several = True

    def enter(self, device: torch.device, wait=True, lookup: bool = False) -> None:
        """Before a use on the current stream: wait=True waits for every other stream's latest
        use, wait="changes" for its latest lookup or settling use (not reads), wait="settling" for
        its latest settling use only, wait=False for nothing; `lookup`: the use leaves held slots
        alone (else it is a settling use)."""
        if device.type != "cuda":
            return
        current = torch.cuda.current_stream(device)
        if wait:
            waited = {True: self.last, "changes": self.changes, "settling": self.settling, "marks": self.marks}[wait]
            for stream, event in waited.items():
                if stream != current:
                    self._wait(current, stream, event)
        # (a use begins here: until its `leave`, no event marks its end)
        self.last[current] = None
        self.changes[current] = None
        self.marks[current] = None
        self.marked.discard(current)
        if not lookup:
            self.settling[current] = None
        self._forget_oldest(current)

    def wait_all(self, device: torch.device) -> None:
        """Within a use: the current stream waits for every other stream's latest use, reads
        included (before a lookup moves rows whose holds were let go: a forward's kernels on
        another stream may still read them)."""
        if device.type != "cuda":
            return
        current = torch.cuda.current_stream(device)
        for stream, event in self.last.items():
            if stream != current:
                self._wait(current, stream, event)

    def _forget_oldest(self, current) -> None:
        """Past _MAX_STREAMS streams, the current stream waits for the one seen first (another),
        which is then forgotten: its uses are behind the current stream's from here on. A later
        settling use's wait then covers it by waiting for all the current stream queued (its
        settling and changes entries None: wait_stream), as this use may be a lookup or a read,
        whose end is no settling event."""
        while len(self.last) > self._MAX_STREAMS:
            stream = next(s for s in self.last if s != current)
            event = self.last.pop(stream)
            self.changes.pop(stream, None)
            self.settling.pop(stream, None)
            self.marks.pop(stream, None)
            self._wait(current, stream, event)
            self.changes[current] = None
            self.settling[current] = None
            self.marks[current] = None

    def mark(self, device: torch.device) -> None:
        """Within a settling use (a backward, TBEGEN_CACHE_LOOKUP_STREAM on): its bookkeeping is
        done (the dirty flags of its batch marked), what follows on this stream are its kernels,
        which touch only its batch's slots. A prefetch's lookup (wait="marks") waits for this
        point, not for the kernels; the exchange that may evict the batch's rows waits for the
        use's end (`wait_rows`)."""
        if device.type != "cuda":
            return
        current, event = self._point(device)
        self.marks[current] = event
        self.marked.add(current)

    def wait_rows(self, stream, device: torch.device) -> None:
        """`stream` (the cache's exchange stream, or the prefetch's stream before it moves rows
        itself) waits for the latest lookup or settling use of every other stream but the current
        one (which it follows already): what a prefetch's lookup did not wait for with
        TBEGEN_CACHE_LOOKUP_STREAM on (wait="marks": the kernels of the backward before, which
        update rows this exchange may write back)."""
        if device.type != "cuda":
            return
        current = torch.cuda.current_stream(device)
        for other, event in self.changes.items():
            if other != stream and other != current:
                self._wait(stream, other, event)

    def moved(self, device: torch.device, stream, event) -> None:
        """Rows move on `stream` (the cache's exchange stream, not a stream any use runs on) until
        `event`: a later use that waits for every other stream waits for it (`last`); lookups and
        valid tickets' backwards do not (RowCache._launch_aside says why)."""
        if device.type != "cuda":
            return
        self.last[stream] = event
        self.several = True
        self._forget_oldest(torch.cuda.current_stream(device))

    def wait_for(self, point, device: torch.device):
        """The current stream waits for one earlier use (`point`, what its `leave` returned, and
        after it, where the use's rows move on the cache's exchange stream, the event after them:
        waited for on any stream); returns the current stream (None on the CPU). A read begins here
        (`leave(read=True)`)."""
        if device.type != "cuda" or point is None:
            return None
        current = torch.cuda.current_stream(device)
        stream, event = point[0], point[1]
        if stream != current:
            self._wait(current, stream, event)
        for rows in point[2:]:
            current.wait_event(rows)
        self.last[current] = None
        self._forget_oldest(current)
        return current

    def leave(self, device: torch.device, lookup: bool = False, read: bool = False):
        """Marks the end of a use of the cache on the current stream (`lookup` as for `enter`;
        `read`: the kernels of a forward whose batch is held); returns (stream, event) for
        `wait_for` (None on the CPU)."""
        if device.type != "cuda":
            return None
        current, event = self._point(device)
        self.last[current] = event
        if not read:
            self.changes[current] = event
            if current in self.marked:  # (its mark stays: the point after its bookkeeping)
                self.marked.discard(current)
            else:
                self.marks[current] = event
            if not lookup:
                self.settling[current] = event
        return current, event


def _record_ticket(ticket: cache_.Ticket, stream) -> None:
    """Records a ticket's tensors (made on the stream of a prefetch) as used by `stream`, so that
    the caching allocator does not hand their memory out while that stream's kernels may still
    read them."""
    for t in (ticket.indices, ticket.slots, ticket.original, ticket.offsets, ticket.features):
        if t.is_cuda:
            t.record_stream(stream)


class _HostConstants:
    """What every operator call of one module passes that never changes: read once, at the first
    call, instead of through the spec's lists, the layout and the cache each call
    (TableBatchedEmbeddingBags._host_constants; benchmarks/host_overhead_cpu.py)."""

    __slots__ = ("state_names", "state_dtypes", "hyper_names", "total_keys", "dense_gradient", "table_states")

    def __init__(self, module: "TableBatchedEmbeddingBags"):
        spec = module.spec
        self.state_names = tuple(s.name for s in spec.states)
        self.state_dtypes = tuple((s.name, module.state_dtypes[s.name]) for s in spec.states)
        self.hyper_names = tuple(h.name for h in spec.hyperparameters)
        # (cached tables' per-row states are keyed after every table's rows: see tbegen/cache.py)
        cache = module._cache
        self.total_keys = module.layout.total_hash_size + (0 if cache is None else cache.keys_tail)
        self.dense_gradient = bool(spec.dense_gradient)
        self.table_states = bool(spec.table_states)


# ---- the module -------------------------------------------------------------------------------


class TableBatchedEmbeddingBags(nn.Module):
    """Many embedding tables, looked up together, trained by an optimizer fused into the backward.

    Args:
        tables: (rows, dim) per table; any dim from 1 to 4096 (tbegen.layout.MAX_DIM).
        optimizer: a spec name from optimizers/ ("sgd", "adagrad", "rowwise_adagrad", "adam",
            "none", ...), a path to a YAML spec, or a loaded `OptimizerSpec`. "none" is the
            dense-gradient mode (no fused update; `weights` is an nn.Parameter with a dense .grad).
        pooling: "sum", "mean" or "none" (one output row per index; every table the same dim).
        weights_dtype: torch.float32, torch.float16, torch.bfloat16, or "int8" (int8 rows with a
            float32 scale and bias each, re-quantized after every update; docs/int8.md).
        output_dtype: the dtype of the pooled output (torch.float32, torch.float16 or
            torch.bfloat16). The lookup always sums in float32; a narrow output is that sum rounded
            to nearest, and its gradient is widened to float32 before the backward (FBGEMM's
            `output_dtype` means the same).
        state_dtypes: {state name: torch.float32 | torch.float16 | torch.bfloat16} overriding the
            storage dtype a spec declares for its states (float32 by default). The update always
            computes in float32; a narrow state is rounded stochastically when stored, with bits
            that are a pure function of (seed, step, state, row, element).
        stochastic_rounding: round fp16/bf16 weights stochastically after each update (the random
            bits are a pure function of (seed, step, row, element), so runs are reproducible).
        device: "cpu" or "cuda" ("cuda:N").
        feature_table_map: the table each feature reads (default: feature t reads table t); several
            features may share a table. The input then has one block of bags per feature.
        seed: seeds the default weight initialisation and the stochastic rounding.
        max_segment_length_per_warp: rows looked up at least this many times in a batch are
            summed in segments by several warps instead of one (CUDA; a tuning knob).
        bounds_check_mode: what an out-of-range index does: "raise" (default: an error, and the
            batch updates nothing), "warn" (the index is skipped: it contributes nothing and
            updates nothing; a warning says which) or "off" (skipped silently). Malformed offsets
            always raise. On CUDA the error is raised without stopping the GPU, so at the latest
            by the module's next call (or by `check_errors()`); nothing is updated in between.
        check_finite: raise (like a bad index in mode "raise") on NaN or Inf in the per-sample
            weights or the output gradient, before anything is updated.
        placements: where each table's weights and optimizer states live: "device" (the default)
            or "managed" (CUDA managed memory, preferred in host memory and read and written in
            place by the GPU kernels, so a table may exceed GPU memory; on the CPU, ordinary host
            memory). One string for every table, or a list with one per table; results are
            bitwise the same for every placement, "managed_caching" included where no stochastic
            rounding is involved (below). "managed_caching": the table lives in managed memory as
            with "managed" (host memory on the CPU) behind a cache of hot rows in GPU memory (on the
            CPU, in the module's host buffers: the same logic); the batch's rows are loaded into
            the cache before the kernels run (automatically in forward, or ahead with
            `prefetch`), and the fused backward updates them there; `flush()` writes them back,
            `cache_stats()` reports hits and bytes moved. With fp16/bf16 weights (stochastic
            rounding) or narrow states, a cached row's random bits are keyed by its cache slot, so
            such runs are reproducible but not bitwise those of "device". "host": page-locked host
            memory mapped for the GPU, read and written in place (when every table is "host";
            mixed with other placements, a "host" table is hinted as a "managed" one). See
            docs/placements.md.
        cache_load_factor: for "managed_caching" tables, the fraction of each table's rows its
            cache holds (0 < f <= 1, default 0.2, rounded up); `cache_rows` overrides it.
        cache_rows: for "managed_caching" tables, cache slots per table: one int for every cached
            table, or a list with one entry per table (entries of other tables are ignored).
            A batch reading more distinct rows of a table than its cache holds reads and updates
            that table in managed memory directly for that batch (bypassing its cache; warned
            once per table, counted by `cache_stats()`).
        cache_algorithm: "lru" (default: evict the least recently used rows) or "lfu" (the least
            frequently used: access counts kept per row since construction; ties by recency).
            With "lru" a prefetch too large to fit beside the batches in flight warms the cache
            with the part of its rows that fits; with "lfu" it is deferred to its forward
            (TBEGEN_CACHE_PREFETCH_WARM=1 / 0 overrides; docs/placements.md).
        **hyperparameters: the optimizer's hyperparameters by name (e.g. learning_rate=0.05);
            the spec's defaults for those not given. Unknown names, wrong types, values outside a
            hyperparameter's `choices`, and missing required ones are errors.

    Weights start as uniform(-sqrt(1/dim), sqrt(1/dim)) per table, computed in float32 on `device`
    by a counter-based generator (each weight a hash of (seed, table, element), tbegen/init.py),
    then rounded to `weights_dtype`: CPU and CUDA modules with the same seed start bitwise
    identical. Overwrite them through `split_embedding_weights()` for another initialisation.
    """

    def __init__(
        self,
        tables: Sequence[Tuple[int, int]],
        optimizer: Union[str, os.PathLike, OptimizerSpec] = "rowwise_adagrad",
        pooling: str = "sum",
        weights_dtype: Union[torch.dtype, str] = torch.float32,
        stochastic_rounding: bool = True,
        device: Union[str, torch.device] = "cpu",
        feature_table_map: Optional[Sequence[int]] = None,
        seed: int = 0,
        max_segment_length_per_warp: int = 32,
        bounds_check_mode: str = "raise",
        check_finite: bool = True,
        state_dtypes: Optional[Mapping[str, Union[torch.dtype, str]]] = None,
        placements: Union[None, str, Sequence[str]] = None,
        output_dtype: Union[torch.dtype, str] = torch.float32,
        cache_load_factor: float = 0.2,
        cache_rows: Union[None, int, Sequence[Optional[int]]] = None,
        cache_algorithm: str = "lru",
        **hyperparameters,
    ):
        super().__init__()
        self._compile_init()
        # Check everything before building anything.
        spec = _resolve_spec(optimizer)
        hyper = check_hyperparameters(spec, hyperparameters, also=_MODULE_ARGS)
        tables = _check_tables(tables)
        if feature_table_map is not None:
            if isinstance(feature_table_map, (str, bytes)) or not isinstance(feature_table_map, Sequence) or not all(
                _is_int(t) for t in feature_table_map
            ):
                raise TypeError(f"tbegen: feature_table_map must be a list of table numbers, got {feature_table_map!r}")
        layout = make_layout(tables, feature_table_map)
        if pooling not in POOLING:
            raise ValueError(f"tbegen: pooling must be one of {sorted(POOLING)}, got {pooling!r}")
        if pooling == "none" and len({D for _, D in layout.tables}) != 1:
            raise ValueError(
                f"tbegen: pooling 'none' returns one [N, dim] block, so every table needs the same dim; "
                f"got dims {[D for _, D in layout.tables]}"
            )
        dtype = _check_weights_dtype(weights_dtype)
        out_dtype = _check_dtype(output_dtype, "output_dtype")
        self_state_dtypes = _check_state_dtypes(spec, state_dtypes)
        dev = _check_device(device)
        if not isinstance(stochastic_rounding, bool):
            raise TypeError(f"tbegen: stochastic_rounding must be a bool, got {stochastic_rounding!r}")
        if not _is_int(seed) or not _INT64_MIN <= seed <= _INT64_MAX:
            raise TypeError(f"tbegen: seed must be an int (int64), got {seed!r}")
        if not _is_int(max_segment_length_per_warp) or max_segment_length_per_warp < 1:
            raise ValueError(
                f"tbegen: max_segment_length_per_warp must be a positive int, got {max_segment_length_per_warp!r}"
            )

        if bounds_check_mode not in BOUNDS_CHECK_MODES:
            raise ValueError(
                f"tbegen: bounds_check_mode must be one of {sorted(BOUNDS_CHECK_MODES)}, got {bounds_check_mode!r}"
            )
        if not isinstance(check_finite, bool):
            raise TypeError(f"tbegen: check_finite must be a bool, got {check_finite!r}")
        placements = placement_.check_placements(placements, len(layout.tables), dense_gradient=spec.dense_gradient,
                                                 optimizer=spec.name)
        if spec.table_pairs:
            odd = [t for t, (_, D) in enumerate(layout.tables) if D % 2]
            if odd:
                raise ValueError(
                    f"tbegen: optimizer {spec.name!r} pairs column j of each row with column j + D/2 in its "
                    f"whole-table stage, so every table needs an even dim; table(s) {odd} have dims "
                    f"{[layout.tables[t][1] for t in odd]}")
        sizes = cache_.cache_sizes(layout.tables, placements, cache_rows, cache_load_factor)
        if cache_algorithm not in cache_.CACHE_ALGORITHMS:
            raise ValueError(f"tbegen: cache_algorithm must be one of {list(cache_.CACHE_ALGORITHMS)}, got {cache_algorithm!r}")
        if dtype == torch.uint8:
            # int8 rows: what is not built for them is refused here, naming what to change
            if spec.dense_gradient:
                raise NotImplementedError(
                    f"tbegen: optimizer {spec.name!r} (dense-gradient mode) cannot take int8 rows: it applies "
                    f"no update of its own, so there is no step after which to re-quantize the rows, and the "
                    f"weights are an autograd parameter whose gradient (and whatever optimizer steps it) needs "
                    f"float weights; use weights_dtype float32, float16 or bfloat16, or a fused optimizer")
        if spec.table_stages and "managed_caching" in placements:
            # (a whole-table element stage changes every row, which a cached copy would not see;
            # reduce stages only read rows: run_table_stages writes the cached rows back first)
            raise NotImplementedError(
                f"tbegen: optimizer {spec.name!r} has whole-table stages, which managed_caching tables do not "
                f"support yet (table(s) {[t for t, p in enumerate(placements) if p == 'managed_caching']}); "
                f"place them 'managed' or 'device'")

        self.spec: OptimizerSpec = spec
        self.layout: Layout = layout
        self.pooling: str = pooling
        self.weights_dtype: torch.dtype = dtype
        self.output_dtype: torch.dtype = out_dtype
        # storage dtype of each optimizer state (the spec's, or state_dtypes')
        self.state_dtypes: Dict[str, torch.dtype] = self_state_dtypes
        self.stochastic_rounding: bool = stochastic_rounding
        self.seed: int = int(seed)
        self.max_segment_length_per_warp: int = int(max_segment_length_per_warp)
        self._hyperparameters: Dict[str, Any] = hyper
        self._step: int = 0
        # the last step whose whole-table stages (the spec's `table:`) have been run (or found not
        # to run): they run once per step, before its first forward in training mode
        self._table_step: int = 0
        self._pooling_id = POOLING[pooling]
        self.placements: Tuple[str, ...] = placements

        # Builds the extension on first use of this optimizer (cached on disk by content hash).
        self._ops = _ops_for(spec)

        # The row cache of the managed_caching tables (tbegen/cache.py), or None. With one, every
        # flat buffer has a cache region after the tables: `weights` and the states are views of
        # the tables' part, self._full holds the whole buffers the kernels see.
        self._cache: Optional[cache_.RowCache] = None
        self._full: Dict[str, torch.Tensor] = {}
        # prefetched batches, oldest first: (indices, offsets, their versions, VBE sizes or None,
        # the prefetch's end as _CacheStreams.leave returned it or None, ticket); and the order of
        # the cache's uses across CUDA streams
        self._prefetched: List[Tuple[torch.Tensor, torch.Tensor, int, int, Any, Any, cache_.Ticket]] = []
        self._cache_order = _CacheStreams()
        if "managed_caching" in placements:
            self._cache = cache_.RowCache(
                layout, placements, sizes, cache_algorithm,
                element_sizes=[torch.empty(0, dtype=dtype).element_size()] + [
                    torch.empty(0, dtype=self_state_dtypes[s.name]).element_size() for s in spec.states if s.per == "element"],
                # (per row: its per-row states, and an int8 row's 8 bytes of qparams)
                row_sizes=[torch.empty(0, dtype=self_state_dtypes[s.name]).element_size() for s in spec.states if s.per == "row"]
                + ([int8_.QPARAM_BYTES] if dtype == torch.uint8 else []),
                device=dev,
                row_copy=getattr(self._ops, "_copy_rows", None),  # (CUDA builds only)
                row_exchange=getattr(self._ops, "_exchange_rows", None),
                row_exchange_states=getattr(self._ops, "_exchange_rows_with_states", None),
                key_sort=getattr(self._ops, "_sort_keys", None),
            )

        weights = self._initial_weights(dev)
        if self.dense_gradient:
            self.weights = nn.Parameter(weights)
        else:
            self.register_buffer("weights", self._tables_part("weights", weights))
        self.states = nn.Module()
        for s in spec.states:
            # (in the state's storage dtype, self.state_dtypes; int states are int64)
            state = self._allocate("state " + s.name, dev)
            state.fill_(int(s.init) if s.is_int else float(s.init))
            self.states.register_buffer(s.name, self._tables_part(s.name, state))
        # per-table states (`per: table`): one float32 per table, on the module's device for every
        # placement (small; the kernels read them), saved in state_dict as table_states.NAME
        self.table_states = nn.Module()
        for s in spec.table_states:
            self.table_states.register_buffer(
                s.name, torch.full((len(layout.tables),), float(s.init), dtype=torch.float32, device=dev))
        # the table of each feature, which indexes the per-table states (specs with some only)
        self.register_buffer("feature_table", torch.tensor(layout.feature_table_map, dtype=torch.int64, device=dev)
                             if spec.table_states else None, persistent=False)
        features = layout.features_tensor(dev)
        if self._cache is not None:
            # the kernels' feature table: a cached table's features read its cache slots
            features = self._cache.compute_features(features, layout)
        self.register_buffer("features", features, persistent=False)
        self.check_finite: bool = check_finite
        self._errors = ErrorRecord(dev, self._ops, bounds_check_mode)

    # ---- construction helpers ----

    def _buffer_ranges(self, per: str) -> List[Tuple[int, int]]:
        """(start, count) of each table in a buffer laid out per "element" (the weights and
        per-element states) or per "row" (per-row states)."""
        if per == "int8 rows":  # (bytes: D codes + 8 bytes of qparams per row)
            return [(off + int8_.QPARAM_BYTES * kb, E * (D + int8_.QPARAM_BYTES))
                    for (E, D), off, kb in zip(self.layout.tables, self.layout.table_offsets, self.layout.table_key_base)]
        if per == "element":
            return [(off, E * D) for (E, D), off in zip(self.layout.tables, self.layout.table_offsets)]
        return [(kb, E) for (E, _), kb in zip(self.layout.tables, self.layout.table_key_base)]

    def _buffer_shape(self, what: str) -> Tuple[int, torch.dtype, str]:
        """numel, dtype and layout ("element" or "row") of "weights" or "state NAME"."""
        if what == "weights" and self.int8:
            return self.layout.weights_numel + int8_.QPARAM_BYTES * self.layout.total_hash_size, torch.uint8, "int8 rows"
        if what == "weights":
            return self.layout.weights_numel, self.weights_dtype, "element"
        s = next(s for s in self.spec.states if s.name == what[len("state "):])
        n = self.layout.weights_numel if s.per == "element" else self.layout.total_hash_size
        return n, self.state_dtypes[s.name], s.per

    def _allocate(self, what: str, device: torch.device) -> torch.Tensor:
        """An uninitialised buffer for "weights" or "state NAME", in the memory the placements ask
        for; with cached tables, followed by the cache region (preferred in GPU memory)."""
        numel, dtype, per = self._buffer_shape(what)
        ranges, placements = self._buffer_ranges(per), list(self.placements)
        if self._cache is not None and per == "row" and self._row_states_on_device():
            # (the per-row states of cached tables whole in GPU memory: placement.row_states_on_device)
            placements = ["device" if p == "managed_caching" else p for p in placements]
        if self._cache is not None:
            tail = self._cache_tail(per)
            ranges.append((numel, tail))
            placements.append("device")
            numel += tail
        return placement_.allocate(self._ops, numel, dtype, device, placements, ranges)

    def _cache_tail(self, per: str) -> int:
        """Elements of the cache region after a buffer of layout `per` ("element", "row" or
        "int8 rows": the slots' codes and qparams, D + 8 bytes each)."""
        c = self._cache
        return {"element": c.weights_tail, "row": c.keys_tail,
                "int8 rows": c.weights_tail + int8_.QPARAM_BYTES * c.keys_tail}[per]

    def _row_states_on_device(self) -> bool:
        """Whether this module's per-row states of managed_caching tables are allocated whole in
        GPU memory (placement.row_states_on_device: their bytes against the cache's rows')."""
        row_bytes = sum(self.layout.tables[t][0] for t, p in enumerate(self.placements) if p == "managed_caching") * sum(
            self.state_dtypes[s.name].itemsize for s in self.spec.states if s.per == "row")
        if row_bytes == 0:
            return False
        _, dtype, per = self._buffer_shape("weights")
        return placement_.row_states_on_device(row_bytes, self._cache_tail(per) * dtype.itemsize)

    # ---- the cache region (managed_caching tables) ----

    def _tables_part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """What is registered as buffer `name` ("weights" or a state's name): `full` itself, or
        with cached tables its tables' part (the kernels get `full`, cache region and all)."""
        if self._cache is None:
            return full
        self._full[name] = full
        numel, _, _ = self._buffer_shape("weights" if name == "weights" else "state " + name)
        return full[:numel]

    def _registered(self, name: str) -> torch.Tensor:
        # (what self.weights / getattr(self.states, name) give, read from nn.Module's dictionaries
        # directly: its __getattr__ costs about a microsecond a time, several times per call)
        if name == "weights":
            w = self._buffers.get("weights")
            return w if w is not None else self._parameters["weights"]
        return self._modules["states"]._buffers[name]

    def _buffer(self, name: str) -> torch.Tensor:
        """The flat buffer the kernels read for "weights" or a state: with cached tables the whole
        buffer (the registered one is a view of its tables' part)."""
        reg = self._registered(name)
        if self._cache is None:
            return reg
        full = self._full.get(name)
        if full is None or full.device != reg.device or full.dtype != reg.dtype or full.data_ptr() != reg.data_ptr():
            self._rebuild_full()  # the registered buffers were replaced (moved, or loaded with assign=True)
            full = self._full[name]
        return full

    def _buffer_names(self) -> List[str]:
        return ["weights"] + [s.name for s in self.spec.states]

    def _rebuild_full(self) -> None:
        """Reallocates the whole buffers around the registered ones (which hold the truth: the
        cache was flushed before they were replaced) and empties the cache."""
        for name in self._buffer_names():
            reg = self._registered(name)
            full = self._full.get(name)
            if full is not None and full.device == reg.device and full.dtype == reg.dtype and full.data_ptr() == reg.data_ptr():
                continue
            what = "weights" if name == "weights" else "state " + name
            full = self._allocate(what, reg.device)
            if full.dtype == reg.dtype:
                full[: reg.numel()].copy_(reg)
            else:  # a buffer converted to another dtype: left for _check_buffers to refuse
                self._full.pop(name, None)
                continue
            view = self._tables_part(name, full)
            if name == "weights":
                self.weights = view
            else:
                setattr(self.states, name, view)
        self._cache.to(self.weights.device)
        self._prefetched.clear()

    def _cache_buffers(self) -> List[Tuple[torch.Tensor, str]]:
        """[(whole flat buffer, "element" | "row" | "int8 rows")] for the weights and every state:
        what rows move with."""
        out = [(self._buffer("weights"), "int8 rows" if self.int8 else "element")]
        out += [(self._buffer(s.name), s.per) for s in self.spec.states]
        return out

    def _bad_cached_index(self, i: int, value: int, feature: int, table: int, rows: int) -> None:
        raise RuntimeError(f"tbegen: indices[{i}] = {value} is out of range for feature {feature}, whose table "
                           f"(table {table}, placement 'managed_caching') has {rows} rows (nothing was updated)")

    def _prepare(self, indices: torch.Tensor, offsets: torch.Tensor, lookup: bool = True,
                 defer: bool = False, beside: bool = False) -> Optional[cache_.Ticket]:
        """The cache's lookup of a batch (RowCache.prepare), after the cache's latest use on every
        other stream (`lookup`: this use leaves held slots alone; a backward's second lookup is
        part of a settling use). `defer` (a prefetch): None where the batch would evict rows
        held for other batches (RowCache.prepare); it waits for the latest lookup or settling use
        on every other stream, not for the kernels of forwards that read held batches
        (_CacheStreams: the prefetch of batch i + 1 runs beside the forward of batch i).
        `beside` (a forward's own lookup, _lookup_beside): waits and moves rows as a prefetch's
        does, and is never deferred."""
        # (TBEGEN_CACHE_LOOKUP_STREAM on: RowCache._launch_aside)
        aside = (defer or beside) and self._cache._aside
        wait = "marks" if aside else "changes" if defer else True
        self._cache_order.enter(self._registered("weights").device, wait=wait, lookup=lookup)
        if self._cache.needs_int64 and indices.dtype != torch.int64:
            indices, offsets = indices.to(torch.int64), offsets.to(torch.int64)
        batch = (offsets.numel() - 1) // self.layout.num_features
        bad = self._bad_cached_index if self._errors.mode == "raise" else None
        device = self._registered("weights").device
        readers_wait = (lambda: self._cache_order.wait_all(device)) if defer or beside else None
        # (with the exchange aside, the lookup waited only for other streams' bookkeeping: moves of
        # rows, on the exchange stream or on this one, first wait for the rest, _CacheStreams.wait_rows)
        rows_wait = (lambda stream: self._cache_order.wait_rows(stream, device)) if aside else None
        with span("tbegen.cache.lookup"):
            return self._cache.prepare(indices, offsets, batch, self._cache_buffers(), bad_index_error=bad,
                                       defer=defer, readers_wait=readers_wait, rows_wait=rows_wait, aside=aside)

    def _lookup_beside(self, indices: torch.Tensor, offsets: torch.Tensor) -> cache_.Ticket:
        """A forward's own lookup with the warm on (LRU's default, TBEGEN_CACHE_PREFETCH_WARM;
        RowCache._warm) and the exchange aside (TBEGEN_CACHE_LOOKUP_STREAM on, the CUDA default):
        where its prefetch warmed the cache instead of deferring
        (RowCache._warm_part), that warm's exchange is still moving the batch's rows on the cache's
        exchange stream. A lookup that waited for every other stream (the default) would wait for
        that exchange before its sort, and the next prefetch's lookup, which waits for this
        lookup's end, with it: the exchange, this lookup and the next prefetch's in series, the
        overlap lost. So this lookup waits and moves rows as a prefetch's does (_prepare `beside`:
        for the other streams' bookkeeping only, wait="marks"; its fill's exchange on the exchange
        stream, after the warm's, with `rows_wait`; `readers_wait` where holds were let go), its
        end is marked there (`leave`: what the next prefetch's lookup waits for), and only then does
        this stream wait for every other stream's latest use, the exchange stream's rows included
        (`wait_all`): the forward's kernels run after everything the default's lookup waited for."""
        device = self._registered("weights").device
        ticket = self._prepare(indices, offsets, beside=True)
        self._order_aside_moves(device)
        self._cache_order.leave(device, lookup=True)
        self._cache_order.wait_all(device)
        return ticket

    def _order_aside_moves(self, device: torch.device) -> None:
        """The exchange the lookup just issued on the cache's exchange stream (RowCache.take_aside),
        if any, made known to the stream order (_CacheStreams.moved: what later uses wait for)."""
        moved = self._cache.take_aside()
        if moved is not None:
            self._cache_order.moved(device, *moved)

    def _take_prefetched(self, indices: torch.Tensor, offsets: torch.Tensor, sizes=None) -> Optional[cache_.Ticket]:
        """The ticket `prefetch` made for these very tensors (unchanged since) and VBE sizes
        (`sizes`: the plan's, None for a fixed batch), if its slot numbers are still valid; that
        entry and older ones are dropped. On CUDA the current stream first waits for that
        prefetch, when it ran on another stream (no host wait; not for later uses of the cache,
        which leave the batch's held slots alone: _CacheStreams), and the ticket's tensors, made
        on the prefetch's stream, are recorded as used by this one."""
        if not self._prefetched:
            return None
        for k, (i, o, iv, ov, s, point, ticket) in enumerate(self._prefetched):
            if i is indices and o is offsets and (s is sizes or s == sizes):
                del self._prefetched[: k + 1]
                same = iv == indices._version and ov == offsets._version
                if not (same and self._cache.valid(ticket)):
                    return None  # (the forward looks the batch up itself: _prepare)
                if point is not None:
                    current = self._cache_order.wait_for(point, point[0].device)
                    if current != point[0]:
                        _record_ticket(ticket, current)
                return ticket
        return None

    def _ticket_for_backward(self, ticket: cache_.Ticket) -> cache_.Ticket:
        """The batch's ticket, prepared again if rows were evicted since; its slots marked dirty;
        the tables it reads in their backing rows (overflow) hold no cached copies. (On CUDA the
        backward's stream waits for the cache's last use on another stream only where it looks
        the batch up again or drops a table: a valid ticket's slots are the batch's own, so a
        prefetch of a later batch on a side stream runs beside this backward; _CacheStreams.)"""
        valid = self._cache.valid(ticket)
        self._cache.release(ticket)
        self._cache_order.enter(ticket.slots.device, wait=True if not valid or ticket.bypass else "settling")
        if not valid:
            ticket = self._prepare(ticket.original, ticket.offsets, lookup=False)
        if ticket.bypass:  # (a prefetch since may have cached some of their rows)
            self._cache.drop(self._cache_buffers(), ticket.bypass)
        self._cache.mark_dirty(ticket.slots)
        if self._cache._aside:  # (its bookkeeping ends here: a prefetch's lookup waits for this point)
            self._cache_order.mark(ticket.slots.device)
        return ticket

    def _check_forward_stream(self, forward_stream):
        """prefetch's forward_stream: None, or a CUDA stream of the module's device."""
        if forward_stream is None:
            return None
        if not isinstance(forward_stream, torch.Stream):
            raise TypeError(f"tbegen: prefetch's forward_stream must be a torch.cuda.Stream or None, "
                            f"got {type(forward_stream).__name__}")
        device = self._registered("weights").device
        where = forward_stream.device
        if where.type != "cuda" or device.type != "cuda" or where.index != device.index:
            raise ValueError(f"tbegen: prefetch's forward_stream is a stream of {where} but the module's weights "
                             f"are on {device}")
        return forward_stream

    def prefetch(self, indices: torch.Tensor, offsets: torch.Tensor, forward_stream=None,
                 batch_size_per_feature_per_rank: Optional[Sequence[Sequence[int]]] = None) -> None:
        """Loads the rows a batch will read of the managed_caching tables into their caches now,
        ahead of `forward(indices, offsets)` with these same tensors (which then skips its own
        lookup while no row was evicted in between; FBGEMM's prefetch). Several batches may be
        prefetched ahead, in the order of their forwards. Does nothing without cached tables
        (the arguments are checked all the same). Where the batch's rows would evict rows held
        for batches forwarded or prefetched before it whose backwards have not run (a cache too
        small for two batches), the batch's forward looks it up itself (`cache_stats()["deferred"]`
        counts these). With cache_algorithm "lru" (the default) such a prefetch first loads the
        part of the batch's missing rows that fits beside the held ones (the warm: `warmed`,
        `rows_warmed`); with "lfu" (or TBEGEN_CACHE_PREFETCH_WARM=0) it changes nothing, and where
        the cache's recent deferrals predict it, it is deferred without a lookup (`deferred_early`;
        docs/placements.md).

        `batch_size_per_feature_per_rank`: a variable batch (VBE), prefetched for the forward
        given the same tensors and sizes (its offsets padded as that forward pads them).

        Streams (CUDA; docs/placements.md, "Prefetching on another stream"): the prefetch runs on
        the current stream. It first waits, on the device (no host wait), for the latest use of
        the cache on every other stream that changed it (a lookup, or the backward of the batch
        before, say), not for the kernels of a forward that read a held batch: in TorchRec's order
        the prefetch runs beside the forward of the batch before (a VBE prefetch, whose padding may
        read a plan that forward made, waits for it). The forward that takes the prefetched batch
        waits likewise for the prefetch, and the tensors it takes from it are recorded as used by
        its stream.
        `forward_stream` (FBGEMM's argument: the stream the forward will run on, or None) gets
        that record now as well."""
        self._check_buffers()
        forward_stream = self._check_forward_stream(forward_stream)
        sizes, given_offsets = None, offsets
        if batch_size_per_feature_per_rank is not None:
            if self._cache is not None:
                # (first the wait for the cache's last user on another stream, as _prepare's: a kept
                # plan may be that forward's, made on its stream, and the padding reads it)
                self._cache_order.enter(self._registered("weights").device, lookup=True)
            plan = self._vbe_plan(batch_size_per_feature_per_rank)  # (a bad size: named)
            offsets = self._vbe_pad(offsets, plan)  # (as the VBE forward pads them)
            sizes = plan["sizes"]
            if plan["device"].type == "cuda" and "ready" not in plan:
                # (a plan made here, on this stream: the forward that uses it on another stream
                # waits for this point first, _forward_vbe)
                event = torch.cuda.Event()
                event.record()
                plan["ready"] = (torch.cuda.current_stream(plan["device"]), event)
        checked_indices, checked_offsets, _ = self._check_input(indices, offsets, None)
        if self._cache is None:
            return
        with span("tbegen.prefetch"):
            ticket = self._prepare(checked_indices, checked_offsets, defer=True)
        device = self._registered("weights").device
        point = self._cache_order.leave(device, lookup=True)  # (the forward waits for it)
        if self._cache._aside:  # (TBEGEN_CACHE_LOOKUP_STREAM on: exchanges on the cache's exchange stream)
            self._order_aside_moves(device)
            latest = self._cache._aside_done
            if latest is not None and point is not None:
                # the forward waits for the exchange stream's latest kernels: this prefetch's, or,
                # where it loaded nothing, those that loaded its hits (not yet waited for by a
                # forward on another stream than the one that took the earlier batches)
                point = point + (latest[1],)
        if ticket is None:  # (deferred: the batch's rows do not fit beside those held for earlier batches)
            return
        self._cache.hold(ticket)  # (its rows stay until its backward, or until held too long)
        if forward_stream is not None and point is not None and forward_stream != point[0]:
            _record_ticket(ticket, forward_stream)
        self._prefetched.append((indices, given_offsets, indices._version, given_offsets._version, sizes, point,
                                 ticket))
        del self._prefetched[:-8]  # (prefetches never consumed by a forward are forgotten)

    @contextlib.contextmanager
    def _settling_use(self):
        """A use of the cache that may touch any slot (flush, drop, the statistics), ordered after
        the latest use on every other stream, its end recorded (_CacheStreams)."""
        device = self._registered("weights").device
        self._cache_order.enter(device)
        yield
        self._cache_order.leave(device)

    def flush(self) -> None:
        """Writes the cached rows that the backward has changed (and their states) back to their
        tables' managed memory; they stay cached. Does nothing without cached tables."""
        if self._cache is not None:
            with self._settling_use():
                self._cache.flush(self._cache_buffers())

    def drop_cache(self) -> None:
        """Empties the caches WITHOUT writing their changed rows back: for when the tables' rows
        are about to be replaced through their views (TorchRec purges before it loads a
        state_dict). Does nothing without cached tables."""
        if self._cache is not None:
            with self._settling_use():
                self._cache.invalidate()
                self._prefetched.clear()

    def _flush_and_empty(self) -> None:
        """Before the tables' memory is handed out (views, or a move): flushed, then emptied, so
        that what is written through the views is what the next batch loads."""
        self.flush()
        self.drop_cache()

    def cache_stats(self) -> Dict[str, Any]:
        """Counters of the managed_caching tables' caches since construction (or
        `reset_cache_stats`): `lookups` (indices of cached tables read), `hits` (of them, indices
        whose row was cached), `hit_rate`; `unique_rows`, `unique_hits`, `unique_hit_rate` (the
        same per batch's distinct rows); `rows_loaded`, `bytes_loaded`, `rows_written_back`,
        `bytes_written_back` (weights and states), `evictions`, `prepares` (batches looked up);
        `backing_lookups`, `backing_rows` (indices and distinct rows read and updated in managed
        memory in place, because a batch had more distinct rows of a table than its cache holds),
        `bypasses` (of those, table-batches of "compact" tables, whose cache was emptied for
        them); `deferred` (prefetches that left their batch to its forward: `prefetch`),
        `deferred_early` (of them, those deferred before their lookup: RowCache.prepare),
        `warmed` (of them, those that loaded the part of their rows that fit: the warm, LRU's
        default) and `rows_warmed` (the rows those loaded, in `rows_loaded` too);
        `resident_rows`, `dirty_rows`, `cache_rows` ({table: slots}), `direct` ({table:
        whether its slots continue its rows}, docs/placements.md) and `algorithm`. An empty dict
        without cached tables."""
        if self._cache is None:
            return {}
        with self._settling_use():
            return self._cache.report()

    def reset_cache_stats(self) -> None:
        if self._cache is not None:
            self._cache.reset_stats()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        self.flush()  # (the tables' part then holds every row; states follow, in self.states)
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # flushed first (a load that fails keeps the training so far), emptied after: the loaded
        # rows are the truth (the states, loaded next by self.states, likewise)
        self.flush()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.drop_cache()

    def _apply(self, fn, *args, **kwargs):
        # .to() / .cuda() / .cpu() move the buffers as ordinary tensors; a module with managed
        # tables that lands on a GPU moves its buffers back into managed memory (a copy each).
        if self._cache is not None:
            # only the tables' parts move: the cache is written back and emptied first, and the
            # whole buffers (cache region included) are allocated again where they land
            self._flush_and_empty()
            super()._apply(fn, *args, **kwargs)
            self._rebuild_full()
            return self
        super()._apply(fn, *args, **kwargs)
        w = self.weights
        memory = placement_.buffer_memory(self.placements, w.device)
        if memory is not None and not self.dense_gradient:
            # (a buffer converted to another dtype is left as it is, for _check_buffers to refuse)
            if w.dtype == self.weights_dtype and placement_.memory_kind(self._ops, w) != memory:
                self.weights = self._allocate("weights", w.device).copy_(w)
            for s in self.spec.states:
                buf = getattr(self.states, s.name)
                if buf.device == w.device and buf.dtype == self.state_dtypes[s.name] and placement_.memory_kind(self._ops, buf) != memory:
                    setattr(self.states, s.name, self._allocate("state " + s.name, buf.device).copy_(buf))
        return self

    def _initial_weights(self, device: torch.device) -> torch.Tensor:
        """uniform(-sqrt(1/dim), sqrt(1/dim)) per table, computed on `device` by a counter-based
        generator (tbegen/init.py): bitwise the same on every device for the same seed."""
        weights = self._allocate("weights", device)  # (with cached tables, the cache region follows)
        for t, (E, D) in enumerate(self.layout.tables):
            start = self.layout.table_offsets[t]
            if self.int8:
                # the same float32 values, quantized row by row as the kernels quantize (in chunks
                # of rows, so that a large table needs no float copy of itself)
                rows = self._int8_rows(weights, t)
                chunk = max(1, (1 << 22) // D)
                for r in range(0, E, chunk):
                    n = min(chunk, E - r)
                    w = torch.empty(n * D, dtype=torch.float32, device=device)
                    fill_uniform_(w, self.seed, t, D, first=r * D)
                    rows[r : r + n].copy_(int8_.quantize_rows(w.view(n, D)))
                continue
            fill_uniform_(weights[start : start + E * D], self.seed, t, D)
        return weights

    def _int8_rows(self, weights: torch.Tensor, t: int) -> torch.Tensor:
        """Table t's rows in a flat int8-rows buffer: a uint8 [rows, dim + 8] view."""
        E, D = self.layout.tables[t]
        row = D + int8_.QPARAM_BYTES
        start = self.layout.table_offsets[t] + int8_.QPARAM_BYTES * self.layout.table_key_base[t]
        return weights[start : start + E * row].view(E, row)

    @property
    def int8(self) -> bool:
        """Whether the tables are int8 rows (weights_dtype "int8": a uint8 buffer, docs/layout.md)."""
        return self.weights_dtype == torch.uint8

    # ---- properties ----

    @property
    def optimizer(self) -> str:
        """The optimizer's name."""
        return self.spec.name

    @property
    def dense_gradient(self) -> bool:
        """True for a spec declaring `dense_gradient: true` (optimizers/none.yaml): no fused
        update, `weights` gets a dense .grad."""
        return self.spec.dense_gradient

    @property
    def step(self) -> int:
        """Number of backward passes (updates) run so far; the next update runs with step + 1."""
        return self._step

    @property
    def hyperparameters(self) -> Dict[str, Any]:
        """A copy of the current hyperparameters, in the spec's order."""
        return dict(self._hyperparameters)

    @property
    def num_features(self) -> int:
        return self.layout.num_features

    @property
    def tables(self) -> Tuple[Tuple[int, int], ...]:
        return self.layout.tables

    # ---- hyperparameters ----

    def set_hyperparameters(self, **hyperparameters) -> None:
        """Changes hyperparameters by name (checked like the constructor's); the next backward uses them."""
        values = check_hyperparameters(self.spec, hyperparameters, complete=False)
        self._hyperparameters.update(values)

    def set_learning_rate(self, learning_rate: float) -> None:
        """Sets the hyperparameter `learning_rate` (the optimizer must have one)."""
        if "learning_rate" not in self._hyperparameters:
            raise TypeError(
                f"tbegen: optimizer {self.spec.name!r} has no learning_rate; {_describe_hyperparameters(self.spec)}"
            )
        self.set_hyperparameters(learning_rate=learning_rate)

    def get_learning_rate(self) -> float:
        if "learning_rate" not in self._hyperparameters:
            raise TypeError(f"tbegen: optimizer {self.spec.name!r} has no learning_rate")
        return self._hyperparameters["learning_rate"]

    # ---- per-table views ----

    def split_embedding_weights(self) -> List[torch.Tensor]:
        """Per table, a [rows, dim] view into the flat weights (writable; detached from autograd).
        With cached tables, the caches are written back and emptied first, so that the views hold
        every row and what is written through them is what the next batch reads."""
        self._flush_and_empty()
        w = self.weights.detach()
        if self.int8:
            # (int8 rows: a dequantized float32 copy per table; writing to it changes nothing:
            # split_int8_rows() gives the stored rows, load_table_weights() quantizes new values)
            return [int8_.dequantize_rows(self._int8_rows(w, t)) for t in range(len(self.layout.tables))]
        return [
            w[off : off + E * D].view(E, D) for (E, D), off in zip(self.layout.tables, self.layout.table_offsets)
        ]

    def split_int8_rows(self) -> List[torch.Tensor]:
        """int8 rows only: per table, a writable uint8 [rows, dim + 8] view of the stored rows (each
        row's codes, then its float32 scale and bias; tbegen.int8.dequantize_rows reads them)."""
        if not self.int8:
            raise TypeError(f"tbegen: split_int8_rows() is for int8 rows; this module's weights are {self.weights_dtype}")
        self._flush_and_empty()  # (cached tables: the views then hold every row, as split_embedding_weights)
        w = self.weights.detach()
        return [self._int8_rows(w, t) for t in range(len(self.layout.tables))]

    def load_table_weights(self, table: int, values: torch.Tensor) -> None:
        """Sets table `table`'s weights to `values` ([rows, dim], any float dtype), rounded to the
        weights dtype (int8 rows: quantized row by row as the kernels quantize). Works for every
        weights dtype; with float weights it is split_embedding_weights()[table].copy_(values)."""
        if not _is_int(table) or not 0 <= table < len(self.layout.tables):
            raise ValueError(f"tbegen: table must be from 0 to {len(self.layout.tables) - 1}, got {table!r}")
        E, D = self.layout.tables[table]
        if not isinstance(values, torch.Tensor) or tuple(values.shape) != (E, D) or not values.is_floating_point():
            raise ValueError(f"tbegen: table {table} takes a float tensor of shape [{E}, {D}], got "
                             f"{getattr(values, 'dtype', type(values).__name__)} {tuple(getattr(values, 'shape', ()))}")
        if not self.int8:
            with torch.no_grad():
                self.split_embedding_weights()[table].copy_(values)
            return
        self._flush_and_empty()
        with torch.no_grad():
            rows = self._int8_rows(self.weights.detach(), table)
            rows.copy_(int8_.quantize_rows(values.to(device=rows.device, dtype=torch.float32)))

    def split_optimizer_states(self) -> List[Dict[str, torch.Tensor]]:
        """Per table, {state name: view}: per-element states [rows, dim], per-row states [rows].
        With cached tables, written back and emptied first (as split_embedding_weights)."""
        self._flush_and_empty()
        out = []
        for t, (E, D) in enumerate(self.layout.tables):
            views = {}
            for s in self.spec.states:
                buf = getattr(self.states, s.name)
                if s.per == "element":
                    off = self.layout.table_offsets[t]
                    views[s.name] = buf[off : off + E * D].view(E, D)
                else:
                    kb = self.layout.table_key_base[t]
                    views[s.name] = buf[kb : kb + E]
            out.append(views)
        return out

    def optimizer_state(self, name: str) -> torch.Tensor:
        """The flat buffer of one optimizer state (with cached tables: written back and emptied
        first, as split_embedding_weights)."""
        if name in {s.name for s in self.spec.table_states}:
            return getattr(self.table_states, name)  # a per-table state: float32 [tables]
        if name not in {s.name for s in self.spec.states}:
            raise KeyError(f"tbegen: optimizer {self.spec.name!r} has no state {name!r}; "
                           f"its states are {[s.name for s in self.spec.states + self.spec.table_states]}")
        self._flush_and_empty()
        return getattr(self.states, name)

    # ---- state_dict: weights and states are buffers; the rest travels as extra state ----

    def get_extra_state(self) -> Dict[str, Any]:
        return {
            "optimizer": self.spec.name,
            "step": self._step,
            "table_step": self._table_step,
            "hyperparameters": dict(self._hyperparameters),
            "seed": self.seed,
            "tables": [list(t) for t in self.layout.tables],
            "feature_table_map": list(self.layout.feature_table_map),
            "pooling": self.pooling,
            "weights_dtype": str(self.weights_dtype).replace("torch.", ""),
            "state_dtypes": {k: str(v).replace("torch.", "") for k, v in self.state_dtypes.items()},
            # where the tables lived; not checked on loading (a state_dict moves between placements)
            "placements": list(self.placements),
        }

    def set_extra_state(self, state: Dict[str, Any]) -> None:
        if not isinstance(state, dict) or "step" not in state:
            raise RuntimeError("tbegen: the state_dict's _extra_state is not one written by TableBatchedEmbeddingBags")
        mine = self.get_extra_state()
        for key in ("optimizer", "tables", "feature_table_map", "pooling", "weights_dtype"):
            if key in state and state[key] != mine[key]:
                raise RuntimeError(
                    f"tbegen: cannot load a state_dict saved with {key} = {state[key]!r} into a module with "
                    f"{key} = {mine[key]!r}"
                )
        hyper = check_hyperparameters(self.spec, dict(state.get("hyperparameters", {})), complete=False)
        step = state["step"]
        if not _is_int(step) or step < 0:
            raise RuntimeError(f"tbegen: the state_dict's step counter must be a non-negative int, got {step!r}")
        # (the last step whose whole-table stages ran: at most the next one; behind the step when
        # the spec has none, or when they have not run yet for the next step)
        table_step = state.get("table_step", step)
        if not _is_int(table_step) or not 0 <= table_step <= step + 1:
            raise RuntimeError(f"tbegen: the state_dict's table_step must be an int from 0 to the step + 1 "
                               f"({step + 1}), got {table_step!r}")
        self._hyperparameters.update(hyper)
        self._step = int(step)
        self._table_step = int(table_step)
        if "seed" in state:
            self.seed = int(state["seed"])

    # ---- forward / backward ----

    @property
    def bounds_check_mode(self) -> str:
        return self._errors.mode

    def check_errors(self) -> None:
        """Waits for this module's work on its device and raises any error it recorded (bad
        indices, malformed offsets, NaN/Inf input). On the CPU errors are raised by the call itself;
        on CUDA they are raised at the latest by the module's next call, or by this."""
        self._errors.check()

    def _host_constants(self) -> "_HostConstants":
        """What every call passes the operators that never changes for this module (made at its
        first call: the spec, the layout and the cache region are fixed at construction)."""
        c = self.__dict__.get("_host_consts")
        if c is None:
            c = _HostConstants(self)
            self.__dict__["_host_consts"] = c
        return c

    def _check_buffers(self) -> None:
        w = self._registered("weights")
        if self._errors.record_device != w.device:  # (the module was moved)
            self._errors = ErrorRecord(w.device, self._ops, self._errors.mode)
        if w.dtype != self.weights_dtype:
            raise RuntimeError(
                f"tbegen: the weights are {w.dtype} but the module was built for {self.weights_dtype} "
                f"(module.half()/.to(dtype) converts buffers; choose weights_dtype at construction instead)"
            )
        for s in self.spec.table_states:
            buf = getattr(self.table_states, s.name)
            if buf.dtype != torch.float32 or buf.device != w.device:
                raise RuntimeError(f"tbegen: per-table state {s.name!r} is {buf.dtype} on {buf.device}; it must be "
                                   f"float32 on the weights' device ({w.device})")
        states = self._modules["states"]._buffers
        for name, want in self._host_constants().state_dtypes:
            have = states[name].dtype
            if have != want:
                raise RuntimeError(f"tbegen: optimizer state {name!r} is {have} but the module was built with it "
                                   f"{want} (was the module converted with .half()/.to(dtype)? choose "
                                   f"state_dtypes at construction instead)")

    def _check_input(self, indices, offsets, per_sample_weights, unpadded=False):
        # (unpadded: a VBE batch's own offsets, read through its plan's padding index, their count
        # checked against the plan's already: _vbe_prepare)
        device = self._registered("weights").device
        F = self.layout.num_features
        if (per_sample_weights is None and type(indices) is torch.Tensor and type(offsets) is torch.Tensor
                and indices.dtype is offsets.dtype and indices.dtype in INDEX_DTYPES and indices.dim() == 1
                and offsets.dim() == 1 and indices.device == device and offsets.device == device
                and offsets.numel() >= 1 and (unpadded or (offsets.numel() - 1) % F == 0)):
            # (the common call, checked in one expression: a shortcut through _check_input_fully,
            # which gives the same result for every input this accepts: tests/test_module_input.py)
            return indices.contiguous(), offsets.contiguous(), None
        return self._check_input_fully(indices, offsets, per_sample_weights, unpadded)

    def _check_input_fully(self, indices, offsets, per_sample_weights, unpadded=False):
        """The forward's input checked one property at a time (each failure named), index dtypes
        made one, every tensor contiguous."""
        device = self._registered("weights").device
        F = self.layout.num_features
        for name, t in (("indices", indices), ("offsets", offsets)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tbegen: {name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype not in INDEX_DTYPES:
                raise TypeError(f"tbegen: {name} must be int32 or int64, got {t.dtype}")
            if t.dim() != 1:
                raise ValueError(f"tbegen: {name} must be 1-D, got shape {tuple(t.shape)}")
            if t.device != device:
                raise ValueError(f"tbegen: {name} is on {t.device} but the module's weights are on {device}")
        n_off = offsets.numel()
        if n_off < 1 or (n_off - 1) % F and not unpadded:
            raise ValueError(
                f"tbegen: offsets must have F * B + 1 entries for F = {F} feature(s) and a batch of B "
                f"(feature-major: bag (f, b) is indices[offsets[f*B+b] : offsets[f*B+b+1]]), got {n_off}"
            )
        if indices.dtype != offsets.dtype:
            indices, offsets = indices.to(torch.int64), offsets.to(torch.int64)
        if per_sample_weights is not None:
            if not isinstance(per_sample_weights, torch.Tensor):
                raise TypeError(f"tbegen: per_sample_weights must be a torch.Tensor or None, got {type(per_sample_weights).__name__}")
            if per_sample_weights.dtype != torch.float32:
                raise TypeError(f"tbegen: per_sample_weights must be float32, got {per_sample_weights.dtype}")
            if per_sample_weights.dim() != 1 or per_sample_weights.numel() != indices.numel():
                raise ValueError(
                    f"tbegen: per_sample_weights must be 1-D with one weight per index ({indices.numel()}), "
                    f"got shape {tuple(per_sample_weights.shape)}"
                )
            if per_sample_weights.device != device:
                raise ValueError(f"tbegen: per_sample_weights is on {per_sample_weights.device} but the module's weights are on {device}")
            per_sample_weights = per_sample_weights.contiguous()
        return indices.contiguous(), offsets.contiguous(), per_sample_weights

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor,
                per_sample_weights: Optional[torch.Tensor] = None, *,
                batch_size_per_feature_per_rank: Optional[Sequence[Sequence[int]]] = None) -> torch.Tensor:
        """Pooled lookup of every feature: [B, total_D] (pooling sum/mean; feature f's columns start
        at layout.feature_out_offsets()[f]) or [N, dim] (pooling none), in `output_dtype`.

        `offsets` has F*B+1 entries, feature-major. When the output takes part in a backward pass,
        that backward applies the optimizer update (see docs/module.md).

        Variable batch size per feature (VBE, FBGEMM's argument): with
        `batch_size_per_feature_per_rank` (F lists of R per-rank batch sizes) the bags are ordered
        per feature, then per rank, then per sample, so `offsets` has sum of all sizes + 1 entries;
        the output (sum/mean) is 1-D and rank-major: for each rank r, for each feature f, the
        B[f][r] x D_f values of its bags (row by row). Pooling none: [N, dim] as without it.
        """
        if batch_size_per_feature_per_rank is not None:
            return self._forward_vbe(indices, offsets, per_sample_weights, batch_size_per_feature_per_rank)
        if torch.compiler.is_compiling():  # (torch.compile: opaque operators, tbegen/compiled.py)
            return compiled_.compiled_forward(self, indices, offsets, per_sample_weights)
        return self._lookup(indices, offsets, per_sample_weights)

    def _lookup(self, indices, offsets, per_sample_weights, vbe=None, given=None) -> torch.Tensor:
        """The eager forward: [B, total_D] (or [N, dim]), or with `vbe` (a VBE batch padded to a
        fixed batch, _forward_vbe: the operators' VBE arguments, (bag_out, out_numel[, pad])) the
        1-D VBE output of out_numel values. `given`: what a prefetch of this batch was given
        (indices, offsets[, VBE sizes]), default these."""
        self._check_buffers()
        self._errors.poll()
        if given is None:
            given = (indices, offsets)
        indices, offsets, per_sample_weights = self._check_input(indices, offsets, per_sample_weights,
                                                                 vbe is not None and len(vbe) == 3)
        if self.training:
            self.run_table_stages()
        ticket = None
        if self._cache is not None:
            # the batch's rows of cached tables made resident, its indices rewritten into slots
            ticket = self._take_prefetched(*given)
            if ticket is None and self._cache._aside and self._cache._warm:
                ticket = self._lookup_beside(indices, offsets)
            elif ticket is None:
                ticket = self._prepare(indices, offsets)
                # (the lookup ends here, before the kernels: a prefetch on another stream waits for
                # this point, not for the kernels, where they read a held batch; _CacheStreams)
                self._cache_order.leave(self._registered("weights").device, lookup=True)
            offsets = ticket.offsets  # (int64 where the slots' indices need it)
            if torch.is_grad_enabled():
                self._cache.hold(ticket)  # (its rows stay in their slots until its backward)
        weights = self._registered("weights")
        if self.dense_gradient:
            first = weights
        else:
            # The anchor: see _Lookup. One per module and device, made at the first call (a leaf
            # that gets no gradient, as the compiled path's _compile_anchor; one per call cost a
            # tensor allocation per step)
            first = self.__dict__.get("_anchor")
            if first is None or first.device != weights.device:
                first = torch.empty(0, device=weights.device, requires_grad=True)
                self.__dict__["_anchor"] = first
        # (whether this forward's backward will run: the first input requires grad, and grad mode is
        # on; read by _Lookup.forward's errors.after_call, where grad mode is always off)
        self._errors.forward_with_grad = first.requires_grad and torch.is_grad_enabled()
        with span("tbegen.forward"):
            out = _Lookup.apply(self, first, indices if ticket is None else ticket.indices, offsets,
                                per_sample_weights, ticket, vbe)
        if ticket is not None:  # (the forward reads only its batch's slots: a read where they are held)
            held = any(t is ticket for t in self._cache._held)
            self._cache_order.leave(weights.device, lookup=True, read=held)
        # A narrow output: the float32 sums rounded to nearest (autograd widens the gradient back).
        return out if self.output_dtype == torch.float32 else out.to(self.output_dtype)

    # ---- variable batch size per feature (VBE) ----
    #
    # The bags of a VBE batch are those of a fixed batch whose features were each cut short: feature
    # f has B_f = sum_r B[f][r] bags instead of max_B. The module pads every feature to max_B
    # with empty bags (offsets repeated: no lookups, no gradient, no update) and runs the
    # fixed-batch operators with a table of each padded bag's place in FBGEMM's rank-major 1-D
    # output (`bag_output_offsets`, -1 for a padding bag): the forward writes each bag's pooled row
    # there and the backward reads its gradient row there, so there is no padded output, no copy
    # and no scatter. The padding index and that table come from one operator call (vbe_plan: the
    # host sums the [F, R] sizes, one kernel writes the tables; a step's batch sizes usually differ
    # from the last step's) and are kept for the last distinct batch_size_per_feature_per_rank
    # lists. Under torch.compile, on a device not
    # in _VBE_DIRECT_DEVICES and for subclasses whose backward does not take the table, the padded
    # output is gathered instead (_BlocksOf, _RowsOf). See docs/module.md.

    _VBE_PLANS_KEPT = 64
    # up to this many sizes a new plan passes them to vbe_plan as an int list, beyond it its key's
    # int64 buffer (_vbe_key) as a tensor to vbe_plan_tensor (torch converts a list to int[] at ~25
    # ns an entry, the buffer's copy into a tensor costs ~0.3 us more than a short list's: the two
    # operator calls take the same time at ~16 sizes, vbe_plan_tensor 1.6 us less at 128)
    _VBE_SIZES_AS_LIST = 16
    _VBE_DIRECT_DEVICES = ("cpu", "cuda")

    def _vbe_sizes(self, bsfr) -> torch.Tensor:
        """batch_size_per_feature_per_rank as an int64 [F, R] CPU tensor, checked; a clear error
        naming the first bad entry otherwise."""
        F = self.layout.num_features
        if isinstance(bsfr, torch.Tensor):
            B = bsfr.detach().to("cpu")
            if B.dim() == 2 and B.shape[0] == F and B.shape[1] > 0 and not B.is_floating_point() \
                    and B.dtype != torch.bool and not bool((B < 0).any()):
                return B.to(torch.int64)
            bsfr = B.tolist()
        try:
            B = torch.tensor(bsfr, dtype=None)
            ok = (B.dim() == 2 and B.shape[0] == F and B.shape[1] > 0 and B.dtype in
                  (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8) and not bool((B < 0).any()))
        except (TypeError, ValueError, RuntimeError):
            ok = False
        if ok:
            return B.to(torch.int64)
        # the slow way, for the message
        if not isinstance(bsfr, (list, tuple)) or len(bsfr) != F:
            raise ValueError(
                f"tbegen: batch_size_per_feature_per_rank must be a list with one list of per-rank batch sizes "
                f"per feature ({F}), got {bsfr if not isinstance(bsfr, (list, tuple)) else f'{len(bsfr)} entries'!r}")
        R = None
        for f, per_rank in enumerate(bsfr):
            if not isinstance(per_rank, (list, tuple)) or not per_rank:
                raise ValueError(f"tbegen: batch_size_per_feature_per_rank[{f}] must be a non-empty list of "
                                 f"per-rank batch sizes, got {per_rank!r}")
            for r, b in enumerate(per_rank):
                if not _is_int(b) or b < 0:
                    raise ValueError(f"tbegen: batch_size_per_feature_per_rank[{f}][{r}] must be a non-negative "
                                     f"int, got {b!r}")
            if R is None:
                R = len(per_rank)
            elif len(per_rank) != R:
                raise ValueError(f"tbegen: batch_size_per_feature_per_rank must give every feature the same number "
                                 f"of ranks: feature 0 has {R}, feature {f} has {len(per_rank)}")
        raise ValueError(f"tbegen: batch_size_per_feature_per_rank is not F = {F} lists of R non-negative ints")

    def _vbe_plan_eager(self, batch_size_per_feature_per_rank, key: Optional[bytes] = None) -> Dict[str, Any]:
        """The VBE plan of these sizes, kept or new (_vbe_plan_and_padded without offsets)."""
        return self._vbe_plan_and_padded(batch_size_per_feature_per_rank, key)[0]

    def _vbe_plan_and_padded(self, bsfr, key: Optional[bytes] = None, offsets=None,
                             through_pad: bool = False):
        """(plan, padded offsets or None). The plan: the padding index (`pad`), the table of each padded bag's output offset (`bag_out`) and
        the totals of one batch_size_per_feature_per_rank (`bsfr`), kept for the last distinct ones. A new
        one is one operator call (vbe_plan, include/tbegen/vbe.h: the host sums the [F, R] sizes,
        one kernel on CUDA, the header its argument; nothing waits for the device). Plans are kept by
        the sizes packed as int64 bytes (_vbe_key; `key`: that of these sizes where the caller has
        it), which go to the operator as they are (copied into the module's reused int64 buffer,
        _vbe_key_buffer: no tensor made per plan); anything else, e.g. a tensor, is checked and
        converted first. The forward finds a kept plan itself and calls this for a new one
        (_forward_vbe); so do the tests. With `offsets` (the forward's, as given), the padded offsets:
        where the sizes pack into a key and the offsets are a 1-D int32/int64 tensor on the
        weights' device, a new plan's operator (vbe_plan_padded) writes offsets[pad] beside the
        plan's tables, no gather of its own; otherwise (also for offsets that do not fit the
        sizes, or a plan kept already) None, and the caller gathers or refuses them; also None with
        `through_pad` (the module's forward) where the operators read the offsets through the plan's
        padding index (_vbe_pad_route): no padded offsets are made."""
        state = self.__dict__
        weights = self._registered("weights")
        device = weights.device
        # (what a plan needs of the module, worked out once per device and _vbe_direct: _vbe_plan_needs)
        direct_of = state.get("_vbe_direct") or type(self)._vbe_direct
        needs = state.get("_vbe_needs")
        if needs is None or needs[0] != device or needs[1] is not direct_of:
            needs = self._vbe_plan_needs(device, direct_of)
        _, _, F, dims, route, direct = needs
        plans = state.get("_vbe_plans")
        if plans is None:
            plans = state["_vbe_plans"] = _VbePlans()
        if key is None:
            key = _vbe_key(bsfr, F)
        if key is not None:
            old = plans.get(key)
            if old is not None and old["device"] == device:
                return old, None
            R = len(key) // (8 * F)
            padded = sizes = None
            try:
                if (offsets is not None and not (through_pad and route) and type(offsets) is torch.Tensor
                        and offsets.ndim == 1 and offsets.dtype in INDEX_DTYPES and offsets.device == device):
                    sizes = self._vbe_key_buffer(key)
                    pad, bag_out, (total, max_B, n_out), padded = self._ops.vbe_plan_padded(sizes[1], R, dims, offsets)
                    padded = padded if padded.numel() else None  # (empty: the offsets do not fit the sizes)
                elif F * R <= self._VBE_SIZES_AS_LIST:
                    pad, bag_out, (total, max_B, n_out) = self._ops.vbe_plan(
                        memoryview(key).cast("q").tolist(), R, dims,
                        weights.detach() if weights.requires_grad else weights)
                else:  # (the key's bytes as an int64 tensor: cheaper than a long int[])
                    sizes = self._vbe_key_buffer(key)
                    pad, bag_out, (total, max_B, n_out) = self._ops.vbe_plan_tensor(
                        sizes[1], R, dims, weights.detach() if weights.requires_grad else weights)
            except RuntimeError:
                # (a negative size: the message naming it; else the operator's)
                self._vbe_sizes(bsfr)
                raise
            if sizes is not None:  # (the operator has read it: free for the next plan)
                state["_vbe_sizes_buffer"] = sizes
        else:
            padded = None
            B = self._vbe_sizes(bsfr)  # [F, R] int64 on the CPU, checked (or a message naming the entry)
            R = B.shape[1]
            key = struct.pack(f"={F * R}q", *B.reshape(-1).tolist())
            old = plans.get(key)
            if old is not None and old["device"] == device:
                return old, None
            pad, bag_out, (total, max_B, n_out) = self._ops.vbe_plan_tensor(
                B.reshape(-1).contiguous(), R, dims, weights.detach() if weights.requires_grad else weights)
        if not direct:  # (a no is asked again each time: _vbe_plan_needs keeps only a yes)
            direct = self.pooling != "none" and self._vbe_direct()
        unpadded = total == F * max_B  # (every feature has max_B bags: `pad` is 0, 1, ..., total)
        # (the direct path's operator arguments: "vbe" with the padded offsets, "vbe_pad" with the
        # VBE batch's own offsets read through `pad` where this module does that, _vbe_pad_route)
        vbe = (bag_out, n_out)
        plan = {"total_bags": total, "max_B": max_B, "pad": pad, "numel": n_out, "bag_out": bag_out,
                "sizes": key, "ranks": R, "device": device, "offsets_shape": (total + 1,), "direct": direct,
                "unpadded": unpadded, "vbe": vbe,
                "vbe_pad": (bag_out, n_out, pad) if direct and not unpadded and route else vbe}
        if old is not None:  # (a plan of the same sizes on another device: the module was moved)
            del plans[key]
        elif len(plans) >= self._VBE_PLANS_KEPT:
            del plans[next(iter(plans))]
        plans[key] = plan
        return plan, padded

    def _vbe_plan_needs(self, device, direct_of) -> tuple:
        """What a new VBE plan needs of this module on `device`: (device, direct_of, F, the features'
        widths, _vbe_pad_route's answer, whether its batches take the direct path). Kept (in
        `_vbe_needs`) while the direct path's answer is yes and asked again when the weights'
        device or _vbe_direct (a subclass's, or one set on the instance) is another: a new plan
        then reads one tuple instead of asking each (a microsecond or two of a step's host time)."""
        state = self.__dict__
        consts = state.get("_vbe_consts")
        if consts is None:  # (the features' count and widths: the layout is fixed at construction)
            layout = self.layout
            consts = state["_vbe_consts"] = (
                layout.num_features, [layout.tables[t][1] for t in layout.feature_table_map])
        direct = self.pooling != "none" and self._vbe_direct()
        needs = (device, direct_of, consts[0], consts[1], self._vbe_pad_route(device), direct)
        state["_vbe_needs"] = needs if direct else None
        return needs

    def _vbe_key_buffer(self, key: bytes) -> tuple:
        """The sizes of `key` (_vbe_key's int64 bytes) where vbe_plan_tensor and vbe_plan_padded read
        them, (a bytearray, a 1-D int64 CPU tensor on its memory): the module's buffer of that length
        with the key copied into it, so that no tensor is made per plan (a tensor made in a step
        costs ~4 us of its host time on this CPU, beyond its own ~1 us: NOTES-gpu.md, "VBE: the new
        plan's host work"). Taken out of the module (the caller gives it back once the operator has
        returned: the operators read the sizes on the host during the call and keep nothing of
        them; CUDA computes its header from them before the launch), so that a call beside it
        (another thread) makes its own rather than overwrite it. Never resized (the tensor holds its
        address): a key of another length gets a new one."""
        buf = self.__dict__.pop("_vbe_sizes_buffer", None)
        if buf is None or len(buf[0]) != len(key):
            data = bytearray(key)
            return data, torch.frombuffer(data, dtype=torch.int64)
        buf[0][:] = key  # (the same length: a copy into the buffer, never a resize)
        return buf

    # (under torch.compile: a graph break, the plan built eagerly)
    _vbe_plan = torch.compiler.disable(_vbe_plan_eager)

    def _vbe_gather(self, plan: Dict[str, Any]):
        """For the gathered fallback (see above): the output's blocks of the padded output on the
        CPU, its per-value gather index on CUDA; made once per plan, when first needed."""
        if "gather" in plan:
            return plan["gather"]
        B = torch.frombuffer(bytearray(plan["sizes"]), dtype=torch.int64).view(-1, plan["ranks"])  # [F, R]
        F, R = B.shape
        device = self.weights.device
        dims_host = torch.tensor(self.__dict__["_vbe_consts"][1], dtype=torch.int64)  # (set by the plan's maker)
        if device.type == "cpu":
            # the output's blocks, rank-major: (first padded row, rows, first column, columns)
            col_h = (torch.cumsum(dims_host, 0) - dims_host).tolist()
            prefix_h = (torch.cumsum(B, 1) - B).tolist()
            B_h, dims_l = B.tolist(), dims_host.tolist()
            plan["gather"] = [(prefix_h[f][r], B_h[f][r], col_h[f], dims_l[f])
                              for r in range(R) for f in range(F) if B_h[f][r] > 0]
            return plan["gather"]
        # every output value's place in the padded output, built on the device
        n_out = plan["numel"]
        both = torch.cat([B.reshape(-1), dims_host]).pin_memory().to(device, non_blocking=True)
        Bd, dims = both[: F * R].view(F, R), both[F * R:]
        col = torch.cumsum(dims, 0) - dims
        prefix = torch.cumsum(Bd, 1) - Bd  # [F, R]
        seg_size = (Bd * dims[:, None]).t().reshape(-1)  # [R * F], rank-major
        seg_first = torch.cumsum(seg_size, 0) - seg_size
        seg_base = (prefix * self.layout.total_D + col[:, None]).t().reshape(-1)
        seg_D = dims.repeat(R)
        seg = torch.repeat_interleave(torch.arange(R * F, device=device), seg_size, output_size=n_out)
        k = torch.arange(n_out, dtype=torch.int64, device=device) - seg_first[seg]
        D_of = seg_D[seg]
        plan["gather"] = seg_base[seg] + torch.div(k, D_of, rounding_mode="floor") * self.layout.total_D + k % D_of
        return plan["gather"]

    def vbe_padded_offsets(self, offsets: torch.Tensor, batch_size_per_feature_per_rank) -> torch.Tensor:
        """The offsets of a VBE batch (per feature, per rank, per sample) as those of the fixed
        batch F x max_B in which every feature's missing bags are empty (feature-major)."""
        plan = self._vbe_plan(batch_size_per_feature_per_rank)
        if "ready" in plan:
            self._vbe_plan_ready(plan)
        return self._vbe_pad(offsets, plan)

    @staticmethod
    def _vbe_plan_ready(plan: Dict[str, Any]) -> None:
        """A plan that a prefetch made on its stream (prefetch records plan["ready"]): the current
        stream, if another, waits for that point before it reads the plan (no host wait), and the
        plan's tensors are recorded as used by it (the caching allocator then does not hand their
        memory out, once the plan is dropped, while this stream's kernels may still read them)."""
        stream, event = plan["ready"]
        current = torch.cuda.current_stream(stream.device)
        if current != stream:
            current.wait_event(event)
            for key in ("pad", "bag_out"):
                if plan.get(key) is not None:
                    plan[key].record_stream(current)

    @staticmethod
    def _vbe_pad(offsets: torch.Tensor, plan: Dict[str, Any]) -> torch.Tensor:
        """vbe_padded_offsets with the plan at hand: the offsets checked against it, gathered."""
        if not isinstance(offsets, torch.Tensor):
            raise TypeError(f"tbegen: offsets must be a torch.Tensor, got {type(offsets).__name__}")
        pad = plan["pad"]
        if offsets.dim() != 1 or offsets.numel() != plan["total_bags"] + 1:
            raise ValueError(
                f"tbegen: with batch_size_per_feature_per_rank, offsets must be 1-D with (sum of all batch sizes) + 1 "
                f"= {plan['total_bags'] + 1} entries (bags per feature, then per rank, then per sample), got "
                f"shape {tuple(offsets.shape)}")
        if offsets.device != pad.device:
            raise ValueError(f"tbegen: offsets is on {offsets.device} but the module's weights are on {pad.device}")
        return offsets.index_select(0, pad)

    def _vbe_direct(self) -> bool:
        """Whether this module's VBE batches take the direct path (the operators write and read the
        1-D output through bag_output_offsets): eagerly, on the devices of _VBE_DIRECT_DEVICES,
        when its _run_backward (a subclass may override it) takes the table."""
        if self._registered("weights").device.type not in self._VBE_DIRECT_DEVICES or torch.compiler.is_compiling():
            return False
        cls = type(self)
        ok = cls.__dict__.get("_vbe_direct_backward")
        if ok is None:
            params = inspect.signature(cls._run_backward).parameters  # (a mapping by name)
            ok = "bag_output_offsets" in params or any(
                p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
            setattr(cls, "_vbe_direct_backward", ok)
        return ok

    def _vbe_pad_route(self, device) -> bool:
        """Whether this module's direct VBE batches hand the operators their own offsets and the
        plan's padding index (bag_pad: the kernels read padded bag b's bounds at offsets[pad[b]]
        and offsets[pad[b + 1]]) instead of the padded offsets gathered first (offsets.index_select:
        an operator, an allocation and on CUDA a launch per step; a new plan's vbe_plan_padded, its
        allocation). On the CPU always (the operators read through it into a buffer of their own);
        on CUDA with TBEGEN_VBE_PAD_IN_KERNELS=1 (opt-in until a GPU has run it; read once per module
        and device, at its first VBE plan there). Never with cached tables (their tickets rewrite the
        offsets) nor where _run_backward (a subclass's) does not take bag_pad."""
        state = self.__dict__
        known = state.get("_vbe_pad_known")
        if known is not None and known[0] == device:
            return known[1]
        cls = type(self)
        takes = cls.__dict__.get("_vbe_pad_backward")
        if takes is None:
            params = inspect.signature(cls._run_backward).parameters  # (a mapping by name)
            takes = "bag_pad" in params or any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
            setattr(cls, "_vbe_pad_backward", takes)
        ok = takes and self._cache is None and (
            device.type == "cpu" or (device.type == "cuda" and env_flag("TBEGEN_VBE_PAD_IN_KERNELS", False)))
        state["_vbe_pad_known"] = (device, ok)
        return ok

    def _vbe_prepare(self, offsets, bsfr, through_pad=False, key=None, plan=None, padded=None):
        """(plan, padded offsets) of a VBE batch: its kept plan, found with as little as can be
        (the host time of a VBE call beside the padded call's; benchmarks/host_overhead_cpu.py
        --vbe): the sizes packed into their key (_vbe_key: one pass in C, which refuses what is not
        F lists of R integers: a float equal to a kept size goes the checked way) and one
        dictionary lookup, then the offsets' gather; or a new plan, which gets the key (the sizes
        are read once) and makes the padded offsets in its own operator call (vbe_plan_padded: no
        gather, its launch and its allocation). (The module's own forward makes a new plan itself
        for sizes that pack into a key, _forward_vbe: TorchRec's case, new sizes every step; this
        is its way for the rest, and the FBGEMM class's.) Anything else takes the checked way (a
        clear error for bad sizes or offsets). With `through_pad`
        (the module's own forward) and a plan whose "vbe_pad" arguments carry the padding index
        (_vbe_pad_route), `offsets` themselves, unpadded: the caller tells them apart by identity.
        `key`: these sizes' key where the caller made it and looked it up already (_forward_vbe's
        kept-plan way), `plan` what it found or made (None: none kept), `padded` the offsets the
        new plan's operator padded with it (None: none)."""
        state = self.__dict__
        consts, plans = state.get("_vbe_consts"), state.get("_vbe_plans")
        if key is None and consts is not None and plans is not None:
            key = _vbe_key(bsfr, consts[0])
            if key is not None:
                plan = getattr(plans, "last", None)
                if plan is None or plan["sizes"] != key:
                    plan = plans.get(key)
        if plan is None:
            # (read through the padding index, through_pad: a new plan makes no padded offsets)
            plan, padded = self._vbe_plan_and_padded(bsfr, key, offsets, through_pad)
        if "ready" in plan:  # (a plan a prefetch made on its stream)
            self._vbe_plan_ready(plan)
        if padded is None:
            if (type(offsets) is torch.Tensor and offsets.shape == plan["offsets_shape"]
                    and offsets.device == plan["device"]):
                padded = offsets if plan["unpadded"] or (through_pad and plan["vbe_pad"] is not plan["vbe"]) \
                    else offsets.index_select(0, plan["pad"])
            else:  # (a kept plan of another device, or offsets that do not fit: the checked way)
                plan = self._vbe_plan_eager(bsfr)
                padded = self._vbe_pad(offsets, plan)
        plans = state.get("_vbe_plans")
        if type(plans) is _VbePlans:
            plans.last = plan  # (the next forward's first guess)
        return plan, padded

    def _call_with_vbe_plan(self, prepared, indices, offsets, per_sample_weights, batch_size_per_feature_per_rank):
        """This module's call (its hooks and all) for a VBE batch whose plan and padded offsets the
        caller found already (`prepared`: _vbe_prepare's pair for these very `offsets` and sizes
        objects; the FBGEMM class's bounds check): _forward_vbe takes them instead of looking
        them up and gathering again. Handed for this one call only, never left behind."""
        state = self.__dict__
        state["_vbe_handed"] = (offsets, batch_size_per_feature_per_rank, prepared)
        try:
            return self(indices, offsets, per_sample_weights,
                        batch_size_per_feature_per_rank=batch_size_per_feature_per_rank)
        finally:
            state["_vbe_handed"] = None

    def _forward_vbe(self, indices, offsets, per_sample_weights, batch_size_per_feature_per_rank) -> torch.Tensor:
        # The common ways, in as few steps as can be (the host time of a VBE step beside the padded
        # step's, issue 25): the sizes' key (_vbe_key), the last plan's or the kept plans' lookup,
        # or for new sizes (TorchRec's case: every step) the new plan made straight away
        # (_vbe_plan_and_padded, which pads the offsets in its operator where they go to the
        # operators padded); then for offsets that fit it straight to _lookup, with the plan's
        # padding index where the operators read through it ("vbe_pad", _vbe_pad_route), else the
        # offsets padded (by the new plan's operator, or gathered for a kept plan). Anything else
        # (a prefetched plan, a plan handed by the FBGEMM class, torch.compile, sizes that are not
        # F lists of R ints, offsets that do not fit, the gathered fallback) takes _vbe_prepare below.
        state = self.__dict__
        plans = state.get("_vbe_plans")
        key = plan = padded = None
        if type(plans) is _VbePlans and state.get("_vbe_handed") is None and not torch.compiler.is_compiling():
            key = _vbe_key(batch_size_per_feature_per_rank, state["_vbe_consts"][0])
            plan = plans.last
            if plan is None or plan["sizes"] != key:
                plan = None if key is None else plans.get(key)
                if plan is None and key is not None:  # (new sizes: a new plan)
                    plan, padded = self._vbe_plan_and_padded(batch_size_per_feature_per_rank, key, offsets, True)
            if (plan is not None and plan["direct"] and "ready" not in plan and type(offsets) is torch.Tensor
                    and offsets.shape == plan["offsets_shape"] and offsets.device == plan["device"]):
                plans.last = plan
                vbe = plan["vbe_pad"]
                if padded is None and vbe is plan["vbe"] and not plan["unpadded"]:
                    padded = offsets.index_select(0, plan["pad"])  # (a kept plan, the operators given padded offsets)
                return self._lookup(indices, offsets if padded is None else padded, per_sample_weights, vbe,
                                    given=(indices, offsets, key))
        if torch.compiler.is_compiling():
            return self._forward_vbe_traced(indices, offsets, per_sample_weights, batch_size_per_feature_per_rank)
        handed = self.__dict__.get("_vbe_handed")
        if handed is not None and handed[0] is offsets and handed[1] is batch_size_per_feature_per_rank:
            # (what the FBGEMM class's forward found for these very objects just before this call,
            # for its own checks of the padded batch: _call_with_vbe_plan; not looked up again)
            plan, padded = handed[2]
        else:
            plan, padded = self._vbe_prepare(offsets, batch_size_per_feature_per_rank, True, key, plan, padded)
        given = (indices, offsets, plan["sizes"])  # (what a prefetch of this batch was given)
        if plan["direct"]:
            # (the offsets themselves: read through the plan's padding index, "vbe_pad"; else padded)
            return self._lookup(indices, padded, per_sample_weights, plan["vbe_pad"] if padded is offsets else plan["vbe"],
                                given=given)
        out = self._lookup(indices, padded, per_sample_weights, given=given)
        if self.pooling == "none":  # (one row per index: the bags' batch does not shape it)
            return out
        return self._vbe_gathered(out, plan)

    def _forward_vbe_traced(self, indices, offsets, per_sample_weights, batch_size_per_feature_per_rank):
        """_forward_vbe under torch.compile: the plan built eagerly (a graph break), the padded
        batch through the compiled forward, its output gathered."""
        plan = self._vbe_plan(batch_size_per_feature_per_rank)
        padded = self._vbe_pad(offsets, plan)
        out = self.forward(indices, padded, per_sample_weights)
        if self.pooling == "none":
            return out
        return self._vbe_gathered(out, plan)

    def _vbe_gathered(self, out: torch.Tensor, plan: Dict[str, Any]) -> torch.Tensor:
        """The 1-D VBE output gathered from the padded batch's output (the fallback; see above)."""
        gather = self._vbe_gather(plan)
        if isinstance(gather, list):
            return _BlocksOf.apply(out, gather, plan["numel"])
        return _RowsOf.apply(out, gather)

    def _compile_init(self) -> None:
        # torch.compile's handle and zero-size CPU anchor (tbegen/compiled.py); made anew for a
        # copy or an unpickled module (__setstate__), so that its handle names it, not the original
        self._compile_handle = compiled_.register(self, _Lookup)
        self._compile_anchor = torch.empty(0, requires_grad=True)

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self._compile_init()
        if "_cache_order" not in self.__dict__:  # (pickled before it existed)
            self._cache_order = _CacheStreams()

    def run_table_stages(self) -> bool:
        """Runs the spec's whole-table stages (`table:`) for the next step, step + 1, over every row
        of every table, if they have not run for it yet; returns whether a stage's guard held.

        `forward` calls this in training mode, so the stages of a step run once, before its first
        forward (FBGEMM's module runs its whole-table operations there too); a later forward of
        the same step (say, an evaluation pass) does not run them again. Optimizers without
        whole-table stages: nothing to do (False)."""
        if not (self.spec.table_stages or self.spec.table_reductions) or self._table_step > self._step:
            return False
        self._check_buffers()
        step = self._step + 1
        states = [getattr(self.states, s.name) for s in self.spec.states]
        hyper = [self._hyperparameters[h.name] for h in self.spec.hyperparameters]
        features = self.features
        if self._cache is not None:
            # (only reduce stages get here: they read the per-row states of every row, so the rows
            # the backward changed in the caches are written back first (they stay cached), and
            # the stages walk the tables themselves, not their cache slots)
            self.flush()
            features = self._cache.table_features()
        with torch.no_grad():
            ran = bool(self._ops.table_update(
                self.weights.detach(), features, self.layout.total_hash_size, self.stochastic_rounding,
                self.seed, *states, *self._table_state_args(), *hyper, step))
        self._table_step = step
        if ran:
            # written in place without autograd knowing, like the backward's update
            increment_version([self.weights, *states, *self._table_state_buffers()])
        return ran

    def _table_state_buffers(self) -> list:
        """Each per-table state's buffer, in spec order."""
        return [getattr(self.table_states, s.name) for s in self.spec.table_states]

    def _table_state_args(self) -> list:
        """The operators' per-table arguments: each per-table state, then the table of each feature
        (nothing for specs without per-table states)."""
        if not self.spec.table_states:
            return []
        return self._table_state_buffers() + [self.feature_table]

    def _run_backward(self, grad_output, weights, indices, offsets, per_sample_weights, features=None,
                      bag_output_offsets=None, bag_pad=None) -> None:
        c = self._host_constants()
        errors = self._errors
        # (asked once per call: the capture check and the error record's copy both need it)
        capturing = weights.is_cuda and torch.cuda.is_current_stream_capturing()
        check_capturable(self, capturing)  # (CUDA graph capture: refused where a replay would differ)
        step = self._step + 1
        if self._cache is None:
            buffers = self._modules["states"]._buffers
            states = [buffers[name] for name in c.state_names]
        else:
            states = [self._buffer(name) for name in c.state_names]
        hyperparameters = self._hyperparameters
        hyper = [hyperparameters[name] for name in c.hyper_names]
        layout = self.layout
        with span("tbegen.backward"):
            self._ops.backward(
                grad_output, weights, self._buffers["features"] if features is None else features, layout.total_D,
                layout.max_D, c.total_keys, indices, offsets, per_sample_weights, self._pooling_id,
                self.max_segment_length_per_warp,
                # the dense gradient of mode "none" is rounded to nearest
                self.stochastic_rounding and not c.dense_gradient,
                self.seed, *states, *(self._table_state_args() if c.table_states else ()), *hyper, step,
                errors.record, errors.skip_bad_indices, self.check_finite,
                *(() if bag_output_offsets is None else
                  (bag_output_offsets,) if bag_pad is None else (bag_output_offsets, bag_pad)),
            )
        errors.after_call(capturing)
        # The operators write in place without telling autograd; record it, so that a graph that
        # saved these tensors (e.g. a custom regulariser) notices they changed.
        increment_version([weights, *states])
        self.__dict__["_step"] = step  # (a plain attribute: nn.Module.__setattr__'s checks skipped)

    def extra_repr(self) -> str:
        hyper = ", ".join(f"{k}={v!r}" for k, v in self._hyperparameters.items())
        ftm = "" if self.layout.feature_table_map == tuple(range(len(self.layout.tables))) else (
            f", feature_table_map={list(self.layout.feature_table_map)}"
        )
        return (
            f"tables={[tuple(t) for t in self.layout.tables]}{ftm}, optimizer={self.spec.name!r}, "
            f"pooling={self.pooling!r}, weights_dtype={self.weights_dtype}, device={self.weights.device}"
            + ("" if self.output_dtype == torch.float32 else f", output_dtype={self.output_dtype}")
            + (f", {hyper}" if hyper else "")
            + ("" if set(self.placements) == {"device"} else f", placements={list(self.placements)}")
            + ("" if self._cache is None else
               f", cache_rows={list(self._cache.slots)}, cache_algorithm={self._cache.algorithm!r}")
            + f", step={self._step}"
        )
