"""tbegen as a compute kernel of TorchRec's sharded EmbeddingBagCollection.

    from tbegen.torchrec import TbegenEmbeddingBagCollectionSharder
    apply_optimizer_in_backward(torch.optim.Adagrad, ebc.parameters(), {"lr": 0.05})   # TorchRec's way,
    sharder = TbegenEmbeddingBagCollectionSharder()      # read as TorchRec's FBGEMM kernel reads it (config.py)
    # or: TbegenEmbeddingBagCollectionSharder("adam", learning_rate=0.01)   # a tbegen spec, or a YAML path
    plan = EmbeddingShardingPlanner(topology, constraints=...).collective_plan(model, [sharder], pg)
    model = DistributedModelParallel(model, env=env, device=device, plan=plan, sharders=[sharder])

How it plugs in (the extension points NVIDIA's DynamicEmb uses as well; docs/torchrec.md):

- The sharder declares the sharding types it runs (table-wise, row-wise, column-wise, data-parallel,
  table-row-wise, table-column-wise, on every compute device: the fused tbegen kernel has a CPU
  path, so row-wise is offered on the CPU too) and the compute kernel of each.
- Its sharded module, a `ShardedEmbeddingBagCollection`, overrides `create_embedding_bag_sharding`
  to return TorchRec's sharding classes with one method changed: `create_lookup` builds a
  `TbegenPooledEmbeddingsLookup`, whose `_create_embedding_kernel` builds a `TbegenEmbeddingBag`
  (one tbegen `TableBatchedEmbeddingBags` over this rank's shards of one group of tables).
- Plans carry TorchRec's compute kernel value "fused" (an optimizer fused into the backward,
  weights and states in device memory) or, on GPUs, "fused_uvm" (the same, in managed memory:
  tbegen's placement "managed") and "fused_uvm_caching" (managed memory behind a GPU cache of hot
  rows: "managed_caching", sized by the plan's cache_load_factor per table); TorchRec groups them
  into one kernel, each table keeping its own placement: TorchRec's planner estimates, its sharded state_dict and
  its optimizer plumbing key on that value, and `TbegenEmbeddingBag` provides what they read from
  a fused kernel (per-table weight views, `fused_optimizer` with sharded states,
  `named_parameters_by_table`).

Input and output distribution (all-to-all, reduce-scatter, bucketisation of row-wise ids) stay
TorchRec's; each shard's lookup and fused update are tbegen's.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch import distributed as dist
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, TensorProperties
from torchrec.distributed.batched_embedding_kernel import BaseBatchedEmbeddingBag
from torchrec.distributed.composable.table_batched_embedding_slice import TableBatchedEmbeddingSlice
from torchrec.distributed.embedding_kernel import BaseEmbedding
from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, GroupedEmbeddingConfig
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder, ShardedEmbeddingBagCollection
from torchrec.distributed.sharding.cw_sharding import CwPooledEmbeddingSharding
from torchrec.distributed.sharding.dp_sharding import DpPooledEmbeddingSharding
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingSharding
from torchrec.distributed.sharding.twcw_sharding import TwCwPooledEmbeddingSharding
from torchrec.distributed.sharding.twrw_sharding import TwRwPooledEmbeddingSharding
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_configs import DataType
from torchrec.optim.fused import EmptyFusedOptimizer, FusedOptimizer, FusedOptimizerModule

from ..model import OptimizerSpec
from ..module import TableBatchedEmbeddingBags, _resolve_spec, check_hyperparameters
from .config import FUSED_PARAMS_KEY, TbegenOptions, check_module, resolve, torchrec_state_names

__all__ = [
    "TbegenEmbeddingBagCollectionSharder",
    "TbegenShardedEmbeddingBagCollection",
    "TbegenPooledEmbeddingsLookup",
    "TbegenEmbeddingBag",
    "TbegenFusedOptimizer",
    "TbegenOptions",
    "SHARDING_TYPES",
]

# The sharder's options travel in TorchRec's fused_params under FUSED_PARAMS_KEY, with each table
# into the GroupedEmbeddingConfig that a kernel is built from; fused_params are part of TorchRec's
# grouping key, so tables with different options (or optimizers) never share a kernel.

# Data-parallel tables need TorchRec's `init_data_parallel` hook (TorchRec 1.7 and later): tbegen's
# replicas have no dense gradients, and older releases wrap every data-parallel lookup in DDP from
# the collection's constructor, which refuses a module without them.
DATA_PARALLEL_SUPPORTED = hasattr(ShardedEmbeddingBagCollection, "init_data_parallel")

SHARDING_TYPES = (
    ShardingType.TABLE_WISE.value,
    ShardingType.ROW_WISE.value,
    ShardingType.COLUMN_WISE.value,
    ShardingType.TABLE_ROW_WISE.value,
    ShardingType.TABLE_COLUMN_WISE.value,
) + ((ShardingType.DATA_PARALLEL.value,) if DATA_PARALLEL_SUPPORTED else ())

_WEIGHT_DTYPES = {DataType.FP32: torch.float32, DataType.FP16: torch.float16, DataType.BF16: torch.bfloat16}
# TorchRec's pooling modes (FBGEMM's PoolingMode names) -> tbegen's
_POOLING = {"SUM": "sum", "MEAN": "mean"}


# ---- sharded views of per-table tensors --------------------------------------------------------


def _state_shard_metadata(table, per: str) -> Tuple[Dict[Tuple[int, ...], ShardMetadata], List[int]]:
    """For one table: {table shard offsets: metadata of that shard's state} over all ranks' shards,
    and the state's global size.

    Per-element states are laid out like the weights. Per-row states are 1-D: row-wise shards keep
    their row offsets; column-wise shards each cover all rows and keep a row state of their own
    (as FBGEMM's do), so the global tensor stacks them in column order into [rows * shards].
    """
    global_md = table.global_metadata
    rows = global_md.size[0]
    out: Dict[Tuple[int, ...], ShardMetadata] = {}
    if per == "element":
        for m in global_md.shards_metadata:
            out[tuple(m.shard_offsets)] = ShardMetadata(list(m.shard_offsets), list(m.shard_sizes), m.placement)
        return out, list(global_md.size)
    column_sharded = any(m.shard_sizes[1] != global_md.size[1] for m in global_md.shards_metadata)
    row_sharded = any(m.shard_sizes[0] != rows for m in global_md.shards_metadata)
    if column_sharded and row_sharded:
        raise NotImplementedError(
            f"tbegen: table {table.name!r} is sharded by rows and by columns at once (grid sharding); not supported"
        )
    if not column_sharded:
        for m in global_md.shards_metadata:
            out[tuple(m.shard_offsets)] = ShardMetadata([m.shard_offsets[0]], [m.shard_sizes[0]], m.placement)
        return out, [rows]
    by_column = sorted(global_md.shards_metadata, key=lambda m: m.shard_offsets[1])
    for slot, m in enumerate(by_column):
        out[tuple(m.shard_offsets)] = ShardMetadata([slot * rows], [rows], m.placement)
    return out, [rows * len(by_column)]


def _sharded_tensor(local: List[Tuple[torch.Tensor, Tuple[int, ...]]], metadata: Dict[Tuple[int, ...], ShardMetadata],
                    size: List[int], pg) -> ShardedTensor:
    """A ShardedTensor over this rank's views `local` (tensor, table shard offsets)."""
    props = TensorProperties(dtype=local[0][0].dtype, layout=torch.strided, requires_grad=False)
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local_shards=[Shard(t, metadata[key]) for t, key in local],
        sharded_tensor_metadata=ShardedTensorMetadata(list(metadata.values()), torch.Size(size), props),
        process_group=pg,
    )


# ---- the fused optimizer ------------------------------------------------------------------------

# the hyperparameters FBGEMM's update_hyper_parameters takes besides lr, for any optimizer
_FBGEMM_SETTABLE = ("eps", "beta1", "beta2", "weight_decay")


class TbegenFusedOptimizer(FusedOptimizer):
    """TorchRec's view of one kernel's fused optimizer.

    state: per table, `{TABLE.STATE: ShardedTensor}` for every optimizer state of the spec (views
    into the kernel's buffers, so loading a state_dict writes the kernel's states). For an update
    FBGEMM has (sgd, adagrad, rowwise_adagrad, adam, ...: config.torchrec_state_names) the keys are
    the ones TorchRec gives FBGEMM's kernel ("momentum1" for the first state, FBGEMM's names for the
    others) and nothing else, so that checkpoints of either kernel load into the other. For the
    other specs: the spec's state names and `TABLE.step`, the kernel's update counter (a 1-element
    int64 tensor kept current after every update). (TorchRec's FBGEMM state has no counter: after
    loading such a checkpoint `set_optimizer_step` restores it, for both kernels.)

    param_groups: one group; for FBGEMM's optimizers it holds `lr` only (FBGEMM's group, so that
    saved param groups load across the kernels too), for the other specs all the spec's
    hyperparameters (`learning_rate` as `lr`, which LR schedulers change); `step()` and
    `zero_grad()` hand them to the kernel, as TorchRec's FBGEMM optimizer does with its learning
    rate. `update_hyper_parameters` changes any hyperparameter.
    """

    def __init__(self, kernel: "TbegenEmbeddingBag", pg) -> None:
        self._kernel = kernel
        emb = kernel.emb_module
        tables = kernel.config.embedding_tables
        weights = emb.split_embedding_weights()
        states = emb.split_optimizer_states()

        params: Dict[str, ShardedTensor] = {}
        state: Dict[Any, Dict[str, Any]] = {}
        names = list(dict.fromkeys(t.name for t in tables))
        torchrec_names = torchrec_state_names(emb.spec)
        state_keys = list(torchrec_names) if torchrec_names is not None else [s.name for s in emb.spec.states]
        with_step = torchrec_names is None
        for name in names:
            mine = [i for i, t in enumerate(tables) if t.name == name]
            table = tables[mine[0]]
            if table.global_metadata is None:  # data-parallel: every rank holds the whole table
                weight = weights[mine[0]]
                params[f"{name}.weight"] = weight
                state[weight] = {f"{name}.{key}": states[mine[0]][s.name] for key, s in zip(state_keys, emb.spec.states)}
                if with_step:
                    state[weight][f"{name}.step"] = kernel.step_tensor
                continue
            offsets = [tuple(tables[i].local_metadata.shard_offsets) for i in mine]
            md, size = _state_shard_metadata(table, "element")
            weight = _sharded_tensor([(weights[i], off) for i, off in zip(mine, offsets)], md, size, pg)
            params[f"{name}.weight"] = weight
            entry: Dict[str, Any] = {}
            for key, s in zip(state_keys, emb.spec.states):
                md, size = _state_shard_metadata(table, s.per)
                entry[f"{name}.{key}"] = _sharded_tensor(
                    [(states[i][s.name], off) for i, off in zip(mine, offsets)], md, size, pg
                )
            if with_step:
                entry[f"{name}.step"] = kernel.step_tensor
            state[weight] = entry
        group: Dict[str, Any] = {"params": list(params.values())}
        group.update(self._hyperparameters_for_group())
        super().__init__(params, state, [group])

    def state_dict(self) -> Dict[str, Any]:
        # the states of cached rows written back first, so that the views hold them
        self._kernel.flush()
        return super().state_dict()

    def _hyperparameters_for_group(self) -> Dict[str, Any]:
        values = self._kernel.emb_module.hyperparameters
        if torchrec_state_names(self._kernel.emb_module.spec) is not None:
            # FBGEMM's optimizers: FBGEMM's group, the learning rate only (so that saved param
            # groups load across the kernels too); update_hyper_parameters changes the others
            return {"lr": values["learning_rate"]}
        if "learning_rate" in values:
            values["lr"] = values.pop("learning_rate")
        return values

    def _apply_param_group(self) -> None:
        group = dict(self.param_groups[0])
        values = {k: v for k, v in group.items() if k not in ("params", "lr")}
        if "lr" in group:
            values["learning_rate"] = group["lr"]
        self._kernel.emb_module.set_hyperparameters(**values)

    def zero_grad(self, set_to_none: bool = False) -> None:
        self._apply_param_group()

    def step(self, closure: Any = None) -> None:
        self._apply_param_group()

    def set_optimizer_step(self, step: int) -> None:
        self._kernel.set_step(step)

    def update_hyper_parameters(self, params_dict: Dict[str, Any]) -> None:
        values = dict(params_dict)
        if "learning_rate" in values:
            values["lr"] = values.pop("learning_rate")
        group = self.param_groups[0]
        declared = {h.name for h in self._kernel.emb_module.spec.hyperparameters}
        # TorchRec hands the same dict to every kernel, whatever its optimizer: FBGEMM's
        # hyperparameters that this one does not have change nothing here (as in FBGEMM's kernel);
        # a name neither knows is an error
        values = {k: v for k, v in values.items() if k == "lr" or k in declared or k not in _FBGEMM_SETTABLE}
        direct = {k: v for k, v in values.items() if k not in group}  # (FBGEMM's group has lr only)
        group.update({k: v for k, v in values.items() if k in group})
        if direct:
            self._kernel.emb_module.set_hyperparameters(**direct)
        self._apply_param_group()

    def post_load_state_dict(self) -> None:
        # the state_dict's step counters were copied into step_tensor; the kernel counts on from there
        self._kernel.set_step(int(self._kernel.step_tensor.item()))
        self._apply_param_group()


# ---- the kernel ----------------------------------------------------------------------------------


class _CountingTableBatchedEmbeddingBags(TableBatchedEmbeddingBags):
    """tbegen's module, mirroring its update counter into a tensor that checkpoints can hold."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.step_tensor = torch.zeros(1, dtype=torch.int64)

    def _run_backward(self, *args, **kwargs) -> None:
        super()._run_backward(*args, **kwargs)
        self.step_tensor.fill_(self._step)


class _GlobalBatchTableBatchedEmbeddingBags(_CountingTableBatchedEmbeddingBags):
    """A replica of whole tables (data-parallel) that every rank updates with the global batch.

    The backward gathers every rank's indices, offsets, per-sample weights and output gradient,
    lays them out as one feature-major batch (rank 0's bags of each feature first), divides the
    gradient by the number of ranks (DDP's mean, TorchRec's gradient division) and runs the fused
    update on it: each rank applies the same update, so the replicas stay equal, and that update is
    the single-process one over the global batch.
    """

    def __init__(self, *args, pg=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._pg = pg

    def _run_backward(self, grad_output, weights, indices, offsets, per_sample_weights) -> None:
        grad_output, indices, offsets, per_sample_weights = _global_batch(
            self._pg, self.layout.num_features, grad_output, indices, offsets, per_sample_weights
        )
        super()._run_backward(grad_output, weights, indices, offsets, per_sample_weights)


def _all_gather_padded(pg, tensor: torch.Tensor, lengths: List[int]) -> List[torch.Tensor]:
    """Every rank's `tensor` (its first dimension lengths[r] on rank r, the rest equal)."""
    padded = torch.zeros((max(max(lengths), 1),) + tuple(tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    padded[: tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in lengths]
    dist.all_gather(parts, padded, group=pg)
    return [part[:n] for part, n in zip(parts, lengths)]


def _global_batch(pg, num_features: int, grad_output, indices, offsets, per_sample_weights):
    world = dist.get_world_size(pg)
    batch = (offsets.numel() - 1) // num_features
    sizes = torch.tensor([indices.numel(), batch], dtype=torch.int64, device=indices.device)
    all_sizes = [torch.empty_like(sizes) for _ in range(world)]
    dist.all_gather(all_sizes, sizes, group=pg)
    n_per_rank = [int(x[0]) for x in all_sizes]
    b_per_rank = [int(x[1]) for x in all_sizes]
    lengths = (offsets[1:] - offsets[:-1]).view(num_features, batch).t().contiguous()  # [B, F]
    all_lengths = _all_gather_padded(pg, lengths, b_per_rank)
    all_indices = _all_gather_padded(pg, indices, n_per_rank)
    all_grads = _all_gather_padded(pg, grad_output, b_per_rank)
    all_psw = _all_gather_padded(pg, per_sample_weights, n_per_rank) if per_sample_weights is not None else None
    # feature-major: feature f's bags of rank 0, then of rank 1, ...
    pieces, psw_pieces = [], []
    # (on the CPU: the loop below reads them one by one)
    rank_offsets = [torch.cat([offsets.new_zeros(1), ln.t().reshape(-1).cumsum(0)]).cpu() for ln in all_lengths]
    for f in range(num_features):
        for r in range(world):
            lo, hi = int(rank_offsets[r][f * b_per_rank[r]]), int(rank_offsets[r][(f + 1) * b_per_rank[r]])
            pieces.append(all_indices[r][lo:hi])
            if all_psw is not None:
                psw_pieces.append(all_psw[r][lo:hi])
    global_lengths = torch.cat(all_lengths, dim=0).t().reshape(-1)  # [F * sum(B)], feature-major
    global_offsets = torch.cat([offsets.new_zeros(1), global_lengths.cumsum(0)]).to(offsets.dtype)
    global_grad = torch.cat(all_grads, dim=0) / world
    return (global_grad, torch.cat(pieces), global_offsets,
            torch.cat(psw_pieces) if all_psw is not None else None)


class TbegenEmbeddingBag(BaseBatchedEmbeddingBag[torch.Tensor], FusedOptimizerModule):
    """This rank's shards of one group of tables in one tbegen `TableBatchedEmbeddingBags`.

    Each shard is a table of its local rows and columns; features map to shards as in the
    group's config. Weights start uniform in each table's TorchRec init range (`init_parameters`).
    """

    def __init__(self, config: GroupedEmbeddingConfig, pg=None, device: Optional[torch.device] = None,
                 sharding_type: Optional[ShardingType] = None) -> None:
        super().__init__(config, pg, device, sharding_type)
        # the optimizer from TorchRec's configuration and/or the sharder's tbegen spec (config.py)
        options = (config.fused_params or {}).get(FUSED_PARAMS_KEY)
        self.optimizer_config = resolve(config.fused_params, f"tables {[t.name for t in config.embedding_tables]}")
        if config.data_type not in _WEIGHT_DTYPES:
            raise ValueError(
                f"tbegen: tables of data_type {config.data_type} are not supported (FP32, FP16 or BF16); "
                f"tables {[t.name for t in config.embedding_tables]}"
            )
        pooling = _POOLING.get(self._pooling.name)
        if pooling is None:
            raise ValueError(f"tbegen: pooling {self._pooling.name} is not supported by the TorchRec kernel (SUM, MEAN)")
        placements = _placements(config)
        data_parallel = sharding_type == ShardingType.DATA_PARALLEL
        module_class = _GlobalBatchTableBatchedEmbeddingBags if data_parallel else _CountingTableBatchedEmbeddingBags
        extra = {"pg": pg} if data_parallel else {}
        self._emb_module = module_class(
            **extra,
            tables=list(zip(self._local_rows, self._local_cols)),
            optimizer=self.optimizer_config.spec,
            pooling=pooling,
            weights_dtype=_WEIGHT_DTYPES[config.data_type],
            output_dtype=self.optimizer_config.output_dtype,
            stochastic_rounding=self.optimizer_config.stochastic_rounding,
            device=device if device is not None else "cpu",
            feature_table_map=self._feature_table_map,
            seed=options.seed,
            max_segment_length_per_warp=options.max_segment_length_per_warp,
            placements=placements,
            **_cache_arguments(config, placements),
            **self.optimizer_config.hyperparameters,
        )
        if self._emb_module.dense_gradient:
            raise ValueError("tbegen: optimizer 'none' (dense gradients) is not a fused kernel; use TorchRec's DENSE kernel")
        self.init_parameters()
        self._optim = TbegenFusedOptimizer(self, pg)
        # prefetched batches, oldest first: (the features' key, the indices and offsets prefetched)
        self._prefetched_inputs: List[Tuple[Tuple[Any, ...], torch.Tensor, torch.Tensor]] = []

    @property
    def emb_module(self) -> TableBatchedEmbeddingBags:
        return self._emb_module

    @property
    def step_tensor(self) -> torch.Tensor:
        return self._emb_module.step_tensor

    def set_step(self, step: int) -> None:
        self._emb_module._step = int(step)
        self._emb_module.step_tensor.fill_(int(step))

    @property
    def fused_optimizer(self) -> FusedOptimizer:
        return self._optim

    def flush(self) -> None:
        # (TorchRec's sharded collection calls this before its state_dict: the FUSED_UVM_CACHING
        # tables' changed cached rows and states are written back to the tables the views show)
        self._emb_module.flush()

    def purge(self) -> None:
        # (called before a state_dict is loaded into the views: the cached copies are dropped, so
        # that the next batch loads the loaded rows)
        self._emb_module.drop_cache()
        self._prefetched_inputs.clear()

    def prefetch(self, features, forward_stream=None) -> None:
        """Prefetches one batch of this group's features (a KJT) for its forward: TorchRec's
        prefetch pipelines call the lookup's `prefetch` for the next batch (on their prefetch
        stream) between this batch's forward and backward. The tbegen module prefetches the very
        indices and offsets tensors that `forward` of the same features will pass it (converted
        as it converts them; a variable batch with its per-rank sizes), so that forward finds
        the prepared batch. TorchRec splits a lookup's KJT into its groups anew for the prefetch
        and for the forward (new KJTs, new offsets), so the forward recognises the features by
        their values and lengths (or offsets): the same memory, unchanged since (their version
        counters), the same per-rank sizes. Nothing to do without FUSED_UVM_CACHING tables."""
        if "managed_caching" not in self._emb_module.placements:
            return
        key = _features_key(features)
        indices, offsets, sizes = self._converted(features)
        self._emb_module.prefetch(indices, offsets, forward_stream=forward_stream,
                                  batch_size_per_feature_per_rank=sizes)
        self._prefetched_inputs.append((key, indices, offsets))
        del self._prefetched_inputs[:-8]  # (as the module: prefetches never consumed are forgotten)

    def _converted(self, features):
        """(indices, offsets, batch_size_per_feature_per_rank or None) of `features`, as the
        tbegen module takes them (TorchRec's index and offset types)."""
        sizes = features.stride_per_key_per_rank() if features.variable_stride_per_key() else None
        return (features.values().to(self._embedding_table_index_type),
                features.offsets().to(self._embedding_table_offset_type), sizes)

    def _module_inputs(self, features):
        """What forward passes the tbegen module for `features` (_converted): a prefetched batch's
        very tensors, when it is one (that entry and older ones are dropped)."""
        if self._prefetched_inputs:
            key = _features_key(features)
            for k, (kept, indices, offsets) in enumerate(self._prefetched_inputs):
                if _same_features(kept, key):
                    del self._prefetched_inputs[: k + 1]
                    if indices.is_cuda:  # (made on the prefetch's stream: now used on this one too)
                        stream = torch.cuda.current_stream(indices.device)
                        indices.record_stream(stream)
                        offsets.record_stream(stream)
                    return indices, offsets, key[4]
        return self._converted(features)

    def forward(self, features, *args, **kwargs) -> torch.Tensor:
        if args or any(v is not None for v in kwargs.values()):
            raise NotImplementedError("tbegen: preallocated VBE outputs are not supported by the tbegen kernel")
        if not features.variable_stride_per_key() and not self._prefetched_inputs:
            return super().forward(features)
        # A prefetched batch (the tensors its prefetch passed the module), or a variable batch per
        # feature (VBE): the KJT's per-rank strides are FBGEMM's batch_size_per_feature_per_rank;
        # the output is the module's 1-D rank-major one, which is what TorchRec's variable-batch
        # output all-to-all expects (as from FBGEMM's kernel).
        weights = features.weights_or_none()
        if weights is not None and not torch.is_floating_point(weights):
            weights = None
        indices, offsets, sizes = self._module_inputs(features)
        if sizes is None:
            return self.emb_module(indices, offsets, weights)
        return self.emb_module(indices, offsets, weights, batch_size_per_feature_per_rank=sizes)

    @property
    def _param_per_table(self) -> Dict[str, TableBatchedEmbeddingSlice]:
        """Per table name, one slice of the flat weights over this rank's shards of it (consecutive
        in the flat buffer), tagged with the fused optimizer (so dense optimizers skip it)."""
        out = {}
        weights = self._emb_module.weights
        offsets = self._emb_module.layout.table_offsets
        for name, count in self.table_name_to_count.items():
            first = next(i for i, t in enumerate(self._config.embedding_tables) if t.name == name)
            rows, dim = self._local_rows[first], self._local_cols[first]
            tbe_slice = TableBatchedEmbeddingSlice(
                data=weights, start_offset=offsets[first], end_offset=offsets[first] + count * rows * dim,
                num_embeddings=-1, embedding_dim=dim,
            )
            tbe_slice._in_backward_optimizers = [self._optim]
            out[name] = tbe_slice
        return out

    @_param_per_table.setter
    def _param_per_table(self, value) -> None:
        # BaseBatchedEmbeddingBag.__init__ assigns an empty dict; the slices are derived on demand
        pass

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        # fused weights and states are reached through state_dict and fused_optimizer, as in TorchRec
        yield from ()

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[Tuple[str, nn.Parameter]]:
        for name, tensor in self.named_split_embedding_weights(prefix, recurse, remove_duplicate):
            param = nn.Parameter(tensor, requires_grad=False)
            param._in_backward_optimizers = [EmptyFusedOptimizer()]
            yield name, param


def _features_key(features) -> Tuple[Any, ...]:
    """What identifies a KJT's batch for the prefetch (TbegenEmbeddingBag.prefetch): its values and
    the tensor its bags come from (lengths, else offsets), with their version counters then, and
    its per-rank sizes (a variable batch) or None. Kept in a list, the key holds the tensors, so
    their memory cannot be reused: another KJT whose tensors have the same address, dtype, shape
    and strides and the same versions views the very same, unchanged, data."""
    values = features.values()
    bags = features.lengths_or_none()
    if bags is None:
        bags = features.offsets_or_none()
    sizes = features.stride_per_key_per_rank() if features.variable_stride_per_key() else None
    return (values, values._version, bags, None if bags is None else bags._version, sizes)


def _same_tensor(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    if a is b:
        return True
    if a is None or b is None:
        return False
    return (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride() and a.device == b.device)


def _same_features(kept: Tuple[Any, ...], key: Tuple[Any, ...]) -> bool:
    """Whether the features of `key` (now) are those `kept` was taken of (_features_key)."""
    values, values_version, bags, bags_version, sizes = kept
    return (_same_tensor(values, key[0]) and values_version == key[1] and _same_tensor(bags, key[2])
            and bags_version == key[3] and sizes == key[4])


# ---- lookup and shardings -----------------------------------------------------------------------


# TorchRec's fused compute kernels -> the placement of the table in tbegen's module
# (tbegen/placement.py). TorchRec groups FUSED_UVM (and FUSED_UVM_CACHING) tables with FUSED ones
# into one kernel; each table keeps its own compute_kernel, which picks its placement.
_PLACEMENT_OF_KERNEL = {
    EmbeddingComputeKernel.FUSED: "device",
    EmbeddingComputeKernel.FUSED_UVM: "managed",
    EmbeddingComputeKernel.FUSED_UVM_CACHING: "managed_caching",
}


def _placements(config: GroupedEmbeddingConfig) -> List[str]:
    """One tbegen placement per table of the group, from each table's compute kernel."""
    out = []
    for table in config.embedding_tables:
        kernel = table.compute_kernel
        if kernel not in _PLACEMENT_OF_KERNEL:
            raise ValueError(
                f"tbegen: the tbegen sharder runs compute kernels "
                f"{', '.join(repr(k.value) for k in _PLACEMENT_OF_KERNEL)}; the plan asks for {kernel.value!r} "
                f"for table {table.name!r}"
            )
        out.append(_PLACEMENT_OF_KERNEL[kernel])
    return out


def _cache_arguments(config: GroupedEmbeddingConfig, placements: List[str]) -> Dict[str, object]:
    """The module's cache arguments for a group with FUSED_UVM_CACHING tables, from the plan's
    cache parameters (TorchRec copies them into the group's fused_params): `cache_load_factor`
    (TorchRec's default 0.2 where the plan has none; here each cached table's cache holds that
    fraction of its own rows, where FBGEMM sizes one cache for all of them) and `cache_algorithm`
    (FBGEMM's CacheAlgorithm LRU or LFU). Empty when no table is cached."""
    if "managed_caching" not in placements:
        return {}
    fused = getattr(config, "fused_params", None) or {}
    factor = fused.get("cache_load_factor") or 0.2
    algorithm = fused.get("cache_algorithm")
    name = "lru" if algorithm is None else str(getattr(algorithm, "name", algorithm)).lower()
    if name not in ("lru", "lfu"):
        raise ValueError(f"tbegen: cache_algorithm {algorithm!r} in the plan: the tbegen kernel caches with LRU or LFU")
    return {"cache_load_factor": float(factor), "cache_algorithm": name}


class TbegenPooledEmbeddingsLookup(GroupedPooledEmbeddingsLookup):
    """TorchRec's pooled lookup whose fused kernels are tbegen's."""

    def _create_embedding_kernel(self, config: GroupedEmbeddingConfig, device, pg, sharding_type, env) -> BaseEmbedding:
        if config.compute_kernel != EmbeddingComputeKernel.FUSED:  # (the group's kernel: FUSED_UVM tables are FUSED here)
            raise ValueError(
                f"tbegen: the tbegen sharder runs fused compute kernels only, the plan asks for "
                f"{config.compute_kernel.value!r} for tables {[t.name for t in config.embedding_tables]}"
            )
        _placements(config)  # refuses another kernel before anything is built
        return TbegenEmbeddingBag(config=config, pg=pg, device=device, sharding_type=sharding_type)

    def _forward_with_vbe_merging(self, features_by_group, device):
        """A variable batch (VBE) over several kernels: TorchRec preallocates one 1-D output and has
        FBGEMM's kernels write their parts into it (vbe_output, vbe_output_offsets); tbegen's
        kernels return their own rank-major 1-D output, which TorchRec's split-and-concatenate
        merge (its path for devices without the preallocated output) lays out the same way, rank
        by rank, kernel by kernel, feature by feature. (TorchRec versions without this method
        merge their own way and never call it.)"""
        return self._merge_variable_batch_embeddings(self._forward(features_by_group),
                                                     self._vbe_splits(features_by_group))

    def prefetch(self, sparse_features, forward_stream=None) -> None:
        """TorchRec's prefetch of a batch (its prefetch pipelines call it on their prefetch stream,
        with the forward's stream as `forward_stream`): each group with FUSED_UVM_CACHING tables
        prefetches its features in its kernel (TbegenEmbeddingBag.prefetch), which hands its
        forward the very tensors it prefetched."""
        kernels = [k for k in self._emb_modules if isinstance(k, TbegenEmbeddingBag)
                   and "managed_caching" in k.emb_module.placements]
        if not kernels:
            return
        for emb_op, features in zip(self._emb_modules, sparse_features.split(self._feature_splits)):
            if any(emb_op is k for k in kernels):
                emb_op.prefetch(features, forward_stream=forward_stream)


def _tbegen_sharding(base, lookup_sharding_type: Optional[ShardingType], per_rank_configs: bool = False):
    """`base` (a TorchRec pooled sharding class) with a create_lookup that builds tbegen kernels.

    Only the kernels change; TorchRec's input and output distribution are kept.
    """

    def create_lookup(self, device=None, fused_params=None, feature_processor=None):
        configs = self._grouped_embedding_configs_per_rank[self._rank] if per_rank_configs else self._grouped_embedding_configs
        return TbegenPooledEmbeddingsLookup(
            grouped_configs=configs,
            pg=self._pg,
            device=device if device is not None else self._device,
            feature_processor=feature_processor,
            sharding_type=lookup_sharding_type,
            env=self._env,
        )

    return type(f"Tbegen{base.__name__}", (base,), {"create_lookup": create_lookup, "__module__": __name__})


# The sharding types tbegen runs, each TorchRec's class with tbegen kernels. The sharding type
# handed to the lookup is what TorchRec's own create_lookup passes (it turns MEAN into SUM where the
# mean is taken after the reduce-scatter).
_SHARDINGS = {
    ShardingType.TABLE_WISE.value: _tbegen_sharding(TwPooledEmbeddingSharding, None),
    ShardingType.ROW_WISE.value: _tbegen_sharding(RwPooledEmbeddingSharding, ShardingType.ROW_WISE),
    ShardingType.COLUMN_WISE.value: _tbegen_sharding(CwPooledEmbeddingSharding, None),
    ShardingType.TABLE_ROW_WISE.value: _tbegen_sharding(TwRwPooledEmbeddingSharding, ShardingType.TABLE_ROW_WISE, True),
    ShardingType.TABLE_COLUMN_WISE.value: _tbegen_sharding(TwCwPooledEmbeddingSharding, None),
}


class _TbegenDataParallelSharding(DpPooledEmbeddingSharding):
    """TorchRec's data-parallel sharding (every rank holds whole tables) with tbegen kernels that
    update each replica with the global batch (see _GlobalBatchTableBatchedEmbeddingBags)."""

    def create_lookup(self, device=None, fused_params=None, feature_processor=None):
        return TbegenPooledEmbeddingsLookup(
            grouped_configs=self._grouped_embedding_configs,
            pg=self._env.process_group,
            device=device if device is not None else self._device,
            feature_processor=feature_processor,
            scale_weight_gradients=False,
            sharding_type=ShardingType.DATA_PARALLEL,
            env=self._env,
        )


_SHARDINGS[ShardingType.DATA_PARALLEL.value] = _TbegenDataParallelSharding


class TbegenShardedEmbeddingBagCollection(ShardedEmbeddingBagCollection):
    """TorchRec's sharded EmbeddingBagCollection with tbegen kernels for every model-parallel shard."""

    @classmethod
    def create_embedding_bag_sharding(cls, sharding_infos, env, device=None, permute_embeddings=False,
                                      qcomm_codecs_registry=None):
        sharding_type = sharding_infos[0].param_sharding.sharding_type
        sharding = _SHARDINGS.get(sharding_type)
        if sharding is None:
            raise ValueError(
                f"tbegen: sharding type {sharding_type!r} is not supported by the tbegen kernel; supported: "
                f"{', '.join(SHARDING_TYPES)}"
            )
        if sharding_type == ShardingType.DATA_PARALLEL.value:
            return sharding(sharding_infos, env, device)
        kwargs: Dict[str, Any] = {"qcomm_codecs_registry": qcomm_codecs_registry}
        if sharding_type in (ShardingType.COLUMN_WISE.value, ShardingType.TABLE_COLUMN_WISE.value):
            kwargs["permute_embeddings"] = permute_embeddings
        return sharding(sharding_infos, env, device, **kwargs)

    def init_data_parallel(self) -> None:
        # TorchRec wraps data-parallel lookups in DDP, to average the dense gradients of their
        # weights; tbegen's replicas have none (their fused update averages the global batch's
        # gradient itself), so they stay unwrapped.
        pass


class TbegenEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """Shards `EmbeddingBagCollection`s onto tbegen kernels with a fused optimizer.

    Built with no arguments, it is a drop-in for TorchRec's `EmbeddingBagCollectionSharder`: each
    table's optimizer and hyperparameters come from TorchRec's configuration, as TorchRec's FBGEMM
    kernel takes them: `apply_optimizer_in_backward(torch.optim.SGD / Adagrad / Adam,
    torchrec.optim.RowWiseAdagrad, ..., params, {"lr": ...})` on the tables' weights, or
    `fused_params={"optimizer": EmbOptimType..., "learning_rate": ..., "eps": ...}` here (as for
    TorchRec's sharder; the per-table optimizer overrides them), each EmbOptimType trained by the
    tbegen spec with FBGEMM's update and FBGEMM's defaults for hyperparameters not given
    (tbegen/torchrec/config.py has the rules; anything tbegen cannot honour is an error, and so is
    no optimizer at all).

    Args:
        optimizer: a tbegen spec name ("adam", "rowwise_adagrad", "ftrl", ...), a path to a YAML
            spec, or a loaded OptimizerSpec, for every table ("none", the dense-gradient mode, is
            not a fused kernel). Default None: TorchRec's configuration names it. Given as well as
            a TorchRec optimizer, both must be the same update. A dict here is taken as
            `fused_params` (TorchRec's sharder takes fused_params first).
        fused_params: TorchRec's fused_params (FBGEMM's argument names).
        stochastic_rounding: default None: fused_params' value, else True (FBGEMM's default).
        seed, max_segment_length_per_warp: as for TableBatchedEmbeddingBags.
        sharding_types: the sharding types to offer the planner (default: all of SHARDING_TYPES,
            on every compute device, row-wise on the CPU included).
        qcomm_codecs_registry: TorchRec's quantized-communication codecs.
        **hyperparameters: `optimizer`'s hyperparameters by name; checked here, before any sharding.

    Each table's weight precision is its EmbeddingBagConfig.data_type (FP32, FP16 or BF16).
    """

    def __init__(self, optimizer: Union[None, str, os.PathLike, OptimizerSpec, Dict[str, Any]] = None, *,
                 fused_params: Optional[Dict[str, Any]] = None, stochastic_rounding: Optional[bool] = None,
                 seed: int = 0, max_segment_length_per_warp: int = 32, sharding_types: Optional[List[str]] = None,
                 qcomm_codecs_registry=None, **hyperparameters) -> None:
        if isinstance(optimizer, dict):
            if fused_params is not None:
                raise TypeError("tbegen: fused_params given twice (a dict as the first argument, and fused_params=)")
            optimizer, fused_params = None, optimizer
        if fused_params is not None and not isinstance(fused_params, dict):
            raise TypeError(f"tbegen: fused_params must be a dict (TorchRec's), got {type(fused_params).__name__}")
        if fused_params and FUSED_PARAMS_KEY in fused_params:
            raise ValueError(f"tbegen: fused_params key {FUSED_PARAMS_KEY!r} is tbegen's own; give the sharder's arguments instead")
        spec = None
        hyper: Dict[str, Any] = {}
        if optimizer is not None:
            spec = _resolve_spec(optimizer)
            if spec.dense_gradient:
                raise ValueError(f"tbegen: optimizer {spec.name!r} (dense_gradient: true, it returns dense gradients) "
                                 "is not a fused kernel; choose a fused optimizer, or TorchRec's DENSE kernel")
            hyper = check_hyperparameters(spec, hyperparameters, complete=False)
        elif hyperparameters:
            raise TypeError(
                f"tbegen: hyperparameters {sorted(hyperparameters)} given by keyword without a tbegen optimizer; "
                f"with TorchRec's optimizer configuration give them there (fused_params with FBGEMM's names, or "
                f"apply_optimizer_in_backward's kwargs)"
            )
        if sharding_types is not None:
            if ShardingType.DATA_PARALLEL.value in sharding_types and not DATA_PARALLEL_SUPPORTED:
                raise ValueError("tbegen: sharding_types: data_parallel needs TorchRec 1.7 or later (its "
                                 "init_data_parallel hook); this TorchRec wraps data-parallel lookups in DDP, "
                                 "which tbegen's fused kernels (no dense gradients) cannot be")
            unknown = [s for s in sharding_types if s not in SHARDING_TYPES]
            if unknown or not sharding_types:
                raise ValueError(f"tbegen: sharding_types must be a non-empty subset of {list(SHARDING_TYPES)}, got {sharding_types!r}")
        self._tbegen_sharding_types = list(sharding_types) if sharding_types is not None else list(SHARDING_TYPES)
        self.options = TbegenOptions(
            spec=spec, hyperparameters=tuple(hyper.items()),
            stochastic_rounding=None if stochastic_rounding is None else bool(stochastic_rounding),
            seed=int(seed), max_segment_length_per_warp=int(max_segment_length_per_warp),
        )
        all_params = {**(fused_params or {}), FUSED_PARAMS_KEY: self.options}
        if "optimizer" in all_params or spec is not None:
            # the sharder's own configuration checked now (a table's apply_optimizer_in_backward
            # may still override it: checked again in shard())
            resolve(all_params, "the sharder")
        super().__init__(fused_params=all_params, qcomm_codecs_registry=qcomm_codecs_registry)

    def sharding_types(self, compute_device_type: str) -> List[str]:
        return list(self._tbegen_sharding_types)

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> List[str]:
        # FUSED_UVM (tables in managed memory) and FUSED_UVM_CACHING (the same behind a GPU cache
        # of hot rows: tbegen's managed_caching placement) on GPUs, for model-parallel shardings,
        # as TorchRec offers them
        if compute_device_type == "cuda" and sharding_type != ShardingType.DATA_PARALLEL.value:
            return [EmbeddingComputeKernel.FUSED.value, EmbeddingComputeKernel.FUSED_UVM.value,
                    EmbeddingComputeKernel.FUSED_UVM_CACHING.value]
        return [EmbeddingComputeKernel.FUSED.value]

    def shard(self, module, params, env, device=None, module_fqn=None) -> TbegenShardedEmbeddingBagCollection:
        # every table's optimizer resolved on every rank, before any kernel is built
        check_module(module, self.fused_params, [c.name for c in module.embedding_bag_configs()])
        return TbegenShardedEmbeddingBagCollection(
            module=module,
            table_name_to_parameter_sharding=params,
            env=env,
            fused_params=self.fused_params,
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
        )
