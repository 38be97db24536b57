"""Train TorchRec's DLRM the way TorchRec's docs do, with tbegen's sharder in place of TorchRec's.

    torchrun --nproc_per_node=N examples/torchrec_training.py [--kernel both|tbegen|fbgemm] [--steps 6] ...

The script is TorchRec's own recipe: an `EmbeddingBagCollection` inside `torchrec.models.dlrm.DLRM`
(wrapped in `DLRMTrain`), the embedding optimizers configured with `apply_optimizer_in_backward`
(one per table here: torch.optim.SGD, torch.optim.Adagrad, torchrec.optim.RowWiseAdagrad,
torch.optim.Adam) or with the sharder's `fused_params` (`--fused-params adagrad`: one
EmbOptimType for all tables), `EmbeddingShardingPlanner`, `DistributedModelParallel`, a
`CombinedOptimizer` of the fused optimizer and the dense one, and `TrainPipelineSparseDist`. The one
change from TorchRec's docs is the sharder:

    sharder = TbegenEmbeddingBagCollectionSharder()     # was: EmbeddingBagCollectionSharder()

With `--kernel both` it trains the same model on the same global batches with each sharder and
prints, per table, the largest difference of the weights and of every optimizer state (TorchRec's
state names: the fused optimizer's state_dict is the same for both kernels). TorchRec's FBGEMM
kernel on the CPU (fbgemm-gpu-cpu) has EXACT_SGD, EXACT_ADAGRAD and EXACT_ROWWISE_ADAGRAD only; on
the CPU the Adam table is therefore trained by tbegen alone (`--kernel both` leaves it out there).
Exit status 1 if a difference exceeds --tolerance.

One process per GPU with NCCL where CUDA is available, else gloo on the CPU.
"""

from __future__ import annotations

import os

# NVLink multicast stays off (also for any process a launcher starts from this environment).
for _key, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_key] = _value

import argparse
import sys
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.datasets.utils import Batch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim import RowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tbegen.torchrec import TbegenEmbeddingBagCollectionSharder  # noqa: E402

# table optimizer -> (optimizer class, kwargs) for apply_optimizer_in_backward
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.5}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1, "eps": 1e-8}),
    "rowwise_adagrad": (RowWiseAdagrad, {"lr": 0.1, "eps": 1e-8}),
    "adam": (torch.optim.Adam, {"lr": 0.02}),
}
# FBGEMM's CPU kernels (fbgemm-gpu-cpu) train these; the others on the GPU only
FBGEMM_CPU_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")
DIM = 8  # DLRM needs one embedding dim for all tables
NUM_DENSE = 4


def table_names(optimizers: Sequence[str], sharding_types: Sequence[str]) -> List[Tuple[str, str, str]]:
    """(table name, optimizer, sharding type): one table per pair."""
    return [(f"{o}_{st}", o, st) for o in optimizers for st in sharding_types]


def build_model(tables: Sequence[Tuple[str, str, str]], rows: int = 40, seed: int = 0) -> DLRMTrain:
    """TorchRec's DLRM over one EmbeddingBagCollection (on the CPU; DMP moves it), each table with
    one feature named after it."""
    torch.manual_seed(seed)
    configs = [EmbeddingBagConfig(name=name, embedding_dim=DIM, num_embeddings=rows + 7 * i, feature_names=[f"f_{name}"])
               for i, (name, _, _) in enumerate(tables)]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
    return DLRMTrain(DLRM(embedding_bag_collection=ebc, dense_in_features=NUM_DENSE,
                          dense_arch_layer_sizes=[16, DIM], over_arch_layer_sizes=[16, 1]))


def apply_optimizers(model: DLRMTrain, tables: Sequence[Tuple[str, str, str]]) -> None:
    """Each table's embedding optimizer, as TorchRec's docs configure it."""
    ebc = model.model.sparse_arch.embedding_bag_collection
    for name, optimizer, _ in tables:
        cls, kwargs = OPTIMIZERS[optimizer]
        apply_optimizer_in_backward(cls, [ebc.embedding_bags[name].weight], dict(kwargs))


def shard(model: DLRMTrain, sharder, tables: Sequence[Tuple[str, str, str]], device: torch.device,
          pg=None, plan=None) -> DistributedModelParallel:
    """DistributedModelParallel over a plan from TorchRec's planner, each table constrained to its
    sharding type (or over `plan`); the unsharded model's weights loaded into it (so that both
    kernels start alike)."""
    pg = pg or dist.GroupMember.WORLD
    world = dist.get_world_size(pg)
    if plan is None:
        constraints = {name: ParameterConstraints(sharding_types=[st], compute_kernels=["fused"], min_partition=4)
                       for name, _, st in tables}
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=world, local_world_size=world, compute_device=device.type), constraints=constraints)
        plan = planner.collective_plan(model, [sharder], pg)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=[sharder])
    dmp.load_state_dict(state)
    return dmp


def optimizer_of(dmp: DistributedModelParallel, lr: float = 0.1) -> CombinedOptimizer:
    """The fused embedding optimizers and SGD for the dense layers, as one optimizer."""
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                  lambda params: torch.optim.SGD(params, lr=lr))
    return CombinedOptimizer([dmp.fused_optimizer, dense])


def make_batches(tables: Sequence[Tuple[str, str, str]], rows: int, batch: int, steps: int, seed: int = 1) -> List[Batch]:
    """`steps` global batches of TorchRec's Batch (dense features, a KJT, labels)."""
    gen = torch.Generator().manual_seed(seed)
    keys = [f"f_{name}" for name, _, _ in tables]
    out = []
    for _ in range(steps):
        lengths = [torch.randint(0, 5, (batch,), generator=gen) for _ in keys]
        values = [torch.randint(0, rows + 7 * i, (int(ln.sum()),), generator=gen) for i, ln in enumerate(lengths)]
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))
        out.append(Batch(dense_features=torch.randn(batch, NUM_DENSE, generator=gen), sparse_features=kjt,
                         labels=torch.randint(0, 2, (batch,), generator=gen).float()))
    return out


def local_batch(b: Batch, rank: int, world: int) -> Batch:
    """Rank `rank`'s equal slice of a global batch."""
    B = b.labels.numel() // world
    lo, hi = rank * B, (rank + 1) * B
    kjt = b.sparse_features
    keys = kjt.keys()
    lengths = kjt.lengths().view(len(keys), -1)
    offsets = kjt.offsets()
    G = lengths.shape[1]
    values = torch.cat([kjt.values()[offsets[f * G + lo]:offsets[f * G + hi]] for f in range(len(keys))])
    local = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths[:, lo:hi].reshape(-1).contiguous())
    return Batch(dense_features=b.dense_features[lo:hi], sparse_features=local, labels=b.labels[lo:hi])


def train(dmp: DistributedModelParallel, optimizer, batches: Iterable[Batch], device: torch.device) -> List[float]:
    """TorchRec's TrainPipelineSparseDist over the batches; the losses."""
    pipeline = TrainPipelineSparseDist(dmp, optimizer, device, execute_all_batches=True)
    it = iter(batches)
    losses = []
    while True:
        try:
            loss, _logits, _labels = pipeline.progress(it)  # (DLRMTrain's second output)
        except StopIteration:
            return losses
        losses.append(float(loss))


def gathered_state(dmp: DistributedModelParallel) -> Dict[str, torch.Tensor]:
    """Rank 0: every table's weight ("TABLE.weight") and fused optimizer state ("TABLE.STATE", TorchRec's
    names), assembled from all ranks' shards; {} elsewhere. Collective."""
    tensors = {k.split(".")[-2] + ".weight": v for k, v in dmp.state_dict().items()
               if ".embedding_bags." in k and k.endswith(".weight")}
    for entry in dmp.fused_optimizer.state_dict()["state"].values():
        tensors.update(entry)
    local = {}
    for key, t in tensors.items():
        if isinstance(t, ShardedTensor):
            local[key] = (tuple(t.size()), [(tuple(s.metadata.shard_offsets), s.tensor.detach().cpu().clone())
                                            for s in t.local_shards()])
        else:
            local[key] = (tuple(t.shape), [((0,) * t.dim(), t.detach().cpu().clone())])
    parts: List[Optional[dict]] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    if dist.get_rank() != 0:
        return {}
    out: Dict[str, torch.Tensor] = {}
    for part in parts:
        for key, (size, shards) in part.items():
            for offsets, tensor in shards:
                full = out.setdefault(key, torch.full(size, float("nan"), dtype=tensor.dtype))
                full[tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape))].copy_(tensor)
    return out


def run(sharder, tables, batches, device, rows: int, fused_params: bool = False) -> Dict[str, torch.Tensor]:
    """The whole recipe with one sharder: model, optimizers, DMP, pipeline; the gathered state."""
    model = build_model(tables, rows)
    if not fused_params:
        apply_optimizers(model, tables)
    dmp = shard(model, sharder, tables, device)
    rank, world = dist.get_rank(), dist.get_world_size()
    train(dmp, optimizer_of(dmp), [local_batch(b, rank, world).to(device) for b in batches], device)
    return gathered_state(dmp)


def compare(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """Per key, max |a - b| relative to max |b| (NaN where a key or a shape differs)."""
    out = {}
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b or a[key].shape != b[key].shape:
            out[key] = float("nan")
            continue
        scale = max(b[key].abs().max().item(), 1e-30)
        out[key] = (a[key].float() - b[key].float()).abs().max().item() / scale
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel", choices=["both", "tbegen", "fbgemm"], default="both")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=32, help="examples per rank per step")
    p.add_argument("--rows", type=int, default=40)
    p.add_argument("--sharding-types", default=None, help="default: table_wise,column_wise (and row_wise on CUDA)")
    p.add_argument("--fused-params", default=None, choices=["sgd", "adagrad", "rowwise_adagrad", "adam"],
                   help="configure every table with the sharder's fused_params (this EmbOptimType) instead of "
                        "apply_optimizer_in_backward")
    p.add_argument("--tolerance", type=float, default=1e-4, help="largest relative difference allowed")
    args = p.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    types = (args.sharding_types or ("table_wise,column_wise,row_wise" if device.type == "cuda" else
                                     "table_wise,column_wise")).split(",")
    on_fbgemm = list(OPTIMIZERS) if device.type == "cuda" else list(FBGEMM_CPU_OPTIMIZERS)
    optimizers = [args.fused_params] if args.fused_params else (on_fbgemm if args.kernel != "tbegen" else list(OPTIMIZERS))
    tables = table_names(optimizers, types)
    batches = make_batches(tables, args.rows, args.batch * world, args.steps)

    def sharders():
        if args.fused_params:
            from fbgemm_gpu.split_embedding_configs import EmbOptimType

            member = {"sgd": "EXACT_SGD", "adagrad": "EXACT_ADAGRAD", "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD",
                      "adam": "ADAM"}[args.fused_params]
            fused = {"optimizer": EmbOptimType[member], "learning_rate": 0.05}
            return {"tbegen": TbegenEmbeddingBagCollectionSharder(fused_params=fused),
                    "fbgemm": EmbeddingBagCollectionSharder(fused_params=fused)}
        return {"tbegen": TbegenEmbeddingBagCollectionSharder(), "fbgemm": EmbeddingBagCollectionSharder()}

    states = {}
    for kernel in (["tbegen", "fbgemm"] if args.kernel == "both" else [args.kernel]):
        states[kernel] = run(sharders()[kernel], tables, batches, device, args.rows, fused_params=bool(args.fused_params))
    if rank == 0:
        print(f"# {backend}, {world} rank(s), tables {[t[0] for t in tables]}, {args.steps} steps")
        if len(states) == 2:
            diffs = compare(states["tbegen"], states["fbgemm"])
            for key, d in diffs.items():
                print(f"{key:32s} max |tbegen - FBGEMM| / max |FBGEMM| = {d:.2e}")
            bad = [k for k, d in diffs.items() if not d <= args.tolerance]
            if bad:
                print(f"# FAILED (tolerance {args.tolerance}): {bad}")
        else:
            for key, t in sorted(next(iter(states.values())).items()):
                print(f"{key:32s} max |value| = {t.abs().max().item():.4e}")
    failed = rank == 0 and len(states) == 2 and any(not d <= args.tolerance for d in compare(states["tbegen"], states["fbgemm"]).values())
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
