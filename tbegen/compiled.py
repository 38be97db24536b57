"""The module's lookup as two opaque custom operators, for `torch.compile`.

Under `torch.compile` (every mode: default, "reduce-overhead", fullgraph=True) the module's
forward does not trace its eager path (which polls the error record, keeps the cache's tickets
and counts steps in Python, none of which dynamo can put in a graph). It checks its input in the
traced code and then calls `tbegen_compile::lookup`, whose backward (registered with
`torch.library.register_autograd`) calls `tbegen_compile::lookup_backward`. Both are custom
operators with fake (shape-only) implementations, so the compiler puts them in its graph as calls
it does not look into; when the graph runs, they run the module's eager forward and backward
bodies (the same code as without compile: the same bits), error polling included, so a bad index
raises under compile exactly as it does eagerly.

What the operators cannot take is the module itself: they take an integer handle that names it
in a registry of weak references (`register`, called by the module's constructor and again when
a module is copied or unpickled, so that a copy gets a handle of its own).

Both operators are registered as having ordered side effects (`torch.library._register_effectful_op`,
which PyTorch names for "an op that has side effects that is not capturable by the schema"): the
compiler threads an effect token through them, so it neither drops a call whose output looks
unused (the backward's gradient for the zero-size anchor is an empty tensor the compiler could
fold away), nor merges two identical calls (a model that calls the module twice on the same batch
gets two lookups and two updates, as in eager), nor reorders them. Both also carry the
`cudagraph_unsafe` tag: mode="reduce-overhead" must not record them into a CUDA graph (a replay
would repeat the recorded step's update without the host work around it).
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


@torch.library.custom_op("tbegen_compile::lookup", mutates_args=(), tags=_TAGS)
def lookup(first: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor,
           per_sample_weights: Optional[torch.Tensor], handle: int, out_rows: int, out_width: int,
           keep_ticket: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """The module's eager forward body: returns the float32 lookup and a call token (int64 scalar
    on the CPU; non-zero when a cache ticket is kept for the backward)."""
    module, _Lookup = _module(handle)
    module._check_buffers()
    module._errors.poll()
    if module.training:
        module.run_table_stages()
    ticket = None
    if module._cache is not None:
        ticket = module._take_prefetched(indices, offsets) or module._prepare(indices, offsets)
        offsets = ticket.offsets
        if keep_ticket:
            module._cache.hold(ticket)
    ctx = types.SimpleNamespace(save_for_backward=lambda *t: None)
    out = _Lookup.forward(ctx, module, first, indices if ticket is None else ticket.indices, offsets,
                          per_sample_weights, ticket)
    if tuple(out.shape) != (out_rows, out_width):  # (the fake implementation's shape must hold)
        raise RuntimeError(f"tbegen: compiled lookup produced shape {tuple(out.shape)}, expected "
                           f"{(out_rows, out_width)}")
    call = 0
    if ticket is not None and keep_ticket:
        call = next(_next_call)
        _TICKETS[(handle, call)] = ticket
    return out, torch.tensor(call, dtype=torch.int64)


@lookup.register_fake
def _(first, indices, offsets, per_sample_weights, handle, out_rows, out_width, keep_ticket):
    out = indices.new_empty((out_rows, out_width), dtype=torch.float32)
    return out, torch.empty((), dtype=torch.int64, device="cpu")


@torch.library.custom_op("tbegen_compile::lookup_backward", mutates_args=(), tags=_TAGS)
def lookup_backward(grad_output: torch.Tensor, call: torch.Tensor, first: torch.Tensor, indices: torch.Tensor,
                    offsets: torch.Tensor, per_sample_weights: Optional[torch.Tensor], handle: int,
                    need_first: bool, need_psw: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """The module's eager backward body (the fused update, or the dense weight gradient; the
    per-sample-weight gradient): returns (gradient of `first`, gradient of the per-sample weights,
    empty when not needed)."""
    module, _Lookup = _module(handle)
    key = int(call.item())
    ticket = None
    if key:
        ticket = _TICKETS.pop((handle, key), None)
        if ticket is None:
            raise RuntimeError("tbegen: a second backward through one compiled lookup of cached tables "
                               "(retain_graph=True) is not supported under torch.compile")
    ctx = types.SimpleNamespace(
        module=module, ticket=ticket, saved_tensors=(indices, offsets, per_sample_weights),
        needs_input_grad=(False, need_first, False, False, need_psw, False),
    )
    grads = _Lookup.backward(ctx, grad_output)
    grad_first = grads[1] if grads[1] is not None else first.new_zeros(first.shape)
    grad_psw = grads[4] if grads[4] is not None else grad_output.new_empty((0,), dtype=torch.float32)
    return grad_first, grad_psw


@lookup_backward.register_fake
def _(grad_output, call, first, indices, offsets, per_sample_weights, handle, need_first, need_psw):
    grad_first = first.new_empty(first.shape)
    n = per_sample_weights.shape[0] if (need_psw and per_sample_weights is not None) else 0
    return grad_first, grad_output.new_empty((n,), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    first, indices, offsets, per_sample_weights, handle, _rows, _width, _keep = inputs
    ctx.handle = handle
    ctx.has_psw = per_sample_weights is not None
    ctx.save_for_backward(output[1], first, indices, offsets,
                          *((per_sample_weights,) if per_sample_weights is not None else ()))
    ctx.mark_non_differentiable(output[1])


def _backward(ctx, grad_out, _grad_call):
    call, first, indices, offsets, *rest = ctx.saved_tensors
    psw = rest[0] if ctx.has_psw else None
    need_first = ctx.needs_input_grad[0]
    need_psw = ctx.has_psw and ctx.needs_input_grad[3]
    grad_first, grad_psw = lookup_backward(grad_out, call, first, indices, offsets, psw, ctx.handle,
                                           need_first, need_psw)
    return grad_first, None, None, (grad_psw if need_psw else None), None, None, None, None


lookup.register_autograd(_backward, setup_context=_setup_context)
# Both operators act on the module's state beyond their schema (the update, the error record, the
# step count, the cache): ordered effects, so that the compiler neither drops, merges nor reorders
# them (an effect token is threaded through the graph).
torch.library._register_effectful_op("tbegen_compile::lookup", torch._library.effects.EffectType.ORDERED)
torch.library._register_effectful_op("tbegen_compile::lookup_backward", torch._library.effects.EffectType.ORDERED)


def compiled_forward(module: Any, indices: torch.Tensor, offsets: torch.Tensor,
                     per_sample_weights: Optional[torch.Tensor]) -> torch.Tensor:
    """TableBatchedEmbeddingBags.forward while dynamo traces it (torch.compiler.is_compiling())."""
    indices, offsets, per_sample_weights = module._check_input(indices, offsets, per_sample_weights)
    if module.pooling == "none":
        rows, width = indices.shape[0], module.layout.max_D
    else:
        rows, width = (offsets.shape[0] - 1) // module.layout.num_features, module.layout.total_D
    first = module.weights if module.dense_gradient else module._compile_anchor
    out, _call = lookup(first, indices, offsets, per_sample_weights,
                        module._compile_handle, rows, width, torch.is_grad_enabled())
    return out if module.output_dtype == torch.float32 else out.to(module.output_dtype)
