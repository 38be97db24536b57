"""The optimizer of a TorchRec table group, read from TorchRec's configuration as TorchRec's FBGEMM
kernel reads it.

TorchRec configures a fused kernel through each table's `fused_params`: the sharder's
`fused_params`, overridden per table by what `apply_optimizer_in_backward(optimizer_class, params,
kwargs)` left on the table's weight (`optimizer_class` becomes `"optimizer": EmbOptimType`, `lr`
becomes `learning_rate`, the other kwargs pass as they are), plus what the plan adds (cache
parameters, stochastic_rounding, bounds_check_mode, output_dtype). Its FBGEMM kernel passes all of
them to FBGEMM's `SplitTableBatchedEmbeddingBagsCodegen(**fused_params)`, whose defaults fill in
the rest (EXACT_SGD at learning rate 0.01 when nothing names an optimizer).

Here the same dictionary picks a tbegen spec with FBGEMM's update for that EmbOptimType
(tbegen.fbgemm_compat.FBGEMM_OPTIMIZERS) and its hyperparameters (FBGEMM's defaults for those not
given), or the tbegen spec given to tbegen's sharder by name or path (its own defaults), with these
rules, all errors naming the tables:

- no optimizer anywhere (neither an EmbOptimType nor a tbegen spec): an error (FBGEMM would train
  EXACT_SGD at 0.01 without a word);
- an EmbOptimType and a tbegen spec with a different update: an error; the same update: one optimizer;
- a hyperparameter given both ways with different values: an error;
- a hyperparameter the optimizer does not use (FBGEMM ignores it silently; SGD's momentum, Adam's
  momentum, ...): an error, except weight_decay 0 and weight_decay_mode NONE (which ask for nothing);
- an EmbOptimType tbegen has no spec for, a FBGEMM argument for a feature tbegen lacks, an argument
  FBGEMM does not know either (torch.optim's `betas`, `lr_decay`, ...): an error.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import torch

from .. import fbgemm_compat as fc
from ..model import OptimizerSpec
from ..module import check_hyperparameters

# The key of tbegen's own options (TbegenOptions) in TorchRec's fused_params.
FUSED_PARAMS_KEY = "tbegen"

# fused_params keys the kernel reads itself (the rest are the optimizer's or FBGEMM's other arguments)
_CACHE_KEYS = ("cache_load_factor", "cache_algorithm")
_OUTPUT_DTYPES = {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}
# hyperparameter values that ask for nothing, accepted by optimizers that do not have them
_NEUTRAL = {"weight_decay": 0.0, "weight_decay_mode": 0}


@dataclasses.dataclass(frozen=True)
class TbegenOptions:
    """What tbegen's sharder was given beyond TorchRec's configuration. Frozen and hashable: it is
    part of TorchRec's grouping key (fused_params), so tables with different options never share a
    kernel.

    spec: the tbegen optimizer given by name or path, or None (TorchRec's configuration names it).
    hyperparameters: those given to the sharder by keyword (checked against `spec`).
    stochastic_rounding: None where not given (TorchRec's fused_params, else FBGEMM's default True).
    """

    spec: Optional[OptimizerSpec]
    hyperparameters: Tuple[Tuple[str, Any], ...] = ()
    stochastic_rounding: Optional[bool] = None
    seed: int = 0
    max_segment_length_per_warp: int = 32


@dataclasses.dataclass
class ResolvedOptimizer:
    """What one table group's tbegen module is built with."""

    spec: OptimizerSpec
    hyperparameters: Dict[str, Any]  # complete, in the spec's order
    fbgemm_optimizer: Optional[str]  # the EmbOptimType member name with this update, if any
    stochastic_rounding: bool
    output_dtype: torch.dtype
    source: str  # how the optimizer was chosen, for messages and docs


def fbgemm_name_of(spec: OptimizerSpec) -> Optional[str]:
    """The EmbOptimType member whose update `spec` is (the same spec as tbegen's for it), or None."""
    for name, spec_name in fc.FBGEMM_OPTIMIZERS.items():
        if spec.name == spec_name and spec == fc.load_spec(fc.find_spec(spec_name)):
            return name
    return None


def torchrec_state_names(spec: OptimizerSpec) -> Optional[Tuple[str, ...]]:
    """The names TorchRec's fused optimizer gives the states of FBGEMM's kernel for this update
    ("momentum1" for the first, FBGEMM's get_optimizer_state names for the others), in the spec's
    state order; None when FBGEMM has no such optimizer."""
    name = fbgemm_name_of(spec)
    if name is None:
        return None
    if not spec.states:
        return ()
    if len(spec.states) == 1:  # (TorchRec names the first state momentum1, whatever FBGEMM calls it)
        return ("momentum1",)
    fbgemm_names = fc._OPTIMIZER_STATE_NAMES.get(spec.name)
    if fbgemm_names is None or len(fbgemm_names) != len(spec.states):
        return None
    return ("momentum1",) + tuple(fbgemm_names[1:])


def _optimizer_member(value: Any, where: str) -> str:
    if isinstance(value, enum.Enum) and type(value).__name__ in ("EmbOptimType", "OptimType"):
        return value.name
    raise TypeError(
        f"tbegen: {where}: fused_params['optimizer'] must be an EmbOptimType (as TorchRec's FBGEMM kernel takes it), "
        f"got {value!r}; a tbegen spec by name or path is the sharder's `optimizer` argument"
    )


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(_plain(a) == _plain(b))
    except Exception:  # noqa: BLE001 - values that do not compare are different
        return False


def resolve(fused_params: Optional[Mapping[str, Any]], where: str) -> ResolvedOptimizer:
    """The optimizer of a table group from its fused_params (see the module docstring). `where`
    names the tables for messages."""
    params = dict(fused_params or {})
    options = params.pop(FUSED_PARAMS_KEY, None)
    if not isinstance(options, TbegenOptions):
        raise ValueError(f"tbegen: {where}: no tbegen options in the fused_params; shard with TbegenEmbeddingBagCollectionSharder")
    configured = params.pop("optimizer", None)
    given = {k: params.pop(k) for k in list(params) if k in fc.FBGEMM_HYPERPARAMETERS}  # TorchRec's, FBGEMM names
    stochastic = params.pop("stochastic_rounding", None)
    output_dtype = params.pop("output_dtype", None)
    bounds = params.pop("bounds_check_mode", None)
    for key in _CACHE_KEYS:
        params.pop(key, None)  # (read with the placements, kernel._cache_arguments)
    sharder_hyper = dict(options.hyperparameters)

    if configured is None and options.spec is None:
        raise ValueError(
            f"tbegen: {where}: no optimizer is configured. TorchRec's FBGEMM kernel would train EXACT_SGD at "
            f"learning rate 0.01 (FBGEMM's defaults); tbegen does not guess. Configure it the TorchRec way "
            f"(apply_optimizer_in_backward(torch.optim.Adagrad, params, {{'lr': ...}}), or the sharder's "
            f"fused_params={{'optimizer': EmbOptimType.EXACT_ADAGRAD, 'learning_rate': ...}}) or give "
            f"TbegenEmbeddingBagCollectionSharder a tbegen spec name or YAML path"
        )
    if configured is not None:
        member = _optimizer_member(configured, where)
        spec, fbgemm_name = fc._fbgemm_optimizer(member)
        if options.spec is not None and options.spec != spec:
            raise ValueError(
                f"tbegen: {where}: two optimizers are configured: TorchRec's EmbOptimType.{member} (tbegen's "
                f"{spec.name!r}) and the tbegen optimizer {options.spec.name!r} given to the sharder; give one, "
                f"or the same one both ways"
            )
        source = f"EmbOptimType.{member}"
        # FBGEMM's defaults for what is not given, as FBGEMM's constructor has them
        base = {h.name: fc.FBGEMM_HYPERPARAMETERS[h.name] for h in spec.hyperparameters
                if h.name in fc.FBGEMM_HYPERPARAMETERS}
    else:
        spec, fbgemm_name = options.spec, fbgemm_name_of(options.spec)
        source = f"tbegen spec {spec.name!r}"
        base = {}

    declared = {h.name for h in spec.hyperparameters}
    # a spec's own hyperparameter names among the other keys (ftrl's l1, ...) count as given
    given.update({k: params.pop(k) for k in list(params) if k in declared})
    unused = sorted(k for k, v in given.items() if k not in declared and not (k in _NEUTRAL and _same(v, _NEUTRAL[k])))
    if unused:
        raise ValueError(
            f"tbegen: {where}: optimizer {source} does not use {', '.join(f'{k}={given[k]!r}' for k in unused)} "
            f"(FBGEMM would ignore it without a word); its hyperparameters: {sorted(declared)}"
        )
    given = {k: v for k, v in given.items() if k in declared}
    if "weight_decay_mode" in given:
        mode = fc._enum_member(given["weight_decay_mode"], fc.WeightDecayMode, "weight_decay_mode")
        if mode not in ("NONE", "L2", "DECOUPLE"):
            raise NotImplementedError(
                f"tbegen: {where}: weight_decay_mode {mode} is not supported by the TorchRec kernel (NONE, L2 or DECOUPLE)"
            )
        given["weight_decay_mode"] = fc.WeightDecayMode[mode].value
    clash = sorted(k for k in given if k in sharder_hyper and not _same(given[k], sharder_hyper[k]))
    if clash:
        raise ValueError(
            f"tbegen: {where}: hyperparameter(s) given twice with different values: "
            + ", ".join(f"{k}={given[k]!r} in TorchRec's configuration, {sharder_hyper[k]!r} to the sharder" for k in clash)
        )
    whole_table = fc._whole_table_hyperparameters(spec, params.pop("ensemble_mode", None), params.pop("emainplace_mode", None))
    # FBGEMM's other arguments: accepted where they change nothing here, else an error naming them
    # (the same rules as tbegen's FBGEMM class); seed and max_segment_length_per_warp are tbegen's
    module_args = fc._check_other_arguments(spec, params)
    hyper = check_hyperparameters(spec, {**base, **given, **sharder_hyper, **whole_table})

    if stochastic is not None and options.stochastic_rounding is not None and bool(stochastic) != options.stochastic_rounding:
        raise ValueError(
            f"tbegen: {where}: stochastic_rounding={stochastic!r} in TorchRec's configuration, "
            f"{options.stochastic_rounding!r} to the sharder"
        )
    rounding = options.stochastic_rounding if options.stochastic_rounding is not None else (
        bool(stochastic) if stochastic is not None else True)
    dtype = torch.float32
    if output_dtype is not None:
        name = fc._enum_member(output_dtype, fc.SparseType, "output_dtype")
        if name not in _OUTPUT_DTYPES:
            raise NotImplementedError(f"tbegen: {where}: output_dtype {name} is not supported (FP32, FP16 or BF16)")
        dtype = _OUTPUT_DTYPES[name]
    if bounds is not None:
        name = fc._enum_member(bounds, fc.BoundsCheckMode, "bounds_check_mode").replace("V2_", "")
        if name != "FATAL":
            raise NotImplementedError(
                f"tbegen: {where}: bounds_check_mode {name}: the TorchRec kernel raises an error on an "
                f"out-of-range index (FBGEMM's FATAL), the only mode it has"
            )
    if module_args:
        raise ValueError(f"tbegen: {where}: {sorted(module_args)} are the sharder's arguments, not fused_params")
    return ResolvedOptimizer(spec, hyper, fbgemm_name, rounding, dtype, source)


def table_fused_params(sharder_fused_params: Optional[Mapping[str, Any]], param: Any) -> Dict[str, Any]:
    """A table's fused_params as TorchRec's sharded EmbeddingBagCollection composes them: the
    sharder's, overridden by what apply_optimizer_in_backward left on the table's weight `param`
    (its optimizer class as an EmbOptimType, `lr` as `learning_rate`). Reads `param`, changes nothing."""
    from torchrec.distributed.utils import merge_fused_params, optimizer_type_to_emb_opt_type

    classes = getattr(param, "_optimizer_classes", [None])
    kwargs = getattr(param, "_optimizer_kwargs", [{}])
    if len(classes) != 1 or len(kwargs) != 1:
        raise ValueError(f"tbegen: a table's weight has {len(classes)} in-backward optimizers; TorchRec takes one")
    own = copy.copy(dict(kwargs[0]))
    if classes[0] is not None and "optimizer" not in own:
        own["optimizer"] = optimizer_type_to_emb_opt_type(classes[0])
    return merge_fused_params(dict(sharder_fused_params or {}), own)


def check_module(module: Any, sharder_fused_params: Optional[Mapping[str, Any]], tables: Sequence[str]) -> None:
    """Resolves the optimizer of every table of an EmbeddingBagCollection `module` before it is
    sharded, so that a bad configuration is the same error on every rank (a kernel is built only on
    the ranks that hold shards of its tables)."""
    by_name = dict(module.named_parameters())
    for name in tables:
        param = by_name.get(f"embedding_bags.{name}.weight")
        resolve(table_fused_params(sharder_fused_params, param), f"table {name!r}")
