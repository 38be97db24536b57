"""What a module's training step needs to be captured in a CUDA graph (torch.cuda.graph).

The operators wait for nothing after a features table's first call, so a warmed-up step (forward
and fused backward, on device-placed tables) can be captured and replayed. Two things of the step
do not replay: the host work around the kernels (the error record's poll, tbegen/errors.py, which
is skipped while capturing: replays report through `check_errors()`), and the step count, which
reaches the kernels by value: a replay repeats the captured step's number. That is harmless where
the update does not read it, and wrong where it does, so a capture of such a step is refused:
- the spec's update or its whole-table stages read `step` (adam's bias correction), or the spec
  has whole-table stages (they run per step, on the host's count);
- stochastic rounding draws bits keyed by the step: fp16/bf16/int8 weights with
  stochastic_rounding=True, or narrow optimizer states (state_dtypes);
- managed_caching tables (the cache's slots are chosen on the host per batch).
Moving the step count into a device scalar that the step's last kernel increments would lift the
first two (a kernel-argument change; benchmarks/NOTES-gpu.md).
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch

from .codegen import used_names


def capture_problems(module: Any) -> List[str]:
    """Why a captured training step of `module` would not replay as eager steps do ([] if it would)."""
    spec = module.spec
    problems = []
    code = "\n".join([s.code for s in spec.stages] + [s.when for s in spec.stages])
    if "step" in used_names(code):
        problems.append(f"optimizer {spec.name!r} reads the step count, which a replay would repeat")
    if spec.table_stages or spec.table_reductions:
        problems.append(f"optimizer {spec.name!r} has whole-table stages, run per step by the host")
    if (module.stochastic_rounding and not module.dense_gradient
            and module.weights_dtype in (torch.float16, torch.bfloat16, torch.uint8)):
        problems.append("stochastic rounding of the weights draws bits keyed by the step count")
    narrow = [name for name, dtype in module.state_dtypes.items() if dtype != torch.float32]
    if narrow:
        problems.append(f"narrow optimizer states {narrow} are rounded with bits keyed by the step count")
    if module._cache is not None:
        problems.append("managed_caching tables choose their cache slots on the host per batch")
    return problems


def check_capturable(module: Any, capturing: Optional[bool] = None) -> None:
    """Raises if the current stream is capturing a CUDA graph and `module`'s step would not replay.
    `capturing`: whether it is (module's weights on CUDA and the stream capturing), if the caller
    knows already (the module's backward asks once per call)."""
    if capturing is None:
        capturing = module.weights.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if not capturing:
        return
    problems = capture_problems(module)
    if problems:
        raise RuntimeError("tbegen: this module's training step cannot be captured in a CUDA graph: "
                           + "; ".join(problems) + " (docs/module.md, 'torch.compile and CUDA graphs')")
