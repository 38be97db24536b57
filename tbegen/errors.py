"""How the module learns of bad input without stopping the GPU.

Every operator call of a module writes into one small error record on the module's device
(int64 [6]: the first out-of-range index, and the first fatal error: malformed offsets, NaN/Inf in
the per-sample weights or the output gradient; templates/include/tbegen/host.h). The kernels read
the record before they write anything: a fatal error, or in bounds-check mode "raise" any bad
index, blocks every update from then on, so nothing is corrupted while the host has not looked.

On the CPU the operators raise at once (checking there costs nothing extra). On CUDA, reading the
record would wait for the GPU, which would cost every training step its host/GPU overlap; instead,
after each call the record is copied to pinned host memory behind an event, and the module looks
at that copy at its next call (or when `check_errors()` is called, which waits). So a bad batch on
CUDA raises at the latest at the module's next call, and no weights or states change in between.
While a CUDA graph is being captured nothing is copied or polled (the capture allows neither a
host read nor an event query): a replayed step's errors are raised by `check_errors()`.

With TBEGEN_ERROR_COPY_AFTER_BACKWARD=1 (opt-in, read when the module is made; issue 29) a forward
whose backward will run (grad enabled) does not copy the record: its backward's copy carries the
forward's errors too, one async copy, one event record and one event query fewer per training step.
The forward's errors then surface at the call after the backward (or at `check_errors()`), never at
the backward itself; the backward's kernels still read the record on the device and update nothing
after an error. A forward that skipped its copy is followed by one that copies, so that forwards
with grad enabled and no backward still report within two calls.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch

from ._env import env_flag

# What the module does with an out-of-range index (fatal errors always raise).
BOUNDS_CHECK_MODES = {
    "raise": "raise an error; nothing is updated by the batch (on CUDA: at the latest at the next call)",
    "warn": "skip the bad index (it contributes nothing and updates nothing) and warn",
    "off": "skip the bad index silently",
}

RECORD_SIZE = 6  # kErrRecordSize in common.h


_CLEAN = bytes(8 * RECORD_SIZE)  # a record with nothing in it


def _bytes_view(t: torch.Tensor):
    """A memoryview of `t`'s bytes (a contiguous CPU tensor, through NumPy), or None without NumPy.
    `view.tobytes() != _CLEAN` reads the record in about 0.2 us (NumPy's any(): 4 us, Tensor.any():
    10 us, on this machine), a few percent of a small step's host time."""
    try:
        return memoryview(t.numpy()).cast("B")
    except (RuntimeError, ImportError, TypeError, ValueError):
        return None


class ErrorRecord:
    """The error record of one module on one device, and its host mirror."""

    # (class defaults: a record unpickled from before TBEGEN_ERROR_COPY_AFTER_BACKWARD copies after
    # every call, as it did; forward_with_grad: set by the module's forward before its operator call)
    _copy_after_backward = False
    _skipped = False
    forward_with_grad = False

    def __init__(self, device: torch.device, ops: Any, mode: str):
        if mode not in BOUNDS_CHECK_MODES:
            raise ValueError(
                f"tbegen: bounds_check_mode must be one of {sorted(BOUNDS_CHECK_MODES)}, got {mode!r} "
                f"({'; '.join(f'{k}: {v}' for k, v in BOUNDS_CHECK_MODES.items())})"
            )
        self.mode = mode
        self._ops = ops
        self.device = device
        self.record = torch.zeros(RECORD_SIZE, dtype=torch.int64, device=device)
        self.record_device = self.record.device  # (with its index: what the module compares its weights' device to)
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._host = torch.zeros(RECORD_SIZE, dtype=torch.int64, pin_memory=True)
            self._copied = torch.cuda.Event()
            self._pending = False
            # TBEGEN_ERROR_COPY_AFTER_BACKWARD=1: a forward whose backward follows skips its copy
            # (module docstring); _skipped: the last call skipped it
            self._copy_after_backward = env_flag("TBEGEN_ERROR_COPY_AFTER_BACKWARD", False)
            self._skipped = False
        # poll() runs at every call: it reads the host record through a view of its bytes
        self._host_view = _bytes_view(self._host if self._cuda else self.record)

    @property
    def skip_bad_indices(self) -> bool:
        return self.mode != "raise"

    def __getstate__(self):
        # (a memoryview does not pickle: rebuilt from the unpickled record by __setstate__)
        state = dict(self.__dict__)
        state["_host_view"] = None
        return state

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        self._host_view = _bytes_view(self._host if self._cuda else self.record)

    def __deepcopy__(self, memo) -> "ErrorRecord":
        # (a copied module starts with a clean record of its own)
        return ErrorRecord(self.record.device, self._ops, self.mode)

    def after_call(self, capturing: Optional[bool] = None, backward_follows: bool = False) -> None:
        """Called after every operator call: on CUDA start copying the record to the host; on the
        CPU report at once (a call there has already raised any error but a skipped index).
        `capturing`: whether the current stream is capturing a CUDA graph, if the caller knows.
        `backward_follows`: the call is a forward whose backward will run; with
        TBEGEN_ERROR_COPY_AFTER_BACKWARD=1 it copies nothing, unless the last call skipped its copy
        too (module docstring)."""
        if self._cuda:
            if capturing is None:
                capturing = torch.cuda.is_current_stream_capturing()
            if capturing:
                # (a CUDA graph being captured: the host copy would replay unseen and the event
                # query is not allowed; the kernels still block every update after an error, and
                # `check_errors()` after a replay reads the record. tbegen/capture.py)
                return
            if backward_follows and self._copy_after_backward and not self._skipped:
                self._skipped = True
                return
            self._skipped = False
            self._host.copy_(self.record, non_blocking=True)
            self._copied.record()
            self._pending = True
        else:
            self.poll()

    def poll(self) -> None:
        """Raises (or warns about) what an earlier call recorded, if the host copy is ready. Never waits."""
        if self._cuda:
            if not self._pending or torch.cuda.is_current_stream_capturing() or not self._copied.query():
                return
            self._pending = False
            host = self._host
        else:
            host = self.record
        if (self._host_view.tobytes() != _CLEAN) if self._host_view is not None else bool(host.any()):
            self._report(host.clone())

    def check(self) -> None:
        """Waits for every call so far and raises (or warns about) what they recorded."""
        if self._cuda:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("tbegen: check_errors() waits for the GPU, which a stream capturing a CUDA graph "
                                   "cannot do; call it after the graph's replay")
            self.after_call()
            self._copied.synchronize()
        self.poll()

    def _report(self, host: torch.Tensor) -> None:
        fatal = self._ops.describe_error(host, False)
        index = self._ops.describe_error(host, True) if not fatal else ""
        # start afresh: the calls that follow are judged on their own
        self.record.zero_()
        if self._cuda:
            self._host.zero_()
        where = " (recorded on the GPU by an earlier call of this module; no weights or states were updated since)"
        if fatal:
            raise RuntimeError(fatal + (where if self._cuda else " (nothing was updated)"))
        if self.mode == "raise":
            raise RuntimeError(index + (where if self._cuda else " (nothing was updated)"))
        if self.mode == "warn":
            warnings.warn(f"{index}; it was skipped (bounds_check_mode='warn')", RuntimeWarning, stacklevel=4)
