"""The module's lookup as opaque custom operators, for `torch.compile`.

Under `torch.compile` (every mode: default, "reduce-overhead", fullgraph=True) the module's
forward does not trace its eager path (which polls the error record, keeps the cache's tickets
and counts steps in Python, none of which dynamo can put in a graph). It checks its input in the
traced code and then calls `tbegen_compile::lookup`, whose backward (registered with
`torch.library.register_autograd`) calls `tbegen_compile::lookup_backward`. Both are custom
operators with fake (shape-only) implementations, so the compiler puts them in its graph as calls
it does not look into; when the graph runs, they run the module's eager forward and backward
bodies (the same code as without compile: the same bits), error polling included, so a bad index
raises under compile exactly as it does eagerly. A module with a cache first calls
`tbegen_compile::new_call` (in grad mode), whose number names the cache ticket the forward keeps
for its backward.

What the operators cannot take is the module itself: they take an integer handle that names it
in a registry of weak references (`register`, called by the module's constructor and again when
a module is copied or unpickled, so that a copy gets a handle of its own).

The operators are registered as having ordered side effects (`torch.library._register_effectful_op`,
which PyTorch names for "an op that has side effects that is not capturable by the schema"): the
compiler threads an effect token through them, so it neither drops a call whose output looks
unused (the backward's result is an empty tensor when no gradient is asked of it), nor merges two
identical calls (a model that calls the module twice on the same batch gets two lookups and two
updates, as in eager), nor reorders them.

mode="reduce-overhead" must not record them into a CUDA graph (a replay would repeat the recorded
step's update without the host work around it). They carry the `cudagraph_unsafe` tag, but inductor
does not see it through the effects wrapper, so they are also named in inductor's
`custom_should_partition_ops` (PARTITION_OPS, set at import): its graph partitions put them outside
every CUDA graph. And each returns one tensor: the outputs of an operator outside the CUDA graphs
reach the next partition as they are, and a tuple of several (with a getter per element placed in a
CUDA-graph partition) is what cudagraph trees refused on the H200 (benchmarks/NOTES-gpu.md,
"reduce-overhead on CUDA: what the code says").
"""

from __future__ import annotations

import itertools
import types
import weakref
from typing import Any, Dict, Optional, Tuple

import torch

# handle -> (weak reference to the module, its autograd Function whose bodies the operators run)
_MODULES: Dict[int, Tuple["weakref.ReferenceType[Any]", Any]] = {}
_next_handle = itertools.count(1)

# (handle, call) -> the cache ticket a compiled forward made, for its backward
_TICKETS: Dict[Tuple[int, int], Any] = {}
_next_call = itertools.count(1)


def register(module: Any, function: Any) -> int:
    """A fresh handle for `module`, whose eager lookup is the autograd Function `function`
    (tbegen.module._Lookup: passed in, as this file must not import tbegen.module). The entry is
    dropped when the module is collected."""
    handle = next(_next_handle)
    _MODULES[handle] = (weakref.ref(module, lambda _ref, h=handle: _MODULES.pop(h, None)), function)
    return handle


def _module(handle: int) -> Tuple[Any, Any]:
    ref, function = _MODULES.get(handle, (None, None))
    module = ref() if ref is not None else None
    if module is None:
        raise RuntimeError(f"tbegen: no live TableBatchedEmbeddingBags has compile handle {handle} "
                           f"(the compiled graph outlived its module)")
    return module, function


_TAGS = (torch.Tag.cudagraph_unsafe,)

# The operators inductor must keep out of CUDA graphs (mode="reduce-overhead"), by name. The
# cudagraph_unsafe tag alone does not do it for these operators: an operator with registered
# effects reaches inductor wrapped in the with_effects higher-order operator, and inductor looks
# for the tag on the FX node's target, which is then with_effects, not the operator (torch 2.11
# and 2.13: torch/_inductor/utils.py, is_cudagraph_unsafe_fx_node). Its graph partitioner also
# splits on the operator names in `config.custom_should_partition_ops`, which it reads from the
# lowered kernel's own operator (scheduler.should_partition), effects or not.
PARTITION_OPS = ("tbegen_compile::lookup", "tbegen_compile::lookup_backward", "tbegen_compile::new_call")


def partition_around_operators() -> bool:
    """Adds PARTITION_OPS to torch._inductor.config.custom_should_partition_ops (kept: the names
    already there; done at import). False where this torch has no such setting."""
    import torch._inductor.config as inductor_config

    names = getattr(inductor_config, "custom_should_partition_ops", None)
    if names is None:
        return False
    missing = [n for n in PARTITION_OPS if n not in names]
    if missing:
        inductor_config.custom_should_partition_ops = [*names, *missing]
    return True


# Each operator returns ONE tensor. A graph partition that is not a CUDA graph (these operators',
# and any on the CPU) hands its outputs to the next partition; for an operator of several outputs
# that is the output tuple itself, read by the getter nodes of its elements, which inductor places
# by their own device: a CUDA element's getter lands in a CUDA-graph partition, which then takes
# the tuple as an input it cannot track or copy ("storage data ptrs are not allocated in pool"
# when the element is returned, "assert isinstance(inp, (int, torch.Generator))" when it is
# recorded). One tensor per operator is passed as itself.


@torch.library.custom_op("tbegen_compile::new_call", mutates_args=(), tags=_TAGS)
def new_call(handle: int) -> torch.Tensor:
    """A fresh call number (int64 scalar on the CPU): names the cache ticket a compiled forward
    keeps for its backward (only traced for modules with a cache, under grad mode)."""
    return torch.tensor(next(_next_call), dtype=torch.int64)


@new_call.register_fake
def _(handle):
    return torch.empty((), dtype=torch.int64, device="cpu")


@torch.library.custom_op("tbegen_compile::lookup", mutates_args=(), tags=_TAGS)
def lookup(first: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor,
           per_sample_weights: Optional[torch.Tensor], call: Optional[torch.Tensor], handle: int, out_rows: int,
           out_width: int) -> torch.Tensor:
    """The module's eager forward body: returns the float32 lookup. With `call` (new_call's
    number), a cache ticket is kept under it for the backward."""
    module, _Lookup = _module(handle)
    module._check_buffers()
    module._errors.poll()
    if module.training:
        module.run_table_stages()
    ticket = None
    if module._cache is not None:
        ticket = module._take_prefetched(indices, offsets) or module._prepare(indices, offsets)
        offsets = ticket.offsets
        if call is not None:
            module._cache.hold(ticket)
    ctx = types.SimpleNamespace(save_for_backward=lambda *t: None)
    out = _Lookup.forward(ctx, module, first, indices if ticket is None else ticket.indices, offsets,
                          per_sample_weights, ticket)
    if tuple(out.shape) != (out_rows, out_width):  # (the fake implementation's shape must hold)
        raise RuntimeError(f"tbegen: compiled lookup produced shape {tuple(out.shape)}, expected "
                           f"{(out_rows, out_width)}")
    if ticket is not None and call is not None:
        _TICKETS[(handle, int(call))] = ticket
    return out


@lookup.register_fake
def _(first, indices, offsets, per_sample_weights, call, handle, out_rows, out_width):
    return indices.new_empty((out_rows, out_width), dtype=torch.float32)


@torch.library.custom_op("tbegen_compile::lookup_backward", mutates_args=(), tags=_TAGS)
def lookup_backward(grad_output: torch.Tensor, call: Optional[torch.Tensor], first: torch.Tensor,
                    indices: torch.Tensor, offsets: torch.Tensor, per_sample_weights: Optional[torch.Tensor],
                    handle: int, need_first: bool, need_psw: bool) -> torch.Tensor:
    """The module's eager backward body (the fused update, or the dense weight gradient; the
    per-sample-weight gradient). Returns what is needed, as one tensor: the gradient of `first`
    (need_first: the dense mode's weights), of the per-sample weights (need_psw, float32), both
    (one float32 vector: the first's values, then the per-sample weights'), or neither (an empty
    float32 tensor)."""
    module, _Lookup = _module(handle)
    ticket = None
    if call is not None:
        ticket = _TICKETS.pop((handle, int(call)), None)
        if ticket is None:
            raise RuntimeError("tbegen: a second backward through one compiled lookup of cached tables "
                               "(retain_graph=True) is not supported under torch.compile")
    ctx = types.SimpleNamespace(
        module=module, ticket=ticket, saved_tensors=(indices, offsets, per_sample_weights),
        needs_input_grad=(False, need_first, False, False, need_psw, False),
    )
    grads = _Lookup.backward(ctx, grad_output)
    grad_first = None
    if need_first:
        grad_first = grads[1] if grads[1] is not None else torch.zeros_like(first, memory_format=torch.contiguous_format)
    grad_psw = None
    if need_psw:
        grad_psw = grads[4] if grads[4] is not None else grad_output.new_zeros((per_sample_weights.shape[0],),
                                                                               dtype=torch.float32)
    if grad_first is not None and grad_psw is not None:
        return torch.cat([grad_first.reshape(-1).to(torch.float32), grad_psw.to(torch.float32)])
    if grad_first is not None:
        return grad_first
    if grad_psw is not None:
        return grad_psw.to(torch.float32)
    return grad_output.new_empty((0,), dtype=torch.float32)


@lookup_backward.register_fake
def _(grad_output, call, first, indices, offsets, per_sample_weights, handle, need_first, need_psw):
    n_psw = per_sample_weights.shape[0] if need_psw else 0
    if need_first and need_psw:
        return grad_output.new_empty((first.numel() + n_psw,), dtype=torch.float32)
    if need_first:
        return first.new_empty(first.shape)
    return grad_output.new_empty((n_psw,), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    first, indices, offsets, per_sample_weights, call, handle, _rows, _width = inputs
    ctx.handle = handle
    ctx.has_psw = per_sample_weights is not None
    ctx.has_call = call is not None
    ctx.dense = bool(_module(handle)[0].dense_gradient)
    ctx.first_shape, ctx.first_dtype = first.shape, first.dtype
    ctx.save_for_backward(first, indices, offsets, *((call,) if call is not None else ()),
                          *((per_sample_weights,) if per_sample_weights is not None else ()))


def _backward(ctx, grad_out):
    first, indices, offsets, *rest = ctx.saved_tensors
    call = rest.pop(0) if ctx.has_call else None
    psw = rest[0] if ctx.has_psw else None
    # (the fused optimizers' first input is the zero-size anchor: it gets no gradient)
    need_first = ctx.dense and ctx.needs_input_grad[0]
    need_psw = ctx.has_psw and ctx.needs_input_grad[3]
    grads = lookup_backward(grad_out, call, first, indices, offsets, psw, ctx.handle, need_first, need_psw)
    grad_first = grad_psw = None
    if need_first and need_psw:
        n = first.numel()
        grad_first = grads[:n].view(ctx.first_shape).to(ctx.first_dtype)
        grad_psw = grads[n:]
    elif need_first:
        grad_first = grads
    elif need_psw:
        grad_psw = grads
    return grad_first, None, None, grad_psw, None, None, None, None


lookup.register_autograd(_backward, setup_context=_setup_context)
# The operators act on the module's state beyond their schema (the update, the error record, the
# step count, the cache, the call numbers): ordered effects, so that the compiler neither drops,
# merges nor reorders them (an effect token is threaded through the graph).
for _name in ("tbegen_compile::new_call", "tbegen_compile::lookup", "tbegen_compile::lookup_backward"):
    torch.library._register_effectful_op(_name, torch._library.effects.EffectType.ORDERED)
partition_around_operators()


def compiled_forward(module: Any, indices: torch.Tensor, offsets: torch.Tensor,
                     per_sample_weights: Optional[torch.Tensor]) -> torch.Tensor:
    """TableBatchedEmbeddingBags.forward while dynamo traces it (torch.compiler.is_compiling())."""
    indices, offsets, per_sample_weights = module._check_input(indices, offsets, per_sample_weights)
    if module.pooling == "none":
        rows, width = indices.shape[0], module.layout.max_D
    else:
        rows, width = (offsets.shape[0] - 1) // module.layout.num_features, module.layout.total_D
    first = module.weights if module.dense_gradient else module._compile_anchor
    # (a cache ticket is kept for the backward under a call number: only with a cache, in grad mode)
    call = new_call(module._compile_handle) if module._cache is not None and torch.is_grad_enabled() else None
    out = lookup(first, indices, offsets, per_sample_weights, call, module._compile_handle, rows, width)
    return out if module.output_dtype == torch.float32 else out.to(module.output_dtype)
