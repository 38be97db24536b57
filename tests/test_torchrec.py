"""tbegen as TorchRec's compute kernel: DistributedModelParallel over gloo (2 and 3 CPU ranks) trains
a small DLRM-style model equal to single-process tbegen training, for every sharding type.

Each world size is one spawn of processes that runs all its cases (every table of the model has
its own sharding type, so one training run covers all of them); rank 0 also trains the
single-process reference on the same global batches and writes both, gathered, for the test
process to compare. Skipped where torchrec is not installed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torchrec = pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

from ranks import free_port, start_rank  # noqa: E402  (tests/ranks.py)
from tbegen import TableBatchedEmbeddingBags  # noqa: E402
from tbegen.torchrec import SHARDING_TYPES, TbegenEmbeddingBagCollectionSharder, dlrm  # noqa: E402
from tbegen.torchrec.kernel import DATA_PARALLEL_SUPPORTED  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NUM_DENSE = 4
STEPS = 3
CHECKPOINT_AFTER = 2  # steps before the checkpoint; the restored model trains the rest

# Per-element optimizer states only: column-wise shards then train exactly like the whole table
# (per-row states are kept per column shard, by FBGEMM too, and differ from unsharded training).
CASES = {
    2: [
        {"name": "adam", "optimizer": "adam", "hyper": {"learning_rate": 0.02},
         "types": ["table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise", "data_parallel"],
         "checkpoint": True},
    ],
    3: [
        {"name": "adagrad_with_momentum (YAML path, weighted features)", "optimizer": str(ROOT / "optimizers" / "adagrad_with_momentum.yaml"),
         "hyper": {"learning_rate": 0.05, "momentum": 0.8}, "weighted": True,
         "types": ["table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"], "checkpoint": False},
    ],
}
CASES["cuda"] = CASES[2]
# On the GPU, TorchRec's FUSED_UVM (tbegen placement "managed") and FUSED_UVM_CACHING
# ("managed_caching": a GPU cache of a fifth of the rows, TorchRec's default) tables beside FUSED
# ones, so that one group mixes placements; the checkpoint flushes the cached rows.
CASES["cuda_uvm"] = [
    {"name": "adam, UVM and UVM caching", "optimizer": "adam", "hyper": {"learning_rate": 0.02},
     "types": ["table_wise", "row_wise", "column_wise", "table_wise"],
     "kernels": {"t0": "fused_uvm_caching", "t1": "fused_uvm", "t2": "fused_uvm_caching"},
     "checkpoint": True},
]
# TorchRec before 1.7 cannot hold tbegen's data-parallel tables (see DATA_PARALLEL_SUPPORTED): the
# cases then train the other sharding types
for _cases in CASES.values():
    for _case in _cases:
        _case["types"] = [t for t in _case["types"] if t in SHARDING_TYPES]


def _tables(types):
    dims = [8, 12, 24, 16, 24, 8]
    rows = [40, 61, 30, 50, 27, 33]
    return [
        dlrm.TableSpec(f"t{i}", rows[i], dims[i], (f"f{i}",) if i != 1 else (f"f{i}", f"f{i}b"))
        for i in range(len(types))
    ]


def _train(dmp, opt, batches, rank, world, device):
    for b in batches:
        dlrm.train_step(dmp, opt, dlrm.local_batch(b, rank, world).to(device))


def _kernels(dmp):
    """The embedding kernels of every sharded EmbeddingBagCollection in the model."""
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    for m in dmp.modules():
        if isinstance(m, ShardedEmbeddingBagCollection):
            for lookup in m._lookups:
                yield from getattr(lookup, "_emb_modules", [])


def _dense_optimizer(dmp):
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    return torch.optim.SGD(dict(in_backward_optimizer_filter(dmp.named_parameters())).values(), lr=0.1)


def _run_case(case, rank, world, outdir, key, device):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    tables = _tables(case["types"])
    types = {t.name: st for t, st in zip(tables, case["types"])}
    weighted = case.get("weighted", False)
    batches = dlrm.make_batches(tables, NUM_DENSE, 6 * world, STEPS, seed=7, weighted=weighted)
    sharder = TbegenEmbeddingBagCollectionSharder(case["optimizer"], **case["hyper"])

    model = dlrm.build_model(tables, NUM_DENSE, seed=0, weighted=weighted)
    if rank == 0:
        ref = dlrm.build_reference(model, tables, case["optimizer"], **case["hyper"]).to(device)
        initial = dlrm.reference_state(ref, tables)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for b in batches:
            dlrm.train_step(ref, ref_opt, b.to(device))
    dmp, plan = dlrm.shard(model, sharder, types, dist.group.WORLD, device, device.type, min_partition=4,
                           compute_kernels=case.get("kernels"))
    planned = {name: ps.sharding_type for name, ps in plan.plan["sparse"].items()}
    kernels = {type(k).__name__ for k in _kernels(dmp)}
    opt = _dense_optimizer(dmp)
    # the placements the kernels' tbegen modules were built with, table by table
    placements = {t.name: p for k in _kernels(dmp) for t, p in zip(k.config.embedding_tables, k.emb_module.placements)}
    result = {"planned": planned, "kernels": sorted(kernels), "placements": placements,
              "compute_kernels": {name: ps.compute_kernel for name, ps in plan.plan["sparse"].items()}}
    if case["checkpoint"]:
        _train(dmp, opt, batches[:CHECKPOINT_AFTER], rank, world, device)
        path = os.path.join(outdir, "checkpoint")
        dcp.save({"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}, checkpoint_id=path)
        _train(dmp, opt, batches[CHECKPOINT_AFTER:], rank, world, device)
        result["got"] = dlrm.sharded_state(dmp)
        # a fresh model with other weights, restored from the checkpoint, trains the remaining steps
        fresh, _ = dlrm.shard(dlrm.build_model(tables, NUM_DENSE, seed=5, weighted=weighted), sharder, types, dist.group.WORLD, device,
                              device.type, min_partition=4, compute_kernels=case.get("kernels"))
        state = {"model": fresh.state_dict(), "optim": fresh.fused_optimizer.state_dict()}
        dcp.load(state, checkpoint_id=path)
        fresh.load_state_dict(state["model"])
        fresh.fused_optimizer.load_state_dict(state["optim"])
        # TorchRec's state of an FBGEMM optimizer (adam's too) has no update counter, for FBGEMM's
        # kernel as for tbegen's (the same keys, so that checkpoints move between them): TorchRec's
        # set_optimizer_step restores it. (tbegen-only specs keep it as TABLE.step.)
        fresh.fused_optimizer.set_optimizer_step(CHECKPOINT_AFTER)
        _train(fresh, _dense_optimizer(fresh), batches[CHECKPOINT_AFTER:], rank, world, device)
        result["restored"] = dlrm.sharded_state(fresh)
    else:
        _train(dmp, opt, batches, rank, world, device)
        result["got"] = dlrm.sharded_state(dmp)
    # an LR schedule acts on the fused optimizer's param groups; step() hands the value to the kernels
    for group in dmp.fused_optimizer.param_groups:
        group["lr"] = 0.125
    dmp.fused_optimizer.step()
    result["kernel_lrs"] = sorted({k.emb_module.get_learning_rate() for k in _kernels(dmp)})
    if rank == 0:
        result["want"] = dlrm.reference_state(ref, tables)
        result["initial"] = initial
        torch.save(result, os.path.join(outdir, f"{key}-{case['name']}.pt"))


def _worker(rank, world, port, outdir, key):
    import torch.distributed as dist

    device = start_rank(rank, world, port, on_gpu=str(key).startswith("cuda"))
    try:
        for case in CASES[key]:
            _run_case(case, rank, world, outdir, key, device)
    finally:
        dist.destroy_process_group()


def _launch(key, world, outdir, start_method):
    for case in CASES[key]:  # build (or load) the extensions once, before the ranks start
        TableBatchedEmbeddingBags([(4, 4)], optimizer=case["optimizer"])
    torch.multiprocessing.start_processes(_worker, args=(world, free_port(), str(outdir), key), nprocs=world,
                                          join=True, start_method=start_method)
    return {case["name"]: torch.load(outdir / f"{key}-{case['name']}.pt", weights_only=False) for case in CASES[key]}


@pytest.fixture(scope="module", params=[2, 3])
def world_results(request, tmp_path_factory):
    world = request.param
    # fork: the ranks inherit the imported torch, torchrec and tbegen (a fresh import of torchrec
    # costs seconds of CPU per process)
    return world, _launch(world, world, tmp_path_factory.mktemp(f"torchrec{world}"), "fork")


def _max_diffs(got, want):
    assert sorted(got) == sorted(want), f"keys differ: {sorted(got)} vs {sorted(want)}"
    # (on the host: a rank's tensors may be on its GPU, the single-process reference's on the CPU)
    return {k: (got[k].cpu() - want[k].cpu()).abs().max().item() for k in want}


def _check_equal_to_single_process(key, results):
    for case in CASES[key]:
        r = results[case["name"]]
        assert r["planned"] == {f"t{i}": st for i, st in enumerate(case["types"])}
        assert "TbegenEmbeddingBag" in r["kernels"] and "BatchedFusedEmbeddingBag" not in r["kernels"]
        assert r["kernel_lrs"] == [0.125]
        diffs = _max_diffs(r["got"], r["want"])
        # every table and state moved: the comparison is not one of untouched initial values
        moved = _max_diffs(r["got"], r["initial"])
        assert min(moved.values()) > 0, moved
        # fp32 summation order differs between the sharded and the single-process runs
        scale = {k: r["want"][k].abs().max().item() for k in diffs}
        bad = {k: (d, scale[k]) for k, d in diffs.items() if d > 1e-5 * scale[k]}
        assert not bad, f"{key}, {case['name']}: sharded vs single-process differences {bad}"
        print(f"{key}: {case['name']}: max |sharded - single process| per table: "
              + ", ".join(f"{k} {d:.1e}" for k, d in sorted(diffs.items())))


def _check_checkpoint(key, results):
    cases = [c for c in CASES[key] if c["checkpoint"]]
    for case in cases:
        # restored after CHECKPOINT_AFTER steps and trained on: bitwise the uninterrupted run
        # (adam's bias correction would show a lost step counter, its states lost moments)
        restored = _max_diffs(results[case["name"]]["restored"], results[case["name"]]["got"])
        assert all(d == 0 for d in restored.values()), restored
    return len(cases)


def test_sharded_training_equals_single_process(world_results):
    world, results = world_results
    _check_equal_to_single_process(world, results)


def test_checkpoint_keeps_weights_and_optimizer_states(world_results):
    world, results = world_results
    if not _check_checkpoint(world, results):
        pytest.skip(f"the checkpoint case runs with 2 ranks, not {world}")


@pytest.mark.cuda
def test_nccl_one_gpu_equals_single_process(tmp_path):
    """DMP over NCCL with one rank on the GPU (every sharding type, shards on the one rank),
    against single-process tbegen on the same GPU; checkpoint round trip included."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    # NVLink multicast stays off, also in the spawned ranks' environment
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ[k] = v
    # spawn: a forked child cannot use CUDA once the parent has
    results = _launch("cuda", 1, tmp_path, "spawn")
    _check_equal_to_single_process("cuda", results)
    assert _check_checkpoint("cuda", results) == 1


@pytest.mark.cuda
def test_nccl_uvm_and_uvm_caching_equal_single_process(tmp_path):
    """TorchRec's FUSED_UVM and FUSED_UVM_CACHING compute kernels on the GPU (one NCCL rank) run as
    tbegen's managed and managed_caching placements, train like single-process tbegen, and keep
    their cached rows through a checkpoint."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ[k] = v
    results = _launch("cuda_uvm", 1, tmp_path, "spawn")
    case = CASES["cuda_uvm"][0]
    r = results[case["name"]]
    want = {t: {"fused": "device", "fused_uvm": "managed", "fused_uvm_caching": "managed_caching"}[case["kernels"].get(t, "fused")]
            for t in r["planned"]}
    assert r["compute_kernels"] == {t: case["kernels"].get(t, "fused") for t in r["planned"]}
    assert r["placements"] == want, r["placements"]
    _check_equal_to_single_process("cuda_uvm", results)
    assert _check_checkpoint("cuda_uvm", results) == 1


def test_sharder_checks_its_arguments():
    with pytest.raises(TypeError, match="unknown hyperparameter"):
        TbegenEmbeddingBagCollectionSharder("adam", lr=0.1)
    with pytest.raises(ValueError, match="sharding_types"):
        TbegenEmbeddingBagCollectionSharder("adam", sharding_types=["grid_shard"])
    with pytest.raises(ValueError, match="dense gradients"):
        TbegenEmbeddingBagCollectionSharder("none")
    s = TbegenEmbeddingBagCollectionSharder(str(ROOT / "optimizers" / "ftrl.yaml"))
    # row-wise (and data-parallel) is offered on the CPU as well, with tbegen's fused kernel for every type
    assert s.sharding_types("cpu") == list(SHARDING_TYPES)
    assert "row_wise" in s.sharding_types("cpu")
    if DATA_PARALLEL_SUPPORTED:
        assert "data_parallel" in s.sharding_types("cpu")
    else:
        with pytest.raises(ValueError, match="TorchRec 1.7"):
            TbegenEmbeddingBagCollectionSharder("adam", sharding_types=["data_parallel"])
    assert s.compute_kernels("row_wise", "cpu") == ["fused"]
    # on GPUs also fused_uvm and fused_uvm_caching (tbegen's "managed" and "managed_caching"
    # placements), for model-parallel shardings as TorchRec
    assert s.compute_kernels("row_wise", "cuda") == ["fused", "fused_uvm", "fused_uvm_caching"]
    assert s.compute_kernels("data_parallel", "cuda") == ["fused"]
