"""Train a DLRM-style model sharded by TorchRec, with tbegen's kernel and with FBGEMM's, and compare.

    torchrun --nproc_per_node=N examples/torchrec_training.py [--steps 20] [--batch 256] ...

One process per GPU with NCCL where CUDA is available, else gloo on the CPU. For each sharding type
(each table of the model constrained to it in TorchRec's planner) and each optimizer both systems
have, it trains the same model from the same start with

  - tbegen's kernel (TbegenEmbeddingBagCollectionSharder), and
  - TorchRec's own FBGEMM kernel (EmbeddingBagCollectionSharder, compute kernel "fused"),

gathers every table's weights and optimizer states to rank 0 and prints the largest differences
between the two, and between each and a single-process tbegen run of the same global batches on
rank 0 (the reference), with examples/s of both. Data-parallel runs tbegen only (TorchRec's own
data-parallel tables are trained by the dense optimizer, not by a fused kernel). Then one optimizer only tbegen has, loaded from a
YAML path, through the same run (compared with the reference only). Exit status 1 if a difference
exceeds --tolerance.

FBGEMM's CPU kernels have sgd, adagrad and rowwise_adagrad only, and TorchRec does not offer
row-wise sharding on the CPU; on the CPU this script offers row-wise to FBGEMM's sharder as well
(a subclass that adds the type), which works. Under column-wise sharding, per-row optimizer states
(rowwise_adagrad's) are kept per column shard by both systems, so they are compared with each
other, not with the unsharded reference.
"""

from __future__ import annotations

import os

# NVLink multicast stays off (also for any process a launcher starts from this environment).
for _key, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_key] = _value

import argparse
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tbegen.torchrec import SHARDING_TYPES as TBEGEN_SHARDING_TYPES, TbegenEmbeddingBagCollectionSharder  # noqa: E402
from tbegen.spec import find_spec, load_spec  # noqa: E402
from tbegen.torchrec import dlrm  # noqa: E402

# (data_parallel only where this TorchRec can hold tbegen's data-parallel tables: 1.7 and later)
SHARDING_TYPES = [t for t in ["table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"]
                  if t in TBEGEN_SHARDING_TYPES]
# tbegen optimizer -> FBGEMM's EmbOptimType name
FBGEMM_NAMES = {"sgd": "exact_sgd", "adagrad": "exact_adagrad", "rowwise_adagrad": "exact_row_wise_adagrad",
                "adam": "adam", "lamb": "lamb", "lars_sgd": "lars_sgd", "partial_rowwise_adam": "partial_row_wise_adam"}
# hyperparameters given to both (same names in tbegen and FBGEMM)
HYPERPARAMETERS = {"adagrad": ("eps",), "rowwise_adagrad": ("eps",), "adam": ("beta1", "beta2", "eps"), "sgd": ()}
FIXED = {"eps": 1e-8, "beta1": 0.9, "beta2": 0.999}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before the timed ones (same for both)")
    p.add_argument("--batch", type=int, default=128, help="examples per rank per step")
    p.add_argument("--tables", type=int, default=4, help="tables (each with one feature; the second has two)")
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--max-bag", type=int, default=8)
    p.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of the indices (0: uniform)")
    p.add_argument("--optimizers", default=None,
                   help="comma-separated, both systems (default: adagrad,rowwise_adagrad on the CPU, adam,rowwise_adagrad on CUDA)")
    p.add_argument("--yaml", default=str(Path(__file__).resolve().parents[1] / "optimizers" / "adagrad_with_momentum.yaml"),
                   help="a tbegen-only optimizer spec, by path")
    p.add_argument("--sharding-types", default=",".join(SHARDING_TYPES))
    p.add_argument("--learning-rate", type=float, default=0.02)
    p.add_argument("--tolerance", type=float, default=1e-3,
                   help="max abs difference allowed (fp32 rounding, amplified by adagrad-type optimizers)")
    return p.parse_args()


def log(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


def make_tables(args) -> List[dlrm.TableSpec]:
    return [
        dlrm.TableSpec(f"t{i}", args.rows * (1 + i % 3), args.dim, (f"f{i}",) if i != 1 else (f"f{i}", f"f{i}b"), args.max_bag)
        for i in range(args.tables)
    ]


class RowWiseOnCpuSharder:
    """TorchRec's FBGEMM sharder, also offering row-wise and table-row-wise on the CPU."""

    @staticmethod
    def make(fused_params):
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

        class _Sharder(EmbeddingBagCollectionSharder):
            def sharding_types(self, compute_device_type: str) -> List[str]:
                types = super().sharding_types(compute_device_type)
                return types + [t for t in ("row_wise", "table_row_wise") if t not in types]

        return _Sharder(fused_params=fused_params)


def hyperparameters(optimizer: str, lr: float) -> dict:
    return {"learning_rate": lr, **{k: FIXED[k] for k in HYPERPARAMETERS.get(optimizer, ())}}


def fbgemm_sharder(optimizer: str, lr: float):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    return RowWiseOnCpuSharder.make({"optimizer": EmbOptimType(FBGEMM_NAMES[optimizer]), **hyperparameters(optimizer, lr)})


def fbgemm_keys(tables, spec_states: List[str], fb: Dict[str, torch.Tensor]):
    """(tbegen key, FBGEMM key) pairs: weights by name, optimizer states in order (TorchRec calls
    FBGEMM's first state "momentum1" and the others by FBGEMM's names)."""
    pairs = []
    for t in tables:
        pairs.append((f"{t.name}.weight", f"{t.name}.weight"))
        theirs = [k for k in fb if k.startswith(t.name + ".") and k != f"{t.name}.weight"]
        if len(theirs) != len(spec_states):
            raise RuntimeError(f"FBGEMM has states {theirs} for {t.name}, tbegen {spec_states}")
        pairs += [(f"{t.name}.{s}", k) for s, k in zip(spec_states, theirs)]
    return pairs


def run_sharded(args, tables, batches, sharder, sharding_type, device, compute_device):
    """Trains the sharded model; returns (gathered state on rank 0, examples/s, ms per step, plan types)."""
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    model = dlrm.build_model(tables, args.num_dense, seed=0)
    dmp, plan = dlrm.shard(model, sharder, {t.name: sharding_type for t in tables}, dist.group.WORLD, device,
                           compute_device, min_partition=max(4, args.dim // 2))
    dense = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    opt = torch.optim.SGD(dense.values(), lr=args.learning_rate)
    rank, world = dist.get_rank(), dist.get_world_size()
    local = [dlrm.local_batch(b, rank, world).to(device) for b in batches]
    for b in local[: args.warmup]:
        dlrm.train_step(dmp, opt, b)
    _sync(device)
    dist.barrier()
    start = time.perf_counter()
    for b in local[args.warmup:]:
        dlrm.train_step(dmp, opt, b)
    _sync(device)
    dist.barrier()
    elapsed = time.perf_counter() - start
    timed = len(local) - args.warmup
    return dlrm.sharded_state(dmp), timed * args.batch * world / elapsed, 1e3 * elapsed / timed


def run_reference(args, tables, batches, optimizer, device):
    """Single-process tbegen on rank 0 over the global batches."""
    ref = dlrm.build_reference(dlrm.build_model(tables, args.num_dense, seed=0), tables, optimizer,
                               **hyperparameters(optimizer, args.learning_rate))
    ref = ref.to(device)
    opt = torch.optim.SGD(ref.parameters(), lr=args.learning_rate)
    for b in batches:
        dlrm.train_step(ref, opt, b.to(device))
    return {k: v.cpu() for k, v in dlrm.reference_state(ref, tables).items()}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def max_diff(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor], keys) -> float:
    worst = 0.0
    for ka, kb in keys:
        if a[ka].shape != b[kb].shape:
            raise RuntimeError(f"{ka} has shape {tuple(a[ka].shape)} but {kb} {tuple(b[kb].shape)}")
        worst = max(worst, (a[ka].float() - b[kb].float()).abs().max().item())
    return worst


def main():
    args = parse_args()
    args.num_dense = 8
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        compute_device = "cuda"
    else:
        device, compute_device = torch.device("cpu"), "cpu"
    optimizers = (args.optimizers or ("adam,rowwise_adagrad" if compute_device == "cuda" else "adagrad,rowwise_adagrad")).split(",")
    tables = make_tables(args)
    batches = dlrm.make_batches(tables, args.num_dense, args.batch * world, args.warmup + args.steps, zipf_alpha=args.zipf)
    log(f"# {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}  backend {backend}, {world} rank(s), "
        f"device {torch.cuda.get_device_name(device) if compute_device == 'cuda' else 'cpu'}, torch {torch.__version__}")
    log(f"# tables {[(t.name, t.rows, t.dim, len(t.features)) for t in tables]}, batch {args.batch}/rank, "
        f"steps {args.warmup}+{args.steps}, zipf {args.zipf}, lr {args.learning_rate}")
    log("| optimizer | sharding | tbegen vs FBGEMM | tbegen vs 1-process | FBGEMM vs 1-process | tbegen ex/s (ms/step) | FBGEMM ex/s (ms/step) |")
    log("|---|---|---|---|---|---|---|")
    failed = []
    for optimizer in optimizers + ["yaml"]:
        spec = args.yaml if optimizer == "yaml" else optimizer
        ref = run_reference(args, tables, batches, spec, device) if rank == 0 else None
        for st in args.sharding_types.split(","):
            tb, tb_rate, tb_ms = run_sharded(args, tables, batches,
                                             TbegenEmbeddingBagCollectionSharder(spec, **hyperparameters(optimizer, args.learning_rate)), st,
                                             device, compute_device)
            fb = None
            # TorchRec's data-parallel tables use its DENSE kernel (trained by the dense optimizer
            # through DDP), not FBGEMM's fused one: nothing to compare there
            if optimizer in FBGEMM_NAMES and st != "data_parallel":
                try:
                    fb, fb_rate, fb_ms = run_sharded(args, tables, batches, fbgemm_sharder(optimizer, args.learning_rate), st,
                                                     device, compute_device)
                except Exception as e:  # an optimizer or sharding type FBGEMM lacks here: say so and go on
                    log(f"# FBGEMM {optimizer} {st}: not run ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
            if rank != 0:
                continue
            name = Path(spec).stem if optimizer == "yaml" else optimizer
            # Column shards keep row states of their own (both systems), so training with per-row
            # states differs from the unsharded run there: printed, not held to the tolerance.
            row_states = any(s.per == "row" for s in load_spec(find_spec(spec)).states)
            per_shard = row_states and st in ("column_wise", "table_column_wise")
            comparable = [k for k in ref if k in tb and ref[k].shape == tb[k].shape]
            vs_ref = max_diff(tb, ref, [(k, k) for k in comparable])
            note = " (row states per column shard)" if per_shard else ""
            cells = ["-", f"{vs_ref:.2e}{note}", "-", f"{tb_rate:,.0f} ({tb_ms:.2f})", "-"]
            worst = 0.0 if per_shard else vs_ref
            if fb is not None:
                keys = fbgemm_keys(tables, [s.name for s in load_spec(find_spec(optimizer)).states], fb)
                vs_fb = max_diff(tb, fb, keys)
                fb_ref = max_diff({k: fb[kf] for k, kf in keys}, ref, [(k, k) for k, _ in keys if k in comparable])
                cells = [f"{vs_fb:.2e}", f"{vs_ref:.2e}{note}", f"{fb_ref:.2e}{note}", f"{tb_rate:,.0f} ({tb_ms:.2f})",
                         f"{fb_rate:,.0f} ({fb_ms:.2f})"]
                worst = max(worst, vs_fb)
            log(f"| {name} | {st} | " + " | ".join(cells) + " |")
            if worst > args.tolerance:
                failed.append(f"{name}/{st}: {worst:.2e}")
    if failed:
        log(f"# FAILED (tolerance {args.tolerance}): {', '.join(failed)}")
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
