"""A small DLRM-style model, its synthetic data, and the pieces to train it sharded and unsharded.

Shared by tests/test_torchrec.py and examples/torchrec_training.py:

- `DLRM`: a bottom MLP over dense features, pooled embeddings of the sparse features, a top MLP
  over both (concatenated) giving one logit. Its `sparse` part is either TorchRec's
  `EmbeddingBagCollection` (sharded by DistributedModelParallel) or `TbegenBags` (one
  single-process tbegen module over all tables, the reference).
- `make_batches`: deterministic global batches (dense features, a KJT, labels).
- `shard`: DistributedModelParallel over a plan from TorchRec's planner with one sharding type per
  table (as constraints), and the unsharded model's weights loaded into it.
- `gather_sharded`: every ShardedTensor of the sharded weights and fused optimizer states,
  gathered to rank 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from ..module import TableBatchedEmbeddingBags


@dataclass(frozen=True)
class TableSpec:
    name: str
    rows: int
    dim: int
    features: Tuple[str, ...]
    max_bag: int = 4  # bag lengths are uniform in [0, max_bag]


def table_configs(tables: Sequence[TableSpec], pooling: PoolingType = PoolingType.SUM) -> List[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name=t.name, num_embeddings=t.rows, embedding_dim=t.dim,
                           feature_names=list(t.features), pooling=pooling)
        for t in tables
    ]


def feature_names(tables: Sequence[TableSpec]) -> List[str]:
    """Features in table order: the order of EmbeddingBagCollection's output and of the KJT keys."""
    return [f for t in tables for f in t.features]


class TbegenBags(nn.Module):
    """All tables in one single-process tbegen module, reading the same KJT as the EBC."""

    def __init__(self, tables: Sequence[TableSpec], optimizer, pooling: str = "sum", **hyperparameters):
        super().__init__()
        ftm = [i for i, t in enumerate(tables) for _ in t.features]
        self.emb = TableBatchedEmbeddingBags(
            [(t.rows, t.dim) for t in tables], optimizer=optimizer, pooling=pooling,
            feature_table_map=ftm, **hyperparameters,
        )

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.emb(kjt.values(), kjt.offsets(), kjt.weights_or_none())


class DLRM(nn.Module):
    def __init__(self, sparse: nn.Module, num_dense: int, pooled_dim: int, hidden: int = 16,
                 features: Sequence[str] = ()):
        super().__init__()
        self.sparse = sparse
        # The order of the pooled features in the top MLP's input. A sharded EBC's KeyedTensor lists
        # its keys in sharding order (e.g. by rank for table-wise), so they are picked by name.
        self.features = list(features)
        self.bottom = nn.Sequential(nn.Linear(num_dense, hidden), nn.ReLU())
        self.top = nn.Sequential(nn.Linear(hidden + pooled_dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        pooled = self.sparse(kjt)
        if not isinstance(pooled, torch.Tensor):  # a KeyedTensor, or the sharded EBC's awaitable of one
            by_name = pooled.to_dict()
            pooled = torch.cat([by_name[f] for f in self.features], dim=1)
        return self.top(torch.cat([self.bottom(dense), pooled], dim=1)).squeeze(1)


def build_model(tables: Sequence[TableSpec], num_dense: int, seed: int = 0, hidden: int = 16,
                weighted: bool = False) -> DLRM:
    """The unsharded model, its EmbeddingBagCollection on the CPU (weighted: every index scales its
    row by a per-sample weight from the KJT), initialised from `seed`."""
    torch.manual_seed(seed)
    pooled_dim = sum(t.dim * len(t.features) for t in tables)
    ebc = EmbeddingBagCollection(tables=table_configs(tables), is_weighted=weighted, device=torch.device("cpu"))
    return DLRM(ebc, num_dense, pooled_dim, hidden, feature_names(tables))


def build_reference(model: DLRM, tables: Sequence[TableSpec], optimizer, **hyperparameters) -> DLRM:
    """The same model (same weights) with all tables in one single-process tbegen module."""
    hidden = model.bottom[0].out_features
    ref = DLRM(TbegenBags(tables, optimizer, **hyperparameters), model.bottom[0].in_features,
               model.top[0].in_features - hidden, hidden, model.features)
    ref.bottom.load_state_dict(model.bottom.state_dict())
    ref.top.load_state_dict(model.top.state_dict())
    for t, w in zip(tables, ref.sparse.emb.split_embedding_weights()):
        w.copy_(model.sparse.embedding_bags[t.name].weight.detach())
    return ref


@dataclass
class Batch:
    dense: torch.Tensor
    kjt: KeyedJaggedTensor
    labels: torch.Tensor

    def to(self, device) -> "Batch":
        return Batch(self.dense.to(device), self.kjt.to(device), self.labels.to(device))


def make_batches(tables: Sequence[TableSpec], num_dense: int, batch: int, steps: int, seed: int = 1,
                 zipf_alpha: float = 0.0, weighted: bool = False) -> List[Batch]:
    """`steps` global batches of `batch` examples. Indices are uniform, or Zipf-like (rank^-alpha
    over a fixed random permutation of the rows) for zipf_alpha > 0."""
    gen = torch.Generator().manual_seed(seed)
    keys = feature_names(tables)
    probs = {}
    for t in tables:
        if zipf_alpha > 0:
            p = torch.arange(1, t.rows + 1, dtype=torch.float64) ** -zipf_alpha
            probs[t.name] = (p / p.sum(), torch.randperm(t.rows, generator=gen))
    out = []
    for _ in range(steps):
        lengths, values = [], []
        for t in tables:
            for _f in t.features:
                ln = torch.randint(0, t.max_bag + 1, (batch,), generator=gen)
                n = int(ln.sum())
                if zipf_alpha > 0:
                    p, perm = probs[t.name]
                    idx = perm[torch.multinomial(p, n, replacement=True, generator=gen)]
                else:
                    idx = torch.randint(0, t.rows, (n,), generator=gen)
                lengths.append(ln)
                values.append(idx)
        values = torch.cat(values)
        weights = torch.rand(values.numel(), generator=gen) + 0.5 if weighted else None
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=torch.cat(lengths), weights=weights)
        dense = torch.randn(batch, num_dense, generator=gen)
        labels = torch.randint(0, 2, (batch,), generator=gen).float()
        out.append(Batch(dense, kjt, labels))
    return out


def local_batch(b: Batch, rank: int, world_size: int) -> Batch:
    """Rank `rank`'s equal slice of a global batch."""
    B = b.labels.numel() // world_size
    lo, hi = rank * B, (rank + 1) * B
    keys = b.kjt.keys()
    lengths = b.kjt.lengths().view(len(keys), -1)
    offsets = b.kjt.offsets().view(-1)
    G = lengths.shape[1]
    spans = [slice(offsets[f * G + lo], offsets[f * G + hi]) for f in range(len(keys))]
    weights = b.kjt.weights_or_none()
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.cat([b.kjt.values()[s] for s in spans]),
        lengths=lengths[:, lo:hi].reshape(-1).contiguous(),
        weights=torch.cat([weights[s] for s in spans]) if weights is not None else None,
    )
    return Batch(b.dense[lo:hi], kjt, b.labels[lo:hi])


def train_step(model: nn.Module, dense_opt: torch.optim.Optimizer, b: Batch) -> float:
    """One step: mean BCE loss, backward (the embedding update happens there), dense step."""
    loss = nn.functional.binary_cross_entropy_with_logits(model(b.dense, b.kjt), b.labels)
    loss.backward()
    dense_opt.step()
    dense_opt.zero_grad()
    return float(loss.detach())


def shard(model: DLRM, sharder, sharding_types: Dict[str, str], env_pg, device: torch.device,
          compute_device: str, min_partition: Optional[int] = None,
          compute_kernels: Optional[Dict[str, str]] = None):
    """DistributedModelParallel over `model` with a plan from TorchRec's planner; each table is
    constrained to the sharding type `sharding_types[name]` and to the compute kernel
    `compute_kernels[name]` ("fused" where not given; "fused_uvm" and "fused_uvm_caching" on a
    GPU). Returns (dmp, plan)."""
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints

    world_size = dist.get_world_size(env_pg)
    # compute kernel "fused" (device memory) unless asked otherwise, so that TorchRec's FBGEMM
    # sharder is not moved to its UVM or caching kernels where memory looks tight: both systems run alike
    kernels = compute_kernels or {}
    constraints = {
        name: ParameterConstraints(sharding_types=[st], compute_kernels=[kernels.get(name, "fused")],
                                   min_partition=min_partition)
        for name, st in sharding_types.items()
    }
    topology = Topology(world_size=world_size, compute_device=compute_device, local_world_size=world_size)
    planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints)
    plan = planner.collective_plan(model, [sharder], env_pg)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}  # DMP may reuse these tensors
    dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=[sharder])
    dmp.load_state_dict(state)
    return dmp, plan


def gather_sharded(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """{key: full tensor} on rank 0 (collective; ranks may hold different keys); {} elsewhere.

    ShardedTensors are assembled from every rank's local shards. Plain tensors are replicas (the
    tables of data-parallel sharding): rank 0 checks that every rank's copy is bitwise the same.
    """
    local = {}
    for key, t in tensors.items():
        if isinstance(t, ShardedTensor):
            shards = [(tuple(s.metadata.shard_offsets), s.tensor.detach().cpu().clone()) for s in t.local_shards()]
            local[key] = (tuple(t.size()), shards, False)
        else:
            local[key] = (tuple(t.shape), [((0,) * t.dim(), t.detach().cpu().clone())], True)
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    if dist.get_rank() != 0:
        return {}
    out: Dict[str, torch.Tensor] = {}
    for rank, part in enumerate(parts):
        for key, (size, shards, replica) in part.items():
            if replica:
                if key in out and not torch.equal(out[key], shards[0][1]):
                    raise RuntimeError(f"the replicas of {key} differ between rank 0 and rank {rank}")
                out.setdefault(key, shards[0][1])
                continue
            for offsets, tensor in shards:
                full = out.setdefault(key, torch.full(size, float("nan"), dtype=tensor.dtype))
                full[tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape))].copy_(tensor)
    return out


def sharded_state(dmp) -> Dict[str, torch.Tensor]:
    """Rank 0: the sharded model's embedding weights ("TABLE.weight") and fused optimizer states
    ("TABLE.STATE"), gathered; {} elsewhere."""
    weights = {k.split(".")[-2] + ".weight": v for k, v in dmp.state_dict().items()
               if ".embedding_bags." in k and k.endswith(".weight")}
    states = {}
    for entry in dmp.fused_optimizer.state_dict()["state"].values():
        states.update({k: v for k, v in entry.items() if not k.endswith(".step")})
    return gather_sharded({**weights, **states})


def reference_state(ref: DLRM, tables: Sequence[TableSpec]) -> Dict[str, torch.Tensor]:
    """The reference module's weights and states under the sharded model's keys (TorchRec's state
    names where FBGEMM has the optimizer, the spec's elsewhere: kernel.TbegenFusedOptimizer)."""
    from .config import torchrec_state_names

    emb = ref.sparse.emb
    names = torchrec_state_names(emb.spec)
    out = {}
    for t, w, s in zip(tables, emb.split_embedding_weights(), emb.split_optimizer_states()):
        out[f"{t.name}.weight"] = w.detach().clone()
        for key, (name, v) in zip(names if names is not None else list(s), s.items()):
            out[f"{t.name}.{key}"] = v.detach().clone()
    return out
