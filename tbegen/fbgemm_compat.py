"""An FBGEMM-compatible face for tbegen: `SplitTableBatchedEmbeddingBagsCodegen`.

Switching a model from FBGEMM_GPU's training TBE to tbegen is one import line:

    # from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen
    from tbegen.fbgemm_compat import SplitTableBatchedEmbeddingBagsCodegen

The constructor takes FBGEMM's arguments (embedding_specs as (rows, dim, location, compute_device)
tuples, optimizer, feature_table_map, pooling_mode, weights_precision, output_dtype,
stochastic_rounding, bounds_check_mode and the hyperparameters under FBGEMM's names) and the
methods are FBGEMM's (forward, split_embedding_weights, split_optimizer_states, set_learning_rate,
get_learning_rate, flush, state_dict, ...). Underneath is one `tbegen.TableBatchedEmbeddingBags`.

Enums: this module never imports fbgemm_gpu. Every enum argument is matched by its class name and
member name, so fbgemm_gpu's own enums work when it is installed, and so do the look-alike enums
defined here (for code that runs without fbgemm_gpu), the member names as strings ("EXACT_SGD",
"device"), FBGEMM's string values ("exact_row_wise_adagrad", "fp16") and, for FBGEMM's integer
enums, their integer values.

Optimizers FBGEMM lacks are reached by tbegen spec name ("adamw", "ftrl"), YAML path or
OptimizerSpec; their own hyperparameters are keyword arguments.

What differs from FBGEMM, and what is refused, is listed in docs/fbgemm.md.
"""

from __future__ import annotations

import enum
import math
import numbers
import os
import warnings
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn

from .model import OptimizerSpec
from .module import TableBatchedEmbeddingBags, check_hyperparameters
from .spec import SpecNotFoundError, find_spec, load_spec

__all__ = [
    "SplitTableBatchedEmbeddingBagsCodegen",
    "EmbOptimType",
    "EmbeddingLocation",
    "ComputeDevice",
    "PoolingMode",
    "SparseType",
    "BoundsCheckMode",
    "WeightDecayMode",
    "CacheAlgorithm",
    "FBGEMM_OPTIMIZERS",
]


# ---- look-alike enums (FBGEMM's member names and values; used when fbgemm_gpu is absent) -------


class EmbOptimType(enum.Enum):
    EXACT_SGD = "exact_sgd"
    EXACT_ADAGRAD = "exact_adagrad"
    EXACT_ROWWISE_ADAGRAD = "exact_row_wise_adagrad"
    ADAM = "adam"
    LAMB = "lamb"
    LARS_SGD = "lars_sgd"
    PARTIAL_ROWWISE_ADAM = "partial_row_wise_adam"
    PARTIAL_ROWWISE_LAMB = "partial_row_wise_lamb"
    ENSEMBLE_ROWWISE_ADAGRAD = "ensemble_row_wise_adagrad"
    EMAINPLACE_ROWWISE_ADAGRAD = "ema_in_place_row_wise_adagrad"
    NONE = "none"


class EmbeddingLocation(enum.IntEnum):
    DEVICE = 0
    MANAGED = 1
    MANAGED_CACHING = 2
    HOST = 3
    MTIA = 4


class CacheAlgorithm(enum.Enum):
    LRU = 0
    LFU = 1


class ComputeDevice(enum.IntEnum):
    CPU = 0
    CUDA = 1
    MTIA = 2


class PoolingMode(enum.IntEnum):
    SUM = 0
    MEAN = 1
    NONE = 2


class BoundsCheckMode(enum.IntEnum):
    FATAL = 0
    WARNING = 1
    IGNORE = 2
    NONE = 3
    V2_IGNORE = 4
    V2_WARNING = 5
    V2_FATAL = 6


class WeightDecayMode(enum.IntEnum):
    NONE = 0
    L2 = 1
    DECOUPLE = 2
    COUNTER = 3
    COWCLIP = 4
    DECOUPLE_GLOBAL = 5


class SparseType(enum.Enum):
    FP32 = "fp32"
    FP16 = "fp16"
    FP8 = "fp8"
    NFP8 = "nfp8"
    INT8 = "int8"
    INT4 = "int4"
    INT2 = "int2"
    BF16 = "bf16"
    MX4 = "mx4"


def _enum_member(value, family, argument: str, class_names: Sequence[str] = ()) -> str:
    """The member name of `family` that `value` denotes (see the module docstring for what is
    accepted). `class_names`: the enum class names accepted besides `family.__name__`."""
    names = {family.__name__, *class_names}
    if isinstance(value, enum.Enum):
        if type(value).__name__ in names and value.name in family.__members__:
            return value.name
        raise TypeError(
            f"tbegen: {argument} must be a {family.__name__} (one of {list(family.__members__)}), "
            f"got {type(value).__name__}.{value.name}"
        )
    if isinstance(value, str):
        for member in family:
            if value.upper() == member.name or (isinstance(member.value, str) and value.lower() == member.value):
                return member.name
    elif isinstance(value, numbers.Integral) and not isinstance(value, bool) and issubclass(family, enum.IntEnum):
        for member in family:
            if int(value) == member.value:
                return member.name
    raise ValueError(
        f"tbegen: {argument} must be a {family.__name__} (one of {list(family.__members__)}), got {value!r}"
    )


# ---- optimizers --------------------------------------------------------------------------------

# FBGEMM's optimizer (EmbOptimType member name) -> the tbegen spec with the same update. For each
# of them the spec's states, in the spec's order, are FBGEMM's momentum1, momentum2 (the order of
# FBGEMM's split_optimizer_states), with the same shapes (per element [rows, dim], per row [rows]).
FBGEMM_OPTIMIZERS = {
    "EXACT_SGD": "sgd",
    "EXACT_ADAGRAD": "adagrad",
    "EXACT_ROWWISE_ADAGRAD": "rowwise_adagrad",
    "ADAM": "adam",
    "LAMB": "lamb",
    "LARS_SGD": "lars_sgd",
    "PARTIAL_ROWWISE_ADAM": "partial_rowwise_adam",
    "PARTIAL_ROWWISE_LAMB": "partial_rowwise_lamb",
    # rowwise Adagrad plus a whole-table operation before the forward (FBGEMM's ensemble_mode /
    # emainplace_mode arguments become the spec's hyperparameters: _whole_table_hyperparameters)
    "ENSEMBLE_ROWWISE_ADAGRAD": "ensemble_rowwise_adagrad",
    "EMAINPLACE_ROWWISE_ADAGRAD": "emainplace_rowwise_adagrad",
}

# FBGEMM's names for each optimizer's states in get_optimizer_state() (torch.optim's names).
_OPTIMIZER_STATE_NAMES = {
    "rowwise_adagrad_with_counter": ("sum", "prev_iter", "row_counter"),
    "adagrad": ("sum",),
    "rowwise_adagrad": ("sum",),
    "adam": ("exp_avg", "exp_avg_sq"),
    "partial_rowwise_adam": ("exp_avg", "exp_avg_sq"),
    "lamb": ("exp_avg", "exp_avg_sq"),
    "partial_rowwise_lamb": ("exp_avg", "exp_avg_sq"),
    "ensemble_rowwise_adagrad": ("sum", "sparse_ema"),
    "emainplace_rowwise_adagrad": ("sum",),
}


def _resolve_optimizer(optimizer) -> Tuple[OptimizerSpec, Optional[str]]:
    """(spec, FBGEMM optimizer name or None) for an EmbOptimType, a name or a path, or a spec."""
    if isinstance(optimizer, OptimizerSpec):
        return optimizer, None
    if isinstance(optimizer, enum.Enum):
        # fbgemm_gpu's EmbOptimType (also exported there as OptimType), or ours.
        if type(optimizer).__name__ not in ("EmbOptimType", "OptimType"):
            raise TypeError(f"tbegen: optimizer must be an EmbOptimType, a tbegen spec name or a path, got {optimizer!r}")
        return _fbgemm_optimizer(optimizer.name)
    if not isinstance(optimizer, (str, os.PathLike)):
        raise TypeError(
            f"tbegen: optimizer must be an EmbOptimType, its name, a tbegen spec name, a path to a YAML spec or "
            f"an OptimizerSpec, got {type(optimizer).__name__}"
        )
    text = os.fspath(optimizer)
    # A tbegen spec name or path first ("sgd", "adam", "lamb", "lars_sgd" are FBGEMM names as well,
    # with the same update); then FBGEMM's member names and string values.
    try:
        return load_spec(find_spec(text)), _fbgemm_name_of_spec(text)
    except SpecNotFoundError as not_a_spec:
        for name in EmbOptimType.__members__:
            if text.upper() == name or text.lower() == EmbOptimType[name].value:
                return _fbgemm_optimizer(name)
        raise ValueError(
            f"tbegen: optimizer {text!r} is neither an FBGEMM optimizer ({', '.join(FBGEMM_OPTIMIZERS)}) "
            f"nor a tbegen spec: {not_a_spec}"
        ) from None


def _fbgemm_name_of_spec(name: str) -> Optional[str]:
    for fbgemm_name, spec_name in FBGEMM_OPTIMIZERS.items():
        if spec_name == name:
            return fbgemm_name
    return None


def _fbgemm_optimizer(name: str) -> Tuple[OptimizerSpec, str]:
    if name not in FBGEMM_OPTIMIZERS:
        hint = (
            " (FBGEMM's NONE returns a sparse weight gradient; tbegen's dense-gradient mode is "
            "tbegen.TableBatchedEmbeddingBags(optimizer='none'))" if name == "NONE" else
            " (FBGEMM deprecated it; use its EXACT_ variant)" if name in ("SGD", "ROWWISE_ADAGRAD") else
            "; write it as a tbegen spec and pass its path"
        )
        raise NotImplementedError(
            f"tbegen: optimizer EmbOptimType.{name} is not supported{hint}; supported: "
            f"{', '.join(FBGEMM_OPTIMIZERS)} or any tbegen spec name or path"
        )
    return load_spec(find_spec(FBGEMM_OPTIMIZERS[name])), name


# ---- constructor arguments ---------------------------------------------------------------------

# FBGEMM's optimizer hyperparameters and its defaults. Each is passed to the spec when the spec
# declares a hyperparameter of that name (FBGEMM's default then replaces the spec's); the others
# are ignored, as FBGEMM ignores them (with a warning when the value is not FBGEMM's default).
FBGEMM_HYPERPARAMETERS = {
    "learning_rate": 0.01,
    "eps": 1.0e-8,
    "momentum": 0.9,
    "weight_decay": 0.0,
    "weight_decay_mode": 0,  # WeightDecayMode.NONE
    "eta": 0.001,
    "beta1": 0.9,
    "beta2": 0.999,
    "max_norm": 0.0,
    # FBGEMM's ROWWISE_RMSPROP_AR knobs; no supported optimizer reads them.
    "ar_alpha": 0.0,
    "ema_beta": 0.99,
    "min_shrinkage": 0.1,
}

# FBGEMM's other constructor arguments that have no effect here: cache settings other than
# cache_load_factor and cache_algorithm (tbegen's caches are fully associative per table, in the
# weights' precision; prefetch_pipeline: prefetching ahead is always safe here, see
# docs/placements.md), statistics and logging, index dtypes (tbegen takes int32 and int64 indices
# either way), shard bookkeeping. (uvm_host_mapped is read: MANAGED tables then take placement
# "host".)
_NO_EFFECT = {
    "cache_sets", "cache_reserved_memory", "cache_precision", "prefetch_pipeline",
    "enforce_hbm", "record_cache_metrics", "gather_uvm_cache_stats", "stats_reporter_config",
    "table_names", "embedding_table_index_type", "embedding_table_offset_type",
    "embedding_shard_info", "use_experimental_tbe",
    "max_gradient",  # read only with gradient_clipping, which is refused
}

# FBGEMM's constructor arguments that select features tbegen does not have: accepted only at their
# default (None or False), otherwise an error naming the argument.
_UNSUPPORTED_UNLESS_DEFAULT = {
    "gradient_clipping": "gradient clipping of the summed row gradient",
    "counter_based_regularization": "read with weight_decay_mode COUNTER only",
    "cowclip_regularization": "read with weight_decay_mode COWCLIP only",
    "global_weight_decay": "global weight decay (WeightDecayMode.DECOUPLE_GLOBAL)",
    "uvm_non_rowwise_momentum": "optimizer states in unified memory",
    "multipass_prefetch_config": "cache prefetching",
    "optimizer_state_dtypes": "optimizer states other than float32",
    "tbe_input_multiplexer_config": "input multiplexing",
    "enable_raw_embedding_streaming": "raw embedding streaming",
    "res_params": "raw embedding streaming",
    "is_qr_tbe": "QR embeddings",
    "preallocated_host_buffers": "preallocated host buffers",
}

# FBGEMM's forward arguments for features tbegen does not have (accepted when None).
_FORWARD_UNSUPPORTED = {"hash_zch_identities", "hash_zch_runtime_meta", "vbe_output", "vbe_output_offsets"}

# tbegen's own module arguments, passed through.
_TBEGEN_ARGS = {"seed", "max_segment_length_per_warp"}

_PRECISIONS = {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}
# Weights only: INT8 is tbegen's int8 rows (uint8, each row D codes then a float32 scale and bias:
# FBGEMM's own INT8 row layout, so split_embedding_weights() returns the same [rows, dim + 8] rows).
_WEIGHT_PRECISIONS = {**_PRECISIONS, "INT8": torch.uint8}


def _weights_layout(tbe) -> Tuple[List[int], List[int]]:
    """Per table, (start, size) in the module's flat weights buffer, in its elements: for int8
    rows in bytes (each row D codes + 8 bytes of qparams: tbegen/int8.py)."""
    layout = tbe.layout
    if tbe.weights_dtype != torch.uint8:
        return list(layout.table_offsets), [E * D for E, D in layout.tables]
    q = 8
    return ([off + q * kb for off, kb in zip(layout.table_offsets, layout.table_key_base)],
            [E * (D + q) for E, D in layout.tables])


def _plain(value) -> Any:
    """An enum member's value (fbgemm_gpu's enums or ours), anything else as it is."""
    return value.value if isinstance(value, enum.Enum) else value


def _is_default(value, default) -> bool:
    value = _plain(value)
    try:
        return value == default
    except Exception:  # a tensor or an object without a plain comparison
        return False


def _extra_optimizer_config(config, fbgemm_name: Optional[str]) -> Tuple[bool, bool]:
    """(writeback, writeback_first_feature_only) from FBGEMM's UserEnabledConfigDefinition (read by
    attribute; None: FBGEMM's defaults). As in FBGEMM the writeback hook is EXACT_SGD's only,
    writeback_first_feature_only is read only with it, and precompute_writeback only chooses when
    FBGEMM computes the same mask (no effect here)."""
    if config is None:
        return False, False
    known = {"use_rowwise_bias_correction", "use_writeback_bwd_prehook", "writeback_first_feature_only",
             "precompute_writeback"}
    fields = {k: v for k, v in vars(config).items() if not k.startswith("_")}
    unknown = sorted(k for k, v in fields.items() if k not in known and v)
    if unknown:
        raise NotImplementedError(f"tbegen: extra_optimizer_config enables {unknown}, which tbegen does not support")
    if fields.get("use_rowwise_bias_correction"):
        raise NotImplementedError(
            "tbegen: extra_optimizer_config.use_rowwise_bias_correction (ADAM's per-row bias correction with a "
            "row_counter state) is not supported"
        )
    writeback = bool(fields.get("use_writeback_bwd_prehook", False))
    if writeback and fbgemm_name != "EXACT_SGD":
        raise ValueError(
            f"tbegen: extra_optimizer_config.use_writeback_bwd_prehook is EXACT_SGD's only (as in FBGEMM), not "
            f"{fbgemm_name or 'this optimizer'}'s"
        )
    return writeback, writeback and bool(fields.get("writeback_first_feature_only", False))


class _KeepGradient(torch.autograd.Function):
    """Identity forward; the backward passes the output gradient where `keep` is True and zero
    elsewhere (`keep` broadcasts against the output). The writeback hook's mask."""

    @staticmethod
    def forward(ctx, out, keep):
        ctx.save_for_backward(keep)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        return torch.where(keep, grad, torch.zeros((), dtype=grad.dtype, device=grad.device)), None


class VBEMetadata(NamedTuple):
    """FBGEMM's variable-batch metadata (prepare_inputs' fourth result; fields as FBGEMM names
    them; None / -1 for a fixed batch)."""

    B_offsets: Optional[torch.Tensor]
    output_offsets_feature_rank: Optional[torch.Tensor]
    B_offsets_rank_per_feature: Optional[torch.Tensor]
    max_B_feature_rank: int
    max_B: int
    output_size: int


class OptimizerArgs(NamedTuple):
    """FBGEMM's optimizer_args fields (values: see SplitTableBatchedEmbeddingBagsCodegen.optimizer_args)."""

    stochastic_rounding: bool
    gradient_clipping: bool
    max_gradient: float
    max_norm: float
    learning_rate: float
    eps: float
    beta1: float
    beta2: float
    step_ema: float
    step_swap: float
    step_start: float
    step_mode: int
    weight_decay: float
    weight_decay_mode: int
    eta: float
    momentum: float
    counter_halflife: int
    adjustment_iter: int
    adjustment_ub: float
    learning_rate_mode: int
    grad_sum_decay: int
    tail_id_threshold: float
    is_tail_id_thresh_ratio: int
    total_hash_size: int
    weight_norm_coefficient: float
    lower_bound: float
    regularization_mode: int
    use_rowwise_bias_correction: bool


# ---- counter-based regularization (weight_decay_mode COUNTER / COWCLIP) ------------------------
# FBGEMM runs EXACT_ROWWISE_ADAGRAD with weight_decay_mode COUNTER (3) or COWCLIP (4) as its
# rowwise_adagrad_with_counter kernel; here that is optimizers/rowwise_adagrad_with_counter.yaml,
# whose hyperparameters come from FBGEMM's CounterBasedRegularizationDefinition or CowClipDefinition
# (read by attribute, so fbgemm_gpu's dataclasses or any object with those fields will do).
COUNTER_SPEC = "rowwise_adagrad_with_counter"
_COUNTER_STATE_KEYS = ("momentum1", "prev_iter", "row_counter")  # FBGEMM's state_dict buffers, in order


def _state_key(spec_name: str, k: int) -> str:
    """FBGEMM's state_dict name of the k-th (1-based) optimizer state: momentum1, momentum2, or
    for the counter optimizer momentum1, prev_iter, row_counter."""
    return _COUNTER_STATE_KEYS[k - 1] if spec_name == COUNTER_SPEC else f"momentum{k}"


def _counter_hyperparameters(mode: str, counter, cowclip) -> Tuple[Dict[str, Any], int]:
    """(the counter spec's hyperparameters, FBGEMM's max_counter_update_freq) for mode COUNTER or
    COWCLIP, from FBGEMM's definition objects (None: FBGEMM's defaults)."""
    given = counter if mode == "COUNTER" else cowclip
    if given is None:
        argument = "counter_based_regularization" if mode == "COUNTER" else "cowclip_regularization"
        raise ValueError(f"tbegen: weight_decay_mode {mode} needs {argument} (as FBGEMM does)")
    if mode == "COUNTER":
        decay = _plain(getattr(counter, "grad_sum_decay", -1))
        if decay != -1:
            raise NotImplementedError(
                f"tbegen: counter_based_regularization.grad_sum_decay {getattr(counter, 'grad_sum_decay')!r} is not "
                f"supported (NO_DECAY only)"
            )
        tail = getattr(counter, "tail_id_threshold", None)
        hyper = dict(
            regularization_mode=3,
            weight_decay_mode=int(_plain(counter.counter_weight_decay_mode)),
            counter_halflife=int(counter.counter_halflife),
            adjustment_iter=int(counter.adjustment_iter),
            adjustment_ub=float(counter.adjustment_ub),
            learning_rate_mode=int(_plain(counter.learning_rate_mode)),
            tail_id_threshold=float(getattr(tail, "val", 0.0)) if tail is not None else 0.0,
            is_tail_id_thresh_ratio=int(bool(getattr(tail, "is_ratio", False))) if tail is not None else 0,
        )
        return hyper, int(getattr(counter, "max_counter_update_freq", 1000))
    hyper = dict(
        regularization_mode=4,
        weight_decay_mode=int(_plain(cowclip.counter_weight_decay_mode)),
        counter_halflife=int(cowclip.counter_halflife),
        weight_norm_coefficient=float(cowclip.weight_norm_coefficient),
        lower_bound=float(cowclip.lower_bound),
    )
    return hyper, -1


# FBGEMM's EnsembleModeDefinition / EmainplaceModeDefinition fields -> the specs' hyperparameters
# (FBGEMM keeps them as floats and truncates the step counts to ints where it uses them).
_ENSEMBLE_FIELDS = {"step_ema": int, "step_swap": int, "step_start": int, "step_ema_coef": float, "step_mode": int}
_EMAINPLACE_FIELDS = {"step_ema": int, "step_start": int, "step_ema_coef": float}


def _whole_table_hyperparameters(spec: OptimizerSpec, ensemble_mode: Any, emainplace_mode: Any) -> Dict[str, Any]:
    """The hyperparameters of ensemble_rowwise_adagrad / emainplace_rowwise_adagrad from FBGEMM's
    mode definitions (None: FBGEMM's defaults, which are the specs' defaults). As in FBGEMM, a
    definition is read by its own optimizer only."""
    definition, fields = {
        "ensemble_rowwise_adagrad": (ensemble_mode, _ENSEMBLE_FIELDS),
        "emainplace_rowwise_adagrad": (emainplace_mode, _EMAINPLACE_FIELDS),
    }.get(spec.name, (None, {}))
    if definition is None:
        return {}
    hyper = {}
    for name, convert in fields.items():
        if not hasattr(definition, name):
            raise TypeError(f"tbegen: {type(definition).__name__} has no field {name!r} (FBGEMM's "
                            f"{'EnsembleModeDefinition' if spec.name.startswith('ensemble') else 'EmainplaceModeDefinition'} has)")
        value = getattr(definition, name)
        hyper[name] = convert(value.value if isinstance(value, enum.Enum) else value)
    return hyper


def _spec_hyperparameters(spec: OptimizerSpec, fbgemm_values: Dict[str, Any], others: Dict[str, Any]) -> Dict[str, Any]:
    """The spec's hyperparameters from FBGEMM's (those the spec declares) and from the spec's own
    names among the other keyword arguments; checked (errors name the hyperparameter)."""
    mode = _enum_member(fbgemm_values["weight_decay_mode"], WeightDecayMode, "weight_decay_mode")
    if mode not in ("NONE", "L2", "DECOUPLE"):
        raise NotImplementedError(
            f"tbegen: weight_decay_mode {mode} is not supported (NONE, L2 or DECOUPLE; COUNTER and COWCLIP with "
            f"EXACT_ROWWISE_ADAGRAD)"
        )
    fbgemm_values = dict(fbgemm_values, weight_decay_mode=WeightDecayMode[mode].value)
    declared = {h.name for h in spec.hyperparameters}
    hyper = {k: v for k, v in fbgemm_values.items() if k in declared}
    ignored = sorted(
        k for k, v in fbgemm_values.items() if k not in declared and not _is_default(v, FBGEMM_HYPERPARAMETERS[k])
    )
    if ignored:
        warnings.warn(
            f"tbegen: optimizer {spec.name!r} does not use {', '.join(ignored)} (FBGEMM ignores them too)",
            stacklevel=3,
        )
    hyper.update({k: v for k, v in others.items() if k in declared})  # e.g. ftrl's l1
    check_hyperparameters(spec, hyper)
    return hyper


def _check_other_arguments(spec: OptimizerSpec, others: Dict[str, Any]) -> Dict[str, Any]:
    """Checks FBGEMM's non-hyperparameter keyword arguments; returns tbegen's own module arguments."""
    declared = {h.name for h in spec.hyperparameters}
    unknown = []
    for key, value in others.items():
        if key in _UNSUPPORTED_UNLESS_DEFAULT:
            if value is not None and value is not False:
                raise NotImplementedError(f"tbegen: {key}={value!r} is not supported ({_UNSUPPORTED_UNLESS_DEFAULT[key]})")
        elif key not in _NO_EFFECT and key not in _TBEGEN_ARGS and key not in declared:
            unknown.append(key)
    if unknown:
        raise TypeError(
            f"tbegen: unknown argument(s) {', '.join(map(repr, unknown))}: neither FBGEMM's nor a hyperparameter "
            f"of optimizer {spec.name!r} (its hyperparameters: {sorted(declared)})"
        )
    return {k: v for k, v in others.items() if k in _TBEGEN_ARGS}


# FBGEMM's EmbeddingLocation of a CUDA table -> tbegen's placement (tbegen/placement.py). HOST
# with a CUDA compute device: the table in host memory that the GPU kernels read in place.
_CUDA_PLACEMENTS = {"DEVICE": "device", "MANAGED": "managed", "MANAGED_CACHING": "managed_caching", "HOST": "host"}


def _devices(embedding_specs, device) -> Tuple[List[Tuple[int, int]], List[str], torch.device]:
    """Tables, their placements and the torch device from FBGEMM's (rows, dim, location,
    compute_device) specs."""
    if isinstance(embedding_specs, (str, bytes)) or not isinstance(embedding_specs, Sequence) or not embedding_specs:
        raise TypeError("tbegen: embedding_specs must be a non-empty list of (rows, dim, location, compute_device) tuples")
    tables, placements, computes = [], [], []
    for t, entry in enumerate(embedding_specs):
        if not isinstance(entry, Sequence) or len(entry) != 4:
            raise TypeError(f"tbegen: embedding_specs[{t}] must be (rows, dim, location, compute_device), got {entry!r}")
        rows, dim, location, compute = entry
        location = _enum_member(location, EmbeddingLocation, f"embedding_specs[{t}] location")
        compute = _enum_member(compute, ComputeDevice, f"embedding_specs[{t}] compute_device")
        if compute == "MTIA":
            raise NotImplementedError(f"tbegen: embedding_specs[{t}] compute_device MTIA is not supported (CPU or CUDA)")
        if compute == "CPU" and location != "HOST":
            raise NotImplementedError(
                f"tbegen: embedding_specs[{t}] location {location} with compute_device CPU is not supported: "
                f"CPU tables live in host memory (location HOST)"
            )
        tables.append((rows, dim))
        # (a CPU module's tables are in host memory whatever their placement: "device" there)
        placements.append(_CUDA_PLACEMENTS[location] if compute == "CUDA" else "device")
        computes.append(compute)
    if len(set(computes)) != 1:
        raise ValueError(f"tbegen: embedding_specs mixes compute devices {computes}; all tables need the same one")
    if computes[0] == "CPU":
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"tbegen: device {device!r} does not match compute_device CPU of embedding_specs")
        return tables, placements, torch.device("cpu")
    if device is None:
        if not torch.cuda.is_available():
            raise RuntimeError("tbegen: embedding_specs ask for compute_device CUDA, but CUDA is not available to torch here")
        return tables, placements, torch.device("cuda", torch.cuda.current_device())
    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if dev.type != "cuda":
        raise ValueError(f"tbegen: device {device!r} does not match compute_device CUDA of embedding_specs")
    return tables, placements, dev


# ---- the module --------------------------------------------------------------------------------


class SplitTableBatchedEmbeddingBagsCodegen(nn.Module):
    """FBGEMM's training TBE interface on a tbegen `TableBatchedEmbeddingBags`.

    The arguments are FBGEMM's (see the module docstring and docs/fbgemm.md). Beyond them:
    `optimizer` may be any tbegen spec name, YAML path or OptimizerSpec, whose own hyperparameters
    are keyword arguments; `seed` (default 0) seeds the initial weights and the stochastic
    rounding; `max_segment_length_per_warp` is tbegen's CUDA tuning knob.
    """

    def __init__(
        self,
        embedding_specs: Sequence[Tuple[int, int, Any, Any]],
        feature_table_map: Optional[Sequence[int]] = None,
        *,  # FBGEMM's other arguments by keyword (its positional order has cache arguments here)
        weights_precision: Any = SparseType.FP32,
        output_dtype: Any = SparseType.FP32,
        optimizer: Any = EmbOptimType.EXACT_SGD,
        stochastic_rounding: bool = True,
        learning_rate: float = 0.01,
        eps: float = 1.0e-8,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        weight_decay_mode: Any = WeightDecayMode.NONE,
        eta: float = 0.001,
        beta1: float = 0.9,
        beta2: float = 0.999,
        max_norm: float = 0.0,
        pooling_mode: Any = PoolingMode.SUM,
        device: Any = None,
        bounds_check_mode: Any = BoundsCheckMode.WARNING,
        cache_load_factor: float = 0.2,
        cache_algorithm: Any = CacheAlgorithm.LRU,
        **kwargs,
    ):
        super().__init__()
        spec, fbgemm_name = _resolve_optimizer(optimizer)
        tables, placements, dev = _devices(embedding_specs, device)
        if kwargs.pop("uvm_host_mapped", False):
            # FBGEMM's page-locked host memory mapped for the GPU in place of managed memory for
            # MANAGED tables: tbegen's placement "host" (MANAGED_CACHING keeps its managed store)
            placements = ["host" if p == "managed" else p for p in placements]

        precision = _enum_member(weights_precision, SparseType, "weights_precision")
        if precision not in _WEIGHT_PRECISIONS:
            raise NotImplementedError(
                f"tbegen: weights_precision {precision} is not supported for training (FP32, FP16, BF16 or INT8); "
                f"the other quantised types are FBGEMM's inference-only formats"
            )
        out_precision = _enum_member(output_dtype, SparseType, "output_dtype")
        if out_precision not in _PRECISIONS:
            raise NotImplementedError(
                f"tbegen: output_dtype {out_precision} is not supported (FP32, FP16 or BF16: the pooled output's dtype)"
            )
        pooling = _enum_member(pooling_mode, PoolingMode, "pooling_mode")
        bounds = _enum_member(bounds_check_mode, BoundsCheckMode, "bounds_check_mode").replace("V2_", "")
        # (read by MANAGED_CACHING tables: the fraction of each such table's rows its cache holds)
        cache_args = dict(cache_load_factor=cache_load_factor,
                          cache_algorithm=_enum_member(cache_algorithm, CacheAlgorithm, "cache_algorithm").lower())

        fbgemm_values = dict(
            learning_rate=learning_rate, eps=eps, momentum=momentum, weight_decay=weight_decay,
            weight_decay_mode=weight_decay_mode, eta=eta, beta1=beta1, beta2=beta2, max_norm=max_norm,
        )
        fbgemm_values.update({k: v for k, v in kwargs.items() if k in FBGEMM_HYPERPARAMETERS})
        others = {k: v for k, v in kwargs.items() if k not in FBGEMM_HYPERPARAMETERS}
        writeback, writeback_first_feature_only = _extra_optimizer_config(
            others.pop("extra_optimizer_config", None), fbgemm_name)
        mode = _enum_member(fbgemm_values["weight_decay_mode"], WeightDecayMode, "weight_decay_mode")
        # ensemble_mode / emainplace_mode: read by their own optimizer only, as in FBGEMM
        whole_table = _whole_table_hyperparameters(spec, others.pop("ensemble_mode", None),
                                                   others.pop("emainplace_mode", None))
        self._max_counter_update_freq = -1
        if mode in ("COUNTER", "COWCLIP"):
            if fbgemm_name != "EXACT_ROWWISE_ADAGRAD":
                raise NotImplementedError(
                    f"tbegen: weight_decay_mode {mode} is EXACT_ROWWISE_ADAGRAD's (FBGEMM's rowwise_adagrad_with_counter), "
                    f"not {fbgemm_name or spec.name}'s"
                )
            spec = load_spec(find_spec(COUNTER_SPEC))
            counter_hyper, self._max_counter_update_freq = _counter_hyperparameters(
                mode, others.pop("counter_based_regularization", None), others.pop("cowclip_regularization", None))
            fbgemm_values["weight_decay_mode"] = WeightDecayMode.NONE  # the spec's own mode comes from the definition
            hyper = _spec_hyperparameters(spec, fbgemm_values, others)
            # max_counter is the spec's per-table state (initially 1, as FBGEMM's), refreshed by its
            # reduce stage every max_counter_update_freq steps. FBGEMM takes the max over its
            # device copy of the counters, which is empty for tables on the CPU: there its
            # max_counter stays 1, so on the CPU the refresh is switched off here.
            on_gpu = torch.device(dev).type == "cuda"
            hyper.update(counter_hyper, max_counter_update_freq=self._max_counter_update_freq if on_gpu else 0)
            check_hyperparameters(spec, hyper)
        else:
            hyper = _spec_hyperparameters(spec, fbgemm_values, others)
            if whole_table:
                hyper.update(whole_table)
                check_hyperparameters(spec, hyper)
        module_args = _check_other_arguments(spec, others)

        inner = TableBatchedEmbeddingBags(
            tables, optimizer=spec, pooling=pooling.lower(), weights_dtype=_WEIGHT_PRECISIONS[precision],
            output_dtype=_PRECISIONS[out_precision],
            stochastic_rounding=stochastic_rounding, device=dev, feature_table_map=feature_table_map,
            placements=placements, **cache_args, **module_args, **hyper,
        )
        # Held outside nn.Module's registry so that state_dict() is this class's FBGEMM-shaped one
        # (see _save_to_state_dict); _apply below moves it with .to()/.cuda()/.cpu().
        object.__setattr__(self, "_tbe", inner)
        # As FBGEMM, the arguments as given (fbgemm_gpu's enums stay fbgemm_gpu's enums) ...
        self.optimizer = optimizer
        self.pooling_mode = pooling_mode
        self.weights_precision = weights_precision
        self.embedding_specs = [tuple(s) for s in embedding_specs]
        self.feature_table_map: List[int] = list(inner.layout.feature_table_map)
        self.stochastic_rounding = bool(stochastic_rounding)
        self.bounds_check_mode_int: int = BoundsCheckMode[bounds].value
        # ... and what they were resolved to.
        self.optimizer_name: str = spec.name  # the tbegen spec
        self.fbgemm_optimizer: Optional[str] = fbgemm_name  # FBGEMM's EmbOptimType member name, if any
        self._bounds_check: str = bounds
        # FBGEMM's use_writeback_bwd_prehook / writeback_first_feature_only (see forward)
        self.use_writeback_bwd_prehook: bool = writeback
        # FBGEMM's optimizer arguments as given (optimizer_args reads the spec's current values first)
        self._fbgemm_values = dict(fbgemm_values, weight_decay_mode=WeightDecayMode[mode].value,
                                   max_gradient=float(others.get("max_gradient", 1.0) or 1.0))
        # FBGEMM's step bookkeeping that its V1 operator path reads and writes (see `iter`)
        self._iter_buffer = torch.zeros(1, dtype=torch.int64)
        self._iter_written = 0
        self.iter_cpu = torch.zeros(1, dtype=torch.int64)
        self.timestep = 0
        self.timesteps_prefetched: List[int] = []
        self.lxu_cache_locations_list: List[torch.Tensor] = []
        self.lxu_cache_locations_empty = torch.empty(0, dtype=torch.int32, device=dev)
        self.lxu_cache_locations = self.lxu_cache_locations_empty
        self._host_parameter: Optional[nn.Parameter] = None
        self._writeback_first_feature_only: bool = writeback_first_feature_only
        # FBGEMM's counter weight decay mode ADAGRADW (3) with COUNTER: get_optimizer_state lists "iter"
        self._counter_adagradw = mode == "COUNTER" and counter_hyper.get("weight_decay_mode") == 3 if mode in (
            "COUNTER", "COWCLIP") else False
        self._warned_bounds = False
        # (CUDA: the WARNING bounds check's finding, read by a later call without a host wait:
        # (event, pinned [count, position, value, feature, its table's rows]); _poll_bounds_warning)
        self._bounds_pending = None
        # Rows of the table each feature reads: the bounds check's limit per feature.
        self._rows_per_feature = torch.tensor(
            [tables[t][0] for t in self.feature_table_map], dtype=torch.int64, device=dev
        )

    # ---- the tbegen module underneath ----

    @property
    def tbe(self) -> TableBatchedEmbeddingBags:
        """The `tbegen.TableBatchedEmbeddingBags` doing the work."""
        return self._tbe

    def _apply(self, fn, recurse=True):
        self._tbe._apply(fn)
        self._rows_per_feature = fn(self._rows_per_feature)
        return super()._apply(fn, recurse)

    @property
    def current_device(self) -> torch.device:
        return self._tbe.weights.device

    @property
    def iter(self) -> torch.Tensor:
        """The step counter as FBGEMM holds it: int64 [1] (updates done so far). As in FBGEMM it is
        writable: a value written into it (FBGEMM's V1 operator path does `iter.add_(1)`) becomes
        the module's step counter."""
        self._sync_iter()
        buf = self._iter_buffer
        buf[0] = self._iter_written = self._tbe.step
        return buf

    def _sync_iter(self) -> None:
        """A value written into `iter` since it was handed out becomes the module's step counter
        (called by `iter`, forward and state_dict)."""
        held = int(self._iter_buffer[0])
        if held != self._iter_written:
            if held < 0:
                raise ValueError(f"tbegen: iter was set to {held}; the step counter must be non-negative")
            self._tbe._step = held
            self._iter_written = held

    # FBGEMM's flat buffers, as the tensors of this module (writes into them are the module's):
    # weights_{dev,host,uvm} and {momentum1,momentum2,prev_iter,row_counter}_{dev,host,uvm}, each
    # with per-feature _offsets (int64) and _placements (int32). The data is in the buffer of
    # the module's memory (host on the CPU, dev on a GPU, uvm with managed tables); the other two
    # are empty. tbegen lays its flat buffers out as FBGEMM does (table after table, rows
    # row-major; per-row states one entry per row), so FBGEMM's offsets index them unchanged.

    def _flat_buffer(self, name: str, where: str) -> torch.Tensor:
        tbe = self._tbe
        suffix, _ = self._state_keys()
        if name == "weights":
            buf = tbe.weights
        else:
            spec_name = self._fbgemm_state_names().get(name)
            buf = tbe.optimizer_state(spec_name) if spec_name is not None else None
            if buf is None:
                return torch.empty(0, dtype=torch.float32, device=tbe.weights.device)
        if where != suffix:
            return buf.new_empty(0)
        if name == "weights" and where == "host" and buf.dtype.is_floating_point:
            # FBGEMM's CPU weights are an nn.Parameter (its V1 CPU operator's autograd needs one):
            # a Parameter on the same storage, kept while the storage is the same.
            p = self._host_parameter
            if p is None or p.data_ptr() != buf.data_ptr() or p.shape != buf.shape or p.dtype != buf.dtype:
                p = nn.Parameter(buf.detach(), requires_grad=True)
                object.__setattr__(self, "_host_parameter", p)
            return p
        return buf.detach()

    def _fbgemm_state_names(self) -> Dict[str, str]:
        """FBGEMM's buffer name (momentum1, momentum2, prev_iter, row_counter) -> the spec's state."""
        spec = self._tbe.spec
        return {_state_key(spec.name, k): s.name for k, s in enumerate(spec.states, start=1)}

    def _per_feature_offsets(self, name: str) -> torch.Tensor:
        tbe = self._tbe
        layout = tbe.layout
        if name == "weights":
            bases = _weights_layout(tbe)[0]
        else:
            spec_name = self._fbgemm_state_names().get(name)
            if spec_name is None:
                return torch.empty(0, dtype=torch.int64, device=tbe.weights.device)
            per = next(s.per for s in tbe.spec.states if s.name == spec_name)
            bases = layout.table_offsets if per == "element" else layout.table_key_base
        return torch.tensor([bases[t] for t in layout.feature_table_map], dtype=torch.int64, device=tbe.weights.device)

    def _per_feature_placements(self, name: str) -> torch.Tensor:
        tbe = self._tbe
        if name != "weights" and name not in self._fbgemm_state_names():
            return torch.empty(0, dtype=torch.int32, device=tbe.weights.device)
        _, placement = self._state_keys()
        return torch.tensor([placement[t] for t in tbe.layout.feature_table_map], dtype=torch.int32,
                            device=tbe.weights.device)

    @property
    def D_offsets(self) -> torch.Tensor:
        """int32 [F + 1]: where each feature's columns start in the pooled output."""
        layout = self._tbe.layout
        dims = [layout.tables[t][1] for t in layout.feature_table_map]
        return torch.tensor([sum(dims[:f]) for f in range(len(dims) + 1)], dtype=torch.int32,
                            device=self._tbe.weights.device)

    @property
    def total_D(self) -> int:
        layout = self._tbe.layout
        return sum(layout.tables[t][1] for t in layout.feature_table_map)

    @property
    def max_D(self) -> int:
        return max(D for _, D in self._tbe.layout.tables)

    @property
    def hash_size_cumsum(self) -> torch.Tensor:
        """int64 [F + 1]: each feature's table's first row in the rows of all tables, then the total."""
        layout = self._tbe.layout
        starts = [sum(E for E, _ in layout.tables[:t]) for t in range(len(layout.tables) + 1)]
        return torch.tensor([starts[t] for t in layout.feature_table_map] + [starts[-1]], dtype=torch.int64,
                            device=self._tbe.weights.device)

    @property
    def total_hash_size(self) -> int:
        return sum(E for E, _ in self._tbe.layout.tables)

    @property
    def total_hash_size_bits(self) -> int:
        # FBGEMM's: bits to hold a linear index into all tables' rows (0 for empty tables)
        total = self.total_hash_size
        return int(math.log2(float(total)) + 1) if total > 0 else 0

    @property
    def rows_per_table(self) -> torch.Tensor:
        """int64 [F]: the rows of each feature's table (FBGEMM's name)."""
        layout = self._tbe.layout
        return torch.tensor([layout.tables[t][0] for t in layout.feature_table_map], dtype=torch.int64,
                            device=self._tbe.weights.device)

    @property
    def learning_rate_tensor(self) -> torch.Tensor:
        """The learning rate as FBGEMM holds it: a float32 scalar tensor on the CPU (a copy)."""
        return torch.tensor(self._tbe.hyperparameters.get("learning_rate", self._fbgemm_values["learning_rate"]),
                            dtype=torch.float32)

    @property
    def _used_rowwise_adagrad_with_counter(self) -> bool:
        return self._tbe.spec.name == COUNTER_SPEC

    @property
    def optimizer_args(self) -> "OptimizerArgs":
        """FBGEMM's optimizer_args: the optimizer's hyperparameters under FBGEMM's field names
        (the spec's current values where it has them, else FBGEMM's constructor values)."""
        h = self._tbe.hyperparameters
        v = self._fbgemm_values

        def get(name, default):
            return h[name] if name in h else v.get(name, default)

        return OptimizerArgs(
            stochastic_rounding=self.stochastic_rounding, gradient_clipping=False,
            max_gradient=v["max_gradient"], max_norm=get("max_norm", 0.0),
            learning_rate=get("learning_rate", 0.01), eps=get("eps", 1.0e-8), beta1=get("beta1", 0.9),
            beta2=get("beta2", 0.999), step_ema=float(h.get("step_ema", -1)), step_swap=float(h.get("step_swap", -1)),
            step_start=float(h.get("step_start", -1)), step_mode=int(h.get("step_mode", 0)),
            weight_decay=get("weight_decay", 0.0), weight_decay_mode=int(get("weight_decay_mode", 0)),
            eta=get("eta", 0.001), momentum=get("momentum", 0.9),
            counter_halflife=int(h.get("counter_halflife", -1)), adjustment_iter=int(h.get("adjustment_iter", -1)),
            adjustment_ub=float(h.get("adjustment_ub", 1.0)), learning_rate_mode=int(h.get("learning_rate_mode", -1)),
            grad_sum_decay=-1, tail_id_threshold=float(h.get("tail_id_threshold", 0.0)),
            is_tail_id_thresh_ratio=int(h.get("is_tail_id_thresh_ratio", 0)),
            total_hash_size=self.total_hash_size,
            weight_norm_coefficient=float(h.get("weight_norm_coefficient", 0.0)),
            lower_bound=float(h.get("lower_bound", 0.0)),
            regularization_mode=int(h.get("regularization_mode", 0)),
            use_rowwise_bias_correction=False,
        )

    weights_dev = property(lambda self: self._flat_buffer('weights', 'dev'))
    weights_host = property(lambda self: self._flat_buffer('weights', 'host'))
    weights_uvm = property(lambda self: self._flat_buffer('weights', 'uvm'))
    weights_offsets = property(lambda self: self._per_feature_offsets('weights'))
    weights_placements = property(lambda self: self._per_feature_placements('weights'))
    momentum1_dev = property(lambda self: self._flat_buffer('momentum1', 'dev'))
    momentum1_host = property(lambda self: self._flat_buffer('momentum1', 'host'))
    momentum1_uvm = property(lambda self: self._flat_buffer('momentum1', 'uvm'))
    momentum1_offsets = property(lambda self: self._per_feature_offsets('momentum1'))
    momentum1_placements = property(lambda self: self._per_feature_placements('momentum1'))
    momentum2_dev = property(lambda self: self._flat_buffer('momentum2', 'dev'))
    momentum2_host = property(lambda self: self._flat_buffer('momentum2', 'host'))
    momentum2_uvm = property(lambda self: self._flat_buffer('momentum2', 'uvm'))
    momentum2_offsets = property(lambda self: self._per_feature_offsets('momentum2'))
    momentum2_placements = property(lambda self: self._per_feature_placements('momentum2'))
    prev_iter_dev = property(lambda self: self._flat_buffer('prev_iter', 'dev'))
    prev_iter_host = property(lambda self: self._flat_buffer('prev_iter', 'host'))
    prev_iter_uvm = property(lambda self: self._flat_buffer('prev_iter', 'uvm'))
    prev_iter_offsets = property(lambda self: self._per_feature_offsets('prev_iter'))
    prev_iter_placements = property(lambda self: self._per_feature_placements('prev_iter'))
    row_counter_dev = property(lambda self: self._flat_buffer('row_counter', 'dev'))
    row_counter_host = property(lambda self: self._flat_buffer('row_counter', 'host'))
    row_counter_uvm = property(lambda self: self._flat_buffer('row_counter', 'uvm'))
    row_counter_offsets = property(lambda self: self._per_feature_offsets('row_counter'))
    row_counter_placements = property(lambda self: self._per_feature_placements('row_counter'))

    # ---- FBGEMM's input preparation and prefetch bookkeeping (its V1 operator path calls them) ----

    def prepare_inputs(self, indices: torch.Tensor, offsets: torch.Tensor,
                       per_sample_weights: Optional[torch.Tensor] = None,
                       batch_size_per_feature_per_rank: Optional[List[List[int]]] = None,
                       force_cast_input_types: bool = True, prefetch_pipeline: bool = False,
                       vbe_output: Optional[torch.Tensor] = None, vbe_output_offsets: Optional[torch.Tensor] = None):
        """FBGEMM's prepare_inputs: (indices, offsets, per_sample_weights, vbe_metadata), the
        inputs as FBGEMM's operators take them: offsets in the indices' dtype (int64 when the two
        differ or force_cast_input_types), per-sample weights float32, out-of-range indices
        handled by bounds_check_mode (FATAL: an error; WARNING/IGNORE: set to 0), and the
        variable-batch metadata (all None / -1 without batch_size_per_feature_per_rank)."""
        if vbe_output is not None or vbe_output_offsets is not None:
            raise NotImplementedError("tbegen: vbe_output / vbe_output_offsets (a preallocated VBE output) are not supported")
        if not isinstance(indices, torch.Tensor) or not isinstance(offsets, torch.Tensor):
            raise TypeError("tbegen: indices and offsets must be tensors")
        meta = self._vbe_metadata(offsets, batch_size_per_feature_per_rank)
        if indices.dtype != offsets.dtype or force_cast_input_types:
            if indices.dtype != offsets.dtype:
                indices = indices.to(torch.int64)
            offsets = offsets.to(indices.dtype)
            if per_sample_weights is not None:
                per_sample_weights = per_sample_weights.float()
        if self._bounds_check != "NONE":
            bags = offsets if meta.B_offsets is None else self._padded_offsets(offsets, batch_size_per_feature_per_rank)
            if self._bounds_check == "FATAL":
                feature = self._feature_of_each_index(bags, indices.numel())
                if feature is None:
                    raise ValueError("tbegen: offsets must be F * B + 1 non-decreasing entries from 0 to the number of indices")
                bad = (indices < 0) | (indices >= self._rows_per_feature[feature])
                if bool(bad.any()):
                    first = int(bad.nonzero()[0, 0])
                    raise IndexError(f"tbegen: indices[{first}] = {int(indices[first])} is out of range of feature "
                                     f"{int(feature[first])}'s table ({int(self._rows_per_feature[feature[first]])} rows)")
            else:
                indices = self._zero_out_of_range(indices, bags)
        return indices, offsets, per_sample_weights, meta

    def _padded_offsets(self, offsets: torch.Tensor, batch_size_per_feature_per_rank) -> torch.Tensor:
        """The offsets of a variable batch with each feature padded to the largest batch by empty
        bags at its end (same indices, same order): the fixed-batch bags of the same lookups."""
        totals = [sum(b) for b in batch_size_per_feature_per_rank]
        B = max(totals)
        lengths = offsets[1:].to(torch.int64) - offsets[:-1].to(torch.int64)
        padded = torch.zeros(len(totals) * B, dtype=torch.int64, device=offsets.device)
        start = 0
        for f, n in enumerate(totals):
            padded[f * B : f * B + n] = lengths[start : start + n]
            start += n
        return torch.cat([padded.new_zeros(1), padded.cumsum(0)]).to(offsets.dtype)

    def _vbe_metadata(self, offsets: torch.Tensor, batch_size_per_feature_per_rank) -> "VBEMetadata":
        """FBGEMM's VBE metadata: for each feature f and rank r with batch B[f][r]: B_offsets
        (int32 [F + 1], each feature's first bag), B_offsets_rank_per_feature (int32 [F, R + 1],
        each rank's first bag within its feature), output_offsets_feature_rank (int64 [R * F + 1],
        where (rank r, feature f) starts in the rank-major 1-D output), max_B (the largest
        per-feature batch), max_B_feature_rank (the largest B[f][r]) and output_size."""
        if batch_size_per_feature_per_rank is None:
            return VBEMetadata(None, None, None, -1, -1, -1)
        F = self._tbe.num_features
        sizes = [[int(b) for b in row] for row in batch_size_per_feature_per_rank]
        if len(sizes) != F or len({len(row) for row in sizes}) != 1 or not sizes[0] or any(b < 0 for row in sizes for b in row):
            raise ValueError(
                f"tbegen: batch_size_per_feature_per_rank must be {F} lists (one per feature) of the same number of "
                f"non-negative per-rank batch sizes, got {batch_size_per_feature_per_rank!r}"
            )
        total = sum(sum(row) for row in sizes)
        if offsets.numel() != total + 1:
            raise ValueError(f"tbegen: batch_size_per_feature_per_rank sums to {total} bags, offsets has "
                             f"{offsets.numel() - 1}")
        R = len(sizes[0])
        layout = self._tbe.layout
        dims = [layout.tables[t][1] for t in layout.feature_table_map]
        dev = offsets.device
        B_offsets = [0]
        for row in sizes:
            B_offsets.append(B_offsets[-1] + sum(row))
        rank_offsets = [[sum(row[:r]) for r in range(R + 1)] for row in sizes]
        out_offsets = [0]
        for r in range(R):
            for f in range(F):
                out_offsets.append(out_offsets[-1] + sizes[f][r] * dims[f])
        return VBEMetadata(
            B_offsets=torch.tensor(B_offsets, dtype=torch.int32, device=dev),
            output_offsets_feature_rank=torch.tensor(out_offsets, dtype=torch.int64, device=dev),
            B_offsets_rank_per_feature=torch.tensor(rank_offsets, dtype=torch.int32, device=dev),
            max_B_feature_rank=max(b for row in sizes for b in row),
            max_B=max(sum(row) for row in sizes),
            output_size=out_offsets[-1],
        )

    def _prefetch(self, indices: torch.Tensor, offsets: torch.Tensor, vbe_metadata: Any = None,
                  multipass_prefetch_config: Any = None, hash_zch_identities: Optional[torch.Tensor] = None,
                  hash_zch_runtime_meta: Optional[torch.Tensor] = None) -> None:
        """FBGEMM's internal prefetch step: counts a timestep and loads the batch's rows of
        MANAGED_CACHING tables into their caches (nothing to load without such tables)."""
        if multipass_prefetch_config is not None:
            raise NotImplementedError("tbegen: multipass_prefetch_config is not supported")
        self._check_hash_zch("hash_zch_identities", hash_zch_identities, indices)
        self._check_hash_zch("hash_zch_runtime_meta", hash_zch_runtime_meta, indices)
        self.timestep += 1
        self.timesteps_prefetched.append(self.timestep)
        if any(p == "managed_caching" for p in self._tbe.placements):
            if vbe_metadata is not None and getattr(vbe_metadata, "B_offsets", None) is not None:
                raise NotImplementedError("tbegen: _prefetch of a variable batch (VBE metadata) is not supported")
            self._tbe.prefetch(indices, offsets)

    # ---- forward ----

    def forward(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        per_sample_weights: Optional[torch.Tensor] = None,
        feature_requires_grad: Optional[torch.Tensor] = None,
        batch_size_per_feature_per_rank: Optional[List[List[int]]] = None,
        total_unique_indices: Optional[int] = None,
        **unsupported,
    ) -> torch.Tensor:
        """Pooled lookup: float32 [B, total_D] (SUM, MEAN) or [N, dim] (NONE). The backward that
        runs through the output applies the optimizer (FBGEMM's semantics; see docs/module.md).

        `feature_requires_grad` (int or bool, one entry per feature): the per-sample weights of a
        feature with 0 get no gradient. `total_unique_indices` is accepted and not needed.
        """
        unknown = [k for k in unsupported if k not in _FORWARD_UNSUPPORTED]
        if unknown:
            raise TypeError(f"tbegen: forward() got unexpected argument(s) {', '.join(unknown)}")
        self._sync_iter()
        for name in ("hash_zch_identities", "hash_zch_runtime_meta"):
            self._check_hash_zch(name, unsupported.pop(name, None), indices)
        if self.use_writeback_bwd_prehook and batch_size_per_feature_per_rank is not None:
            raise ValueError("tbegen: use_writeback_bwd_prehook does not take batch_size_per_feature_per_rank "
                             "(variable batch size; as in FBGEMM)")
        given = [k for k, v in unsupported.items() if v is not None]
        if given:
            raise NotImplementedError(f"tbegen: forward argument(s) {', '.join(given)} are not supported")
        # With variable batch sizes (VBE) the helpers below see the bags as the module runs them:
        # each feature padded to the largest batch with empty bags (same indices, same order).
        bags, prepared = offsets, None
        if batch_size_per_feature_per_rank is not None and (
                per_sample_weights is not None and feature_requires_grad is not None
                or self._bounds_check in ("WARNING", "IGNORE")):
            if torch.compiler.is_compiling():  # (the plan built eagerly: a graph break)
                bags = self._tbe.vbe_padded_offsets(offsets, batch_size_per_feature_per_rank)
            else:
                # (the plan and the padded offsets as the module's VBE forward finds or makes
                # them, handed to that forward below: it does not look them up and gather again)
                prepared = self._tbe._vbe_prepare(offsets, batch_size_per_feature_per_rank)
                bags = prepared[1]
        if self._bounds_check in ("WARNING", "IGNORE") and isinstance(indices, torch.Tensor):
            indices = self._zero_out_of_range(indices, bags)
        if per_sample_weights is not None and feature_requires_grad is not None:
            per_sample_weights = self._mask_weight_gradient(per_sample_weights, bags, feature_requires_grad)
        # (FBGEMM's periodic max_counter refresh is the spec's own reduce stage, run by the module
        # before the forward of the steps that max_counter_update_freq divides)
        if batch_size_per_feature_per_rank is not None:
            # FBGEMM's VBE output: 1-D, rank-major (for each rank, each feature's B[f][r] x D_f)
            if prepared is None:
                return self._tbe(indices, offsets, per_sample_weights,
                                 batch_size_per_feature_per_rank=batch_size_per_feature_per_rank)
            return self._tbe._call_with_vbe_plan(prepared, indices, offsets, per_sample_weights,
                                                 batch_size_per_feature_per_rank)
        out = self._tbe(indices, offsets, per_sample_weights)
        if self.use_writeback_bwd_prehook and torch.is_grad_enabled() and out.requires_grad:
            out = _KeepGradient.apply(out, self._writeback_keep(indices, offsets))
        return out

    @staticmethod
    def _check_hash_zch(name: str, value, indices) -> None:
        """FBGEMM's hash_zch_identities / hash_zch_runtime_meta: per index, the raw id before the
        zero-collision-hash remapping and its metadata. FBGEMM keeps them only for raw embedding
        streaming (enable_raw_embedding_streaming, refused by this class); its lookup and update
        never read them. So: None, or one integer row per index (checked), with no effect."""
        if value is None:
            return
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"tbegen: {name} must be a tensor or None, got {type(value).__name__}")
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"tbegen: {name} must be an integer tensor, got {value.dtype}")
        n = indices.numel() if isinstance(indices, torch.Tensor) else None
        if value.dim() not in (1, 2) or (n is not None and value.shape[0] != n):
            raise ValueError(f"tbegen: {name} must have one row per index ({n}), got shape {list(value.shape)}")

    def _writeback_keep(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """FBGEMM's writeback (use_writeback_bwd_prehook, EXACT_SGD): the backward updates each
        looked-up row from its first lookup only, so that with SGD a batch assigns rows instead of
        summing into them. Of the lookups of one table row only the first (in index order) passes
        its output gradient; with writeback_first_feature_only only feature 0's lookups do, and the
        other features are read-only. Returns the mask for the output gradient: [N, 1] without
        pooling, [B, total_D] with pooling (each bag then holds at most one index: FBGEMM's
        writeback is defined for such bags)."""
        layout = self._tbe.layout
        n = indices.numel()
        feature = self._feature_of_each_index(offsets, n)
        if feature is None:
            raise ValueError("tbegen: offsets must be well formed (F * B + 1 entries from 0 to N, non-decreasing) "
                             "for the writeback (use_writeback_bwd_prehook)")
        device = indices.device
        idx = indices.reshape(-1).to(torch.int64)
        table = torch.tensor(layout.feature_table_map, dtype=torch.int64, device=device)[feature]
        keep = torch.zeros(n, dtype=torch.bool, device=device)
        candidates = torch.arange(n, device=device)
        if self._writeback_first_feature_only:
            candidates = candidates[feature == 0]
        if candidates.numel():
            # one key per (table, row); the first position of each key in index order
            key = table[candidates] * (int(idx.max()) + 1) + idx[candidates]
            order = torch.sort(key, stable=True).indices
            sorted_key = key[order]
            first = torch.ones_like(sorted_key, dtype=torch.bool)
            first[1:] = sorted_key[1:] != sorted_key[:-1]
            keep[candidates[order[first]]] = True
        if self._tbe.pooling == "none":
            return keep[:, None]
        F = layout.num_features
        lengths = offsets[1:].to(torch.int64) - offsets[:-1].to(torch.int64)
        if bool((lengths > 1).any()):
            raise ValueError(
                f"tbegen: use_writeback_bwd_prehook with pooling needs at most one index per bag, got a bag of "
                f"{int(lengths.max())} (a pooled bag has no single lookup to write back; FBGEMM's writeback is "
                f"defined for one index per bag)"
            )
        B = lengths.numel() // F
        bag_keep = torch.zeros(F * B, dtype=torch.bool, device=device)
        bag_of_index = torch.repeat_interleave(torch.arange(F * B, device=device), lengths, output_size=n)
        bag_keep[bag_of_index[keep]] = True
        dims = torch.tensor([layout.tables[t][1] for t in layout.feature_table_map], dtype=torch.int64, device=device)
        column_feature = torch.repeat_interleave(torch.arange(F, device=device), dims)
        return bag_keep.view(F, B).t()[:, column_feature]

    @property
    def max_counter(self) -> torch.Tensor:
        """FBGEMM's max_counter buffer: float32 [1] (the spec keeps it per table, all entries equal);
        ones(1), as FBGEMM's, for an optimizer without one."""
        if "max_counter" not in [s.name for s in self._tbe.spec.table_states]:
            return torch.ones(1, dtype=torch.float32, device=self._tbe.weights.device)
        return self._tbe.optimizer_state("max_counter")[:1].clone()

    def _feature_of_each_index(self, offsets: torch.Tensor, n: int) -> Optional[torch.Tensor]:
        """The feature each index belongs to, or None when the offsets are malformed (the
        operators then raise their error naming the problem)."""
        F = self._tbe.num_features
        if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.numel() < 1 or (offsets.numel() - 1) % F:
            return None
        offsets = offsets.to(torch.int64)
        lengths = offsets[1:] - offsets[:-1]
        if offsets[0].item() != 0 or offsets[-1].item() != n or bool((lengths < 0).any()):
            return None
        B = lengths.numel() // F
        bag_feature = torch.arange(F * B, device=offsets.device) // max(B, 1)
        return torch.repeat_interleave(bag_feature, lengths, output_size=n)

    def _zero_out_of_range(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """FBGEMM's WARNING / IGNORE bounds check: an index outside its table becomes 0."""
        if indices.dim() != 1 or indices.numel() == 0 or indices.device != self._rows_per_feature.device:
            return indices
        if indices.is_cuda:
            return self._zero_out_of_range_on_device(indices, offsets)
        feature = self._feature_of_each_index(offsets, indices.numel())
        if feature is None:
            return indices
        bad = (indices < 0) | (indices >= self._rows_per_feature[feature])
        if not bool(bad.any()):
            return indices
        if self._bounds_check == "WARNING" and not self._warned_bounds:
            self._warned_bounds = True
            first = int(bad.nonzero()[0, 0])
            warnings.warn(
                f"tbegen: {int(bad.sum())} index(es) out of range of their table (the first: indices[{first}] = "
                f"{int(indices[first])} for feature {int(feature[first])}, whose table has "
                f"{int(self._rows_per_feature[feature[first]])} rows); set to 0 (bounds_check_mode WARNING; "
                f"warned once per module)",
                stacklevel=3,
            )
        return torch.where(bad, torch.zeros_like(indices), indices)

    def _zero_out_of_range_on_device(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """_zero_out_of_range without a host wait (CUDA): each index's feature by a search of the
        features' first offsets (offsets that are not F * B + 1 entries: the indices as given, the
        operators name the problem), every index compared with its table's rows, the bad ones
        replaced, whether there are any or not. The WARNING's finding (count, first position, its
        value, feature and table rows) is copied to pinned memory behind an event and read by a later call
        once the GPU has got there (_poll_bounds_warning): the warning comes a step or so late,
        once per module, as FBGEMM's comes from its kernel. (FBGEMM's GPU bounds check likewise
        fixes the indices on the device and does not stop the host.)"""
        self._poll_bounds_warning()
        F = self._tbe.num_features
        if not isinstance(offsets, torch.Tensor) or offsets.dim() != 1 or offsets.numel() < 1 or (offsets.numel() - 1) % F:
            return indices
        B = (offsets.numel() - 1) // F
        n = indices.numel()
        starts = offsets[::B] if B > 0 else offsets[:1]  # (each feature's first offset, then the end)
        feature = (torch.searchsorted(starts.to(torch.int64).contiguous(), torch.arange(n, device=indices.device),
                                      right=True) - 1)
        feature = feature.clamp_(0, F - 1)
        rows = self._rows_per_feature[feature]
        bad = (indices < 0) | (indices >= rows)
        if self._bounds_check == "WARNING" and not self._warned_bounds and self._bounds_pending is None:
            # (the first bad one's entries picked by index_select with a 1-element index: x[t] with
            # a 0-d tensor t reads t on the host, TensorIndexing.h's item(), a wait on the GPU)
            first = torch.argmax(bad.to(torch.uint8)).reshape(1)  # (0 when none is bad: the count says so)
            finding = torch.cat([bad.sum().reshape(1), first, indices.index_select(0, first).to(torch.int64),
                                 feature.index_select(0, first), rows.index_select(0, first)])
            on_gpu = indices.is_cuda  # (the CPU runs this too, in tests: no event there)
            pinned = torch.empty(5, dtype=torch.int64, pin_memory=on_gpu)
            pinned.copy_(finding, non_blocking=on_gpu)
            event = torch.cuda.Event() if on_gpu else None
            if event is not None:
                event.record(torch.cuda.current_stream(indices.device))
            self._bounds_pending = (event, pinned)
        return torch.where(bad, torch.zeros_like(indices), indices)

    def _poll_bounds_warning(self, wait: bool = False) -> None:
        """Warns (once per module) of out-of-range indices that _zero_out_of_range_on_device found,
        when the GPU has reached the copy of its finding (or, with `wait`, after waiting for it)."""
        pending = self._bounds_pending
        if pending is None:
            return
        event, pinned = pending
        if event is not None:
            if not wait and not event.query():
                return
            event.synchronize()
        self._bounds_pending = None
        count, first, value, feature, rows = (int(v) for v in pinned.tolist())  # (host memory: no wait)
        if count and not self._warned_bounds:
            self._warned_bounds = True
            warnings.warn(
                f"tbegen: {count} index(es) out of range of their table (the first: indices[{first}] = {value} for "
                f"feature {feature}, whose table has {rows} rows); set to 0 "
                f"(bounds_check_mode WARNING; warned once per module, on the GPU a call or so after the batch)",
                stacklevel=4,
            )

    def _mask_weight_gradient(self, per_sample_weights, offsets, feature_requires_grad):
        F = self._tbe.num_features
        if not isinstance(feature_requires_grad, torch.Tensor) or feature_requires_grad.numel() != F:
            raise ValueError(f"tbegen: feature_requires_grad must be a tensor with one entry per feature ({F})")
        if not isinstance(per_sample_weights, torch.Tensor) or not per_sample_weights.requires_grad:
            return per_sample_weights
        feature = self._feature_of_each_index(offsets, per_sample_weights.numel())
        if feature is None:
            raise ValueError("tbegen: offsets must be well formed (F * B + 1 entries from 0 to N, non-decreasing) "
                             "to apply feature_requires_grad")
        keep = feature_requires_grad.to(device=per_sample_weights.device, dtype=torch.bool)[feature]
        # Same values; the gradient flows only into the weights of features that require it.
        return torch.where(keep, per_sample_weights, per_sample_weights.detach())

    # ---- weights, states, hyperparameters ----

    def split_embedding_weights(self) -> List[torch.Tensor]:
        """Per table, a [rows, dim] view of the weights (writable); for INT8, as FBGEMM, a uint8
        [rows, dim + 8] view of the stored rows (codes, then float32 scale and bias)."""
        if self._tbe.int8:
            return self._tbe.split_int8_rows()
        return self._tbe.split_embedding_weights()

    def split_optimizer_states(self) -> List[List[torch.Tensor]]:
        """Per table, the list of its optimizer states in FBGEMM's order (momentum1, momentum2):
        per-element states [rows, dim], per-row states [rows]. Like FBGEMM, an empty list for an
        optimizer without states (EXACT_SGD)."""
        names = [s.name for s in self._tbe.spec.states]
        if not names:
            return []
        return [[views[n] for n in names] for views in self._tbe.split_optimizer_states()]

    def get_optimizer_state(self) -> List[Dict[str, torch.Tensor]]:
        """Per table, {name: state}, with FBGEMM's (torch.optim's) names where FBGEMM has them
        ('sum', 'exp_avg', 'exp_avg_sq'), else the spec's state names."""
        spec_names = [s.name for s in self._tbe.spec.states]
        names = _OPTIMIZER_STATE_NAMES.get(self._tbe.spec.name, tuple(spec_names))
        states = [dict(zip(names, [views[n] for n in spec_names])) for views in self._tbe.split_optimizer_states()]
        if self._counter_adagradw:
            # FBGEMM lists the step counter too with COUNTER and counter weight decay ADAGRADW
            for d in states:
                d["iter"] = self.iter
        return states

    def init_embedding_weights_uniform(self, min_val: float, max_val: float) -> None:
        """Refills every table from uniform(min_val, max_val), drawn from torch's global generator."""
        with torch.no_grad():
            if self._tbe.int8:  # (drawn in float32, then quantized row by row)
                for t, (E, D) in enumerate(self._tbe.tables):
                    self._tbe.load_table_weights(t, torch.empty(E, D).uniform_(min_val, max_val))
                return
            for table in self.split_embedding_weights():
                table.uniform_(min_val, max_val)

    def set_learning_rate(self, lr: float) -> None:
        self._tbe.set_learning_rate(lr)

    def get_learning_rate(self) -> float:
        # FBGEMM keeps the learning rate in a float32 tensor and returns that value.
        return float(torch.tensor(self._tbe.get_learning_rate(), dtype=torch.float32))

    def update_hyper_parameters(self, params_dict: Dict[str, float]) -> None:
        """FBGEMM's setter: 'lr' is the learning rate; other keys are hyperparameter names."""
        values = {("learning_rate" if k == "lr" else k): v for k, v in params_dict.items()}
        self._tbe.set_hyperparameters(**values)

    def set_optimizer_step(self, step: int) -> None:
        """Sets the step counter (the next update runs with step + 1)."""
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"tbegen: step must be a non-negative int, got {step!r}")
        self._tbe._step = int(step)  # the module's counter; no public setter by design

    def flush(self) -> None:
        """Writes the MANAGED_CACHING tables' changed cached rows back to their managed memory
        (nothing to do without such tables)."""
        self._tbe.flush()

    def prefetch(self, indices: torch.Tensor, offsets: torch.Tensor, forward_stream: Any = None,
                 batch_size_per_feature_per_rank: Optional[List[List[int]]] = None) -> None:
        """FBGEMM's prefetch: loads the rows a batch reads of MANAGED_CACHING tables into their
        caches ahead of `forward` with the same tensors (and, for a variable batch, the same
        `batch_size_per_feature_per_rank`), on the current stream. `forward_stream`: the stream
        the forward will run on (CUDA; the module's prefetch orders the two streams itself, see
        docs/placements.md). Out-of-range indices are treated as `forward` treats them."""
        if self._bounds_check in ("WARNING", "IGNORE") and isinstance(indices, torch.Tensor):
            # (the same tensor forward will make of them, so the prefetch is the forward's; a
            # variable batch's bags as forward sees them, padded)
            bags = offsets
            if batch_size_per_feature_per_rank is not None:
                if self._tbe._cache is not None:  # (as the module's prefetch: a kept plan may be the
                    # last forward's, on its stream, and the padding reads it)
                    self._tbe._cache_order.enter(self._tbe.weights.device, lookup=True)
                bags = self._tbe.vbe_padded_offsets(offsets, batch_size_per_feature_per_rank)
            indices = self._zero_out_of_range(indices, bags)
        self._tbe.prefetch(indices, offsets, forward_stream=forward_stream,
                           batch_size_per_feature_per_rank=batch_size_per_feature_per_rank)

    def cache_stats(self) -> Dict[str, Any]:
        """The MANAGED_CACHING tables' cache counters (tbegen's `cache_stats`)."""
        return self._tbe.cache_stats()

    # ---- state_dict: FBGEMM's keys ----

    def _state_keys(self) -> Tuple[str, List[int]]:
        """FBGEMM's buffer suffix and each table's placement code for where the tensors live.
        With a MANAGED or MANAGED_CACHING table the whole flat buffer is one managed allocation
        (tbegen/placement.py), so every feature is recorded in FBGEMM's unified-memory buffer
        ("uvm"), DEVICE tables too (as MANAGED); MANAGED_CACHING tables keep their code (the
        cached rows are written back first)."""
        tbe = self._tbe
        T = len(tbe.layout.tables)
        if not tbe.weights.is_cuda:
            return "host", [EmbeddingLocation.HOST.value] * T
        if any(p in ("managed", "managed_caching", "host") for p in tbe.placements):
            # ("host" tables: FBGEMM's MANAGED with uvm_host_mapped, recorded as MANAGED)
            return "uvm", [EmbeddingLocation.MANAGED_CACHING.value if p == "managed_caching" else
                           EmbeddingLocation.MANAGED.value for p in tbe.placements]
        return "dev", [EmbeddingLocation.DEVICE.value] * T

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        tbe = self._tbe
        tbe.flush()  # (MANAGED_CACHING tables: the rows changed in their caches)
        self._sync_iter()
        suffix, placement = self._state_keys()
        layout = tbe.layout
        F = layout.num_features
        device = tbe.weights.device

        def per_feature(values):
            return torch.tensor([values[t] for t in layout.feature_table_map], dtype=torch.int64, device=device)

        placements = torch.tensor([placement[t] for t in layout.feature_table_map], dtype=torch.int32, device=device)
        destination[prefix + "weights_" + suffix] = tbe.weights if keep_vars else tbe.weights.detach()
        destination[prefix + "weights_offsets"] = per_feature(_weights_layout(tbe)[0])
        destination[prefix + "weights_placements"] = placements
        for k, s in enumerate(tbe.spec.states, start=1):
            buf = tbe.optimizer_state(s.name)
            name = _state_key(tbe.spec.name, k)
            if buf.dtype != torch.float32:
                buf = buf.to(torch.float32)  # FBGEMM keeps prev_iter as float32 (a copy, not a view)
            destination[prefix + f"{name}_{suffix}"] = buf if keep_vars else buf.detach()
            bases = layout.table_offsets if s.per == "element" else layout.table_key_base
            destination[prefix + f"{name}_offsets"] = per_feature(bases)
            destination[prefix + f"{name}_placements"] = placements.clone()
        if "max_counter" in [s.name for s in tbe.spec.table_states]:
            # FBGEMM's one max_counter (the spec's per-table copies are all equal: `over: all`)
            destination[prefix + "max_counter"] = tbe.optimizer_state("max_counter")[:1].detach().clone()
        destination[prefix + "iter"] = torch.tensor([tbe.step], dtype=torch.int64, device=device)
        destination[prefix + "_extra_state"] = self.get_extra_state()

    def get_extra_state(self) -> Dict[str, Any]:
        return {"tbegen": self._tbe.get_extra_state()}

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        mine = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix) and "." not in k[len(prefix):]}
        try:
            used = _load_fbgemm_tensors(self, mine)
        except _MissingKey as e:
            missing_keys.append(prefix + e.args[0])
            return
        except (ValueError, RuntimeError, TypeError) as e:
            error_msgs.append(str(e))
            return
        if strict:
            for key in mine:
                if key not in used and not _is_fbgemm_bookkeeping(key):
                    unexpected_keys.append(prefix + key)


class _MissingKey(KeyError):
    pass


# FBGEMM's state_dict entries that describe its layout, cache and statistics: checked where they
# can disagree with this module's layout (below), otherwise not needed.
_FBGEMM_BOOKKEEPING = {
    "placeholder_autograd_tensor", "D_offsets", "hash_size_cumsum", "rows_per_table", "bounds_check_warning",
    "feature_dims", "table_wise_cache_miss", "weights_uvm", "weights_dev", "weights_host",
}
_FBGEMM_BOOKKEEPING_PREFIXES = ("lxu_", "cache_", "uvm_cache", "local_uvm", "timestep")


def _is_fbgemm_bookkeeping(key: str) -> bool:
    return key in _FBGEMM_BOOKKEEPING or key.startswith(_FBGEMM_BOOKKEEPING_PREFIXES)


def _flat_tensor(entries: Dict[str, torch.Tensor], name: str, t_feature: List[int], sizes: List[int]) -> List[torch.Tensor]:
    """Per table, the slice of FBGEMM's buffer `name` (dev, host or uvm by its placement)."""
    for key in (f"{name}_offsets", f"{name}_placements"):
        if key not in entries:
            raise _MissingKey(key)
    offsets = entries[f"{name}_offsets"].tolist()
    placements = entries[f"{name}_placements"].tolist()
    buffers = {
        EmbeddingLocation.DEVICE.value: f"{name}_dev",
        EmbeddingLocation.HOST.value: f"{name}_host",
        EmbeddingLocation.MANAGED.value: f"{name}_uvm",
        EmbeddingLocation.MANAGED_CACHING.value: f"{name}_uvm",
    }
    out = []
    expected_numel: Dict[str, int] = {}
    for t, (f, size) in enumerate(zip(t_feature, sizes)):
        if f >= len(offsets) or f >= len(placements):
            raise ValueError(f"tbegen: the state_dict's {name}_offsets has {len(offsets)} entries, fewer than this module's features")
        key = buffers.get(int(placements[f]))
        if key is None:
            raise ValueError(f"tbegen: the state_dict's {name}_placements[{f}] = {placements[f]} is not a placement tbegen reads")
        if key not in entries:
            raise _MissingKey(key)
        buf = entries[key].reshape(-1)
        start = int(offsets[f])
        if start < 0 or start + size > buf.numel():
            raise ValueError(
                f"tbegen: the state_dict's {key} has {buf.numel()} elements; table {t} needs {size} from offset {start} "
                f"(a state_dict of another layout?)"
            )
        out.append(buf[start : start + size])
        expected_numel[key] = expected_numel.get(key, 0) + size
    # Each buffer holds exactly its tables: a state of another shape (e.g. FBGEMM's per-element
    # momentum1 of EXACT_ADAGRAD offered to the per-row state of EXACT_ROWWISE_ADAGRAD) is refused.
    for key, numel in expected_numel.items():
        if entries[key].numel() != numel:
            raise ValueError(
                f"tbegen: the state_dict's {key} has {entries[key].numel()} elements, this module's tables need {numel} "
                f"(another optimizer or layout?)"
            )
    return out


def _load_fbgemm_tensors(module: SplitTableBatchedEmbeddingBagsCodegen, entries: Dict[str, torch.Tensor]) -> set:
    """Copies weights, optimizer states and the step counter from FBGEMM-keyed entries (this
    class's state_dict or FBGEMM's own, any placement) into the module. Checks everything before
    writing anything. Returns the keys it used."""
    tbe = module._tbe
    layout = tbe.layout
    used = set()
    if "_extra_state" in entries:
        extra = entries["_extra_state"]
        if not isinstance(extra, dict) or "tbegen" not in extra:
            raise RuntimeError("tbegen: the state_dict's _extra_state was not written by tbegen's SplitTableBatchedEmbeddingBagsCodegen")
        used.add("_extra_state")
    # FBGEMM's per-feature layout description, where present, must be this module's.
    dims = [layout.tables[t][1] for t in layout.feature_table_map]
    rows = [layout.tables[t][0] for t in layout.feature_table_map]
    expect = {"rows_per_table": rows, "D_offsets": [sum(dims[:f]) for f in range(len(dims) + 1)]}
    for key, value in expect.items():
        if key in entries and [int(x) for x in entries[key].tolist()] != value:
            raise ValueError(
                f"tbegen: the state_dict's {key} is {entries[key].tolist()}, this module's is {value} "
                f"(different embedding_specs or feature_table_map)"
            )
    first_feature = [layout.feature_table_map.index(t) for t in range(len(layout.tables))]
    sizes = [E * D for E, D in layout.tables]
    weights = _flat_tensor(entries, "weights", first_feature, _weights_layout(tbe)[1])
    used |= {"weights_offsets", "weights_placements", "weights_dev", "weights_host", "weights_uvm"}
    for t, w in enumerate(weights):
        if w.dtype != tbe.weights_dtype:
            raise TypeError(f"tbegen: the state_dict's weights are {w.dtype}, this module's are {tbe.weights_dtype} (table {t})")
    states = []
    for k, s in enumerate(tbe.spec.states, start=1):
        name = _state_key(tbe.spec.name, k)
        sizes_k = sizes if s.per == "element" else [E for E, _ in layout.tables]
        parts = _flat_tensor(entries, name, first_feature, sizes_k)
        if any(p.dtype != torch.float32 for p in parts):
            raise TypeError(f"tbegen: the state_dict's {name} must be float32 (optimizer state {s.name!r})")
        states.append((s.name, parts))
        used |= {f"{name}_offsets", f"{name}_placements", f"{name}_dev", f"{name}_host", f"{name}_uvm"}
    for name in ("prev_iter", "row_counter") if tbe.spec.name != COUNTER_SPEC else ():
        for where in ("dev", "host", "uvm"):
            key = f"{name}_{where}"
            if key in entries and entries[key].numel():
                raise ValueError(
                    f"tbegen: the state_dict holds FBGEMM's {key} (counter-based or global weight decay): this module's optimizer has no such state (weight_decay_mode COUNTER or COWCLIP builds one that does)"
                )
    max_counter = None
    if "max_counter" in entries and "max_counter" in [s.name for s in tbe.spec.table_states]:
        value = entries["max_counter"]
        if value.numel() != 1 or not value.dtype.is_floating_point:
            raise ValueError(f"tbegen: the state_dict's max_counter must be one float, got {value.dtype} {list(value.shape)}")
        max_counter = float(value.reshape(-1)[0])
        used.add("max_counter")
    step = None
    if "iter" in entries:
        step = int(entries["iter"].reshape(-1)[0])
        if step < 0:
            raise ValueError(f"tbegen: the state_dict's iter must be non-negative, got {step}")
        used.add("iter")

    # Everything checked: write.
    if "_extra_state" in entries:
        tbe.set_extra_state(entries["_extra_state"]["tbegen"])
    with torch.no_grad():
        for dst, src in zip(tbe.split_int8_rows() if tbe.int8 else tbe.split_embedding_weights(), weights):
            dst.copy_(src.view(dst.shape))
        views = tbe.split_optimizer_states()
        for name, parts in states:
            for t, src in enumerate(parts):
                views[t][name].copy_(src.view(views[t][name].shape))
        if max_counter is not None:
            tbe.optimizer_state("max_counter").fill_(max_counter)
    if step is not None:
        tbe._step = step
    return used
