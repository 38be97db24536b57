"""tbegen's sharder as a drop-in for TorchRec's: a training script written as TorchRec's docs write it
(examples/torchrec_training.py: DLRM, apply_optimizer_in_backward or the sharder's fused_params,
the planner, DistributedModelParallel, CombinedOptimizer, TrainPipelineSparseDist) with only the
sharder swapped trains like TorchRec's FBGEMM kernel, and checkpoints move between the two kernels.

One spawn of gloo ranks per world size (2 and 3) runs every case (ranks forked from the test
process; rank 0 writes the gathered results for the test process to check):

- "per_table": tables trained by torch.optim.SGD, torch.optim.Adagrad and torchrec's
  RowWiseAdagrad (apply_optimizer_in_backward, one optimizer per table), each table-wise and
  column-wise, with TorchRec's FBGEMM sharder and with `TbegenEmbeddingBagCollectionSharder()`;
  both save a checkpoint (torch.distributed.checkpoint of the DMP state_dict and the fused
  optimizer's) after CHECKPOINT_AFTER steps, which a fresh model of the other kernel loads and
  trains on from;
- "fused_params": the sharder's fused_params (EXACT_ROWWISE_ADAGRAD, with its hyperparameters), both
  kernels;
- "adam": torch.optim.Adam tables. FBGEMM's CPU kernel has no Adam ("Optimizer adam is not
  supported in CPU mode", checked below), so on the CPU the tbegen-sharded model is compared with
  the unsharded TorchRec model trained by an Adam update written out here as FBGEMM defines it
  (rows in the batch only, bias correction by the step count); on the GPU test, with FBGEMM's kernel;
- configurations tbegen refuses (no optimizer at all, a conflict, a hyperparameter the optimizer
  does not use): the error on every rank.

Tolerance: the two kernels do the same float32 arithmetic in different orders (pooling sums,
gradient sums per row; TorchRec's all-to-alls and reduce-scatters are the same), and the dense
layers feed the differences back, so the results are equal within float32 rounding, not bitwise:
after 3 steps the largest difference relative to the tensor's largest value measured 4e-10 (sgd)
to 7e-7 (adam against the written-out update, adagrad against FBGEMM), on 2 and 3 ranks. Held to
1e-5: a wrong learning rate, optimizer, epsilon or state layout differs by 1e-3 or more (each
table is checked to have moved by at least 50 times the tolerance), and so does a hyperparameter
rounded otherwise (Adam's 1 - beta2 taken in float64 instead of the kernels' float32: 1.3e-5).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from ranks import free_port, start_rank  # (tests/ranks.py)

torchrec = pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("torchrec_training_example", ROOT / "examples" / "torchrec_training.py")
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)

STEPS = 3
CHECKPOINT_AFTER = 2
ROWS = 30
BATCH_PER_RANK = 6
TOLERANCE = 1e-5
CPU_TYPES = ["table_wise", "column_wise"]


def _sharders(kind, fused_params=None):
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from tbegen.torchrec import TbegenEmbeddingBagCollectionSharder

    if kind == "tbegen":
        return TbegenEmbeddingBagCollectionSharder(fused_params=fused_params)
    return EmbeddingBagCollectionSharder(fused_params=fused_params)


def _build(tables, sharder, device, seed=0, optimizers=True, plan=None):
    model = example.build_model(tables, ROWS, seed=seed)
    if optimizers:
        example.apply_optimizers(model, tables)
    return example.shard(model, sharder, tables, device, plan=plan)


def _train(dmp, batches, rank, world, device):
    example.train(dmp, example.optimizer_of(dmp), [example.local_batch(b, rank, world).to(device) for b in batches], device)


def _kernels(dmp):
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    for m in dmp.modules():
        if isinstance(m, ShardedEmbeddingBagCollection):
            for lookup in m._lookups:
                yield from getattr(lookup, "_emb_modules", [])


def _structure(dmp):
    """Keys and global shapes of the DMP's state_dict and of its fused optimizer's state."""
    model = {k: tuple(v.size()) for k, v in dmp.state_dict().items()}
    optim = {k: tuple(v.size()) for entry in dmp.fused_optimizer.state_dict()["state"].values() for k, v in entry.items()}
    return model, optim


def _optimizer_state(dmp):
    """The fused optimizer's state_dict without the empty entries of stateless tables (sgd's):
    torch.distributed.checkpoint saves nothing for an empty dict and then misses it on loading,
    for FBGEMM's kernel as for tbegen's."""
    state = dmp.fused_optimizer.state_dict()
    return {**state, "state": {k: v for k, v in state["state"].items() if v}}


def _per_table(key, rank, world, device, outdir, optimizers):
    """Both kernels, apply_optimizer_in_backward per table, and the checkpoints across."""
    import torch.distributed.checkpoint as dcp

    types = ["table_wise", "column_wise", "row_wise"] if key == "cuda" else CPU_TYPES
    tables = example.table_names(optimizers, types)
    batches = example.make_batches(tables, ROWS, BATCH_PER_RANK * world, STEPS)
    out = {}
    other = {"fbgemm": "tbegen", "tbegen": "fbgemm"}
    for kind in ("fbgemm", "tbegen"):
        dmp = _build(tables, _sharders(kind), device)
        out[f"{kind}_structure"] = _structure(dmp)
        _train(dmp, batches[:CHECKPOINT_AFTER], rank, world, device)
        dcp.save({"model": dmp.state_dict(), "optim": _optimizer_state(dmp)}, checkpoint_id=os.path.join(outdir, f"{key}-{kind}"))
        # in memory as well: the other kernel under the same plan (other initial weights) takes this
        # model's state_dict and its fused optimizer's, as they are
        # (with the param groups, TorchRec's save_param_groups: the learning rates come along; the
        # twin's are set wrong first)
        twin = _build(tables, _sharders(other[kind]), device, seed=5, plan=dmp.plan)
        for group in twin.fused_optimizer.param_groups:
            group["lr"] = 0.777
        dmp.fused_optimizer.save_param_groups(True)
        twin.fused_optimizer.save_param_groups(True)
        twin.load_state_dict(dmp.state_dict())
        twin.fused_optimizer.load_state_dict(dmp.fused_optimizer.state_dict())
        for model in (dmp, twin):  # (CombinedOptimizer wants the same setting in all its parts)
            model.fused_optimizer.save_param_groups(False)
        twin.fused_optimizer.set_optimizer_step(CHECKPOINT_AFTER)
        _train(dmp, batches[CHECKPOINT_AFTER:], rank, world, device)
        out[kind] = example.gathered_state(dmp)
        if kind == "tbegen":
            # TorchRec's update_hyper_parameters reaches every kernel (lr through the param groups,
            # the others directly), and the next step keeps them
            dmp.fused_optimizer.update_hyper_parameters({"lr": 0.25, "eps": 1e-4})
            dmp.fused_optimizer.step()
            mine = {(k.emb_module.get_learning_rate(), k.emb_module.hyperparameters.get("eps", -1.0)) for k in _kernels(dmp)}
            every = [None] * world
            torch.distributed.all_gather_object(every, mine)
            out["updated"] = sorted(set().union(*every))
        _train(twin, batches[CHECKPOINT_AFTER:], rank, world, device)
        out[f"{other[kind]}_given_{kind}"] = example.gathered_state(twin)
    # a fresh model of the other kernel (other initial weights) restored from each checkpoint
    for saved, kind in (("fbgemm", "tbegen"), ("tbegen", "fbgemm")):
        fresh = _build(tables, _sharders(kind), device, seed=5)
        state = {"model": fresh.state_dict(), "optim": _optimizer_state(fresh)}
        dcp.load(state, checkpoint_id=os.path.join(outdir, f"{key}-{saved}"))
        fresh.load_state_dict(state["model"])
        optim = fresh.fused_optimizer.state_dict()
        optim["state"].update(state["optim"]["state"])
        fresh.fused_optimizer.load_state_dict(optim)
        fresh.fused_optimizer.set_optimizer_step(CHECKPOINT_AFTER)  # (TorchRec's state has no step counter)
        _train(fresh, batches[CHECKPOINT_AFTER:], rank, world, device)
        out[f"{kind}_from_{saved}"] = example.gathered_state(fresh)
    return out


def _fused_params(key, rank, world, device):
    """Both kernels configured by the sharder's fused_params (TorchRec's EmbOptimType)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    types = ["table_wise", "column_wise", "row_wise"] if key == "cuda" else CPU_TYPES
    tables = example.table_names(["fp"], types)
    batches = example.make_batches(tables, ROWS, BATCH_PER_RANK * world, STEPS, seed=3)
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.07, "eps": 1e-6}
    out = {}
    for kind in ("fbgemm", "tbegen"):
        dmp = _build(tables, _sharders(kind, dict(fused)), device, optimizers=False)
        _train(dmp, batches, rank, world, device)
        out[kind] = example.gathered_state(dmp)
    return out


def _adam_reference(tables, batches, lr):
    """The unsharded TorchRec model trained on the global batches: the embedding tables by Adam as
    FBGEMM defines it (only the rows in the batch; bias correction 1 - beta^step; FBGEMM's
    defaults beta1 0.9, beta2 0.999, eps 1e-8, weight_decay 0), the dense layers by SGD (lr 0.1)."""
    model = example.build_model(tables, ROWS)
    ebc = model.model.sparse_arch.embedding_bag_collection
    embedding = {name: ebc.embedding_bags[name].weight for name, _, _ in tables}
    dense = [p for n, p in model.named_parameters() if ".embedding_bags." not in n]
    moments = {name: (torch.zeros_like(w), torch.zeros_like(w)) for name, w in embedding.items()}
    # in float32, as the kernels hold them (1 - beta2 is 0.00099998713 then, not 0.001)
    beta1, beta2, eps = (torch.tensor(v, dtype=torch.float32) for v in (0.9, 0.999, 1e-8))
    for step, b in enumerate(batches, start=1):
        loss, _ = model(b)
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in dense:
                p -= 0.1 * p.grad
            bias1, bias2 = (torch.tensor(1.0 - float(b) ** step, dtype=torch.float32) for b in (beta1, beta2))
            for name, w in embedding.items():
                rows = b.sparse_features[f"f_{name}"].values().unique()
                g = w.grad[rows]
                m, v = moments[name]
                m[rows] = beta1 * m[rows] + (1 - beta1) * g
                v[rows] = beta2 * v[rows] + (1 - beta2) * g * g
                w[rows] -= lr * ((m[rows] / bias1) / ((v[rows] / bias2).sqrt() + eps))
    out = {}
    for name, w in embedding.items():
        out[f"{name}.weight"] = w.detach().clone()
        out[f"{name}.momentum1"], out[f"{name}.exp_avg_sq"] = (t.clone() for t in moments[name])
    return out


def _adam_on_cpu(rank, world, device):
    tables = example.table_names(["adam"], CPU_TYPES)
    batches = example.make_batches(tables, ROWS, BATCH_PER_RANK * world, STEPS, seed=4)
    dmp = _build(tables, _sharders("tbegen"), device)
    _train(dmp, batches, rank, world, device)
    got = example.gathered_state(dmp)
    lr = example.OPTIMIZERS["adam"][1]["lr"]
    return {"tbegen": got, "reference": _adam_reference(tables, batches, lr) if rank == 0 else None}


def _refusals(rank, world, device):
    """What tbegen refuses, as each rank sees it (the same error everywhere, no rank left waiting)."""
    from tbegen.torchrec import TbegenEmbeddingBagCollectionSharder

    tables = example.table_names(["sgd"], CPU_TYPES)
    cases = {
        "no optimizer": (TbegenEmbeddingBagCollectionSharder(), None),
        "conflict": (TbegenEmbeddingBagCollectionSharder("adam"), (torch.optim.SGD, {"lr": 0.1})),
        "unused momentum": (TbegenEmbeddingBagCollectionSharder(), (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})),
        "torch-only argument": (TbegenEmbeddingBagCollectionSharder(), (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.01})),
    }
    out = {}
    for name, (sharder, optimizer) in cases.items():
        model = example.build_model(tables, ROWS)
        if optimizer is not None:
            ebc = model.model.sparse_arch.embedding_bag_collection
            from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

            apply_optimizer_in_backward(optimizer[0], list(ebc.parameters()), dict(optimizer[1]))
        try:
            example.shard(model, sharder, tables, device)
            out[name] = None
        except Exception as e:  # noqa: BLE001 - the test checks the type and message
            out[name] = f"{type(e).__name__}: {e}"
    return out


def _worker(rank, world, port, outdir, key):
    import torch.distributed as dist

    on_gpu = key == "cuda"
    device = start_rank(rank, world, port, on_gpu)
    try:
        result = {"refusals": {rank: _refusals(rank, world, device)}}
        optimizers = list(example.OPTIMIZERS) if on_gpu else list(example.FBGEMM_CPU_OPTIMIZERS)
        result["per_table"] = _per_table(key, rank, world, device, outdir, optimizers)
        result["fused_params"] = _fused_params(key, rank, world, device)
        if not on_gpu:
            result["adam"] = _adam_on_cpu(rank, world, device)
        refusals = [None] * world
        dist.all_gather_object(refusals, result["refusals"])
        result["refusals"] = {r: v for part in refusals for r, v in part.items()}
        if rank == 0:
            torch.save(result, os.path.join(outdir, f"{key}.pt"))
    finally:
        dist.destroy_process_group()


def _launch(key, world, outdir, start_method):
    from tbegen import TableBatchedEmbeddingBags

    for name in ("sgd", "adagrad", "rowwise_adagrad", "adam"):  # extensions built (or loaded) once, before the ranks
        TableBatchedEmbeddingBags([(4, 4)], optimizer=name)
    torch.multiprocessing.start_processes(_worker, args=(world, free_port(), str(outdir), key), nprocs=world,
                                          join=True, start_method=start_method)
    return torch.load(outdir / f"{key}.pt", weights_only=False)


@pytest.fixture(scope="module", params=[2, 3])
def results(request, tmp_path_factory):
    world = request.param
    return world, _launch(world, world, tmp_path_factory.mktemp(f"torchrec_config{world}"), "fork")


def _relative_diffs(got, want):
    assert sorted(got) == sorted(want), f"keys differ: {sorted(got)} vs {sorted(want)}"
    out = {}
    for k in want:
        assert got[k].shape == want[k].shape, (k, got[k].shape, want[k].shape)
        assert not torch.isnan(got[k]).any(), f"{k} not fully gathered"
        out[k] = (got[k].cpu().float() - want[k].cpu().float()).abs().max().item() / want[k].abs().max().item()
    return out


def _check_close(got, want, what):
    diffs = _relative_diffs(got, want)
    bad = {k: d for k, d in diffs.items() if not d <= TOLERANCE}
    assert not bad, f"{what}: relative differences above {TOLERANCE}: {bad}"
    worst = max(diffs, key=diffs.get)
    print(f"{what}: largest relative difference {diffs[worst]:.1e} ({worst}) over {len(diffs)} tensors")
    return diffs


def _check_per_table(r, optimizers, types):
    tables = [name for name, _, _ in example.table_names(optimizers, types)]
    # the same state_dict and fused optimizer state (keys, TorchRec's state names, global shapes)
    assert r["tbegen_structure"] == r["fbgemm_structure"]
    want_keys = {f"{t}.weight" for t in tables}
    want_keys |= {f"{t}.momentum1" for t in tables if not t.startswith("sgd")}
    want_keys |= {f"{t}.exp_avg_sq" for t in tables if t.startswith("adam")}
    assert set(r["fbgemm"]) == want_keys
    _check_close(r["tbegen"], r["fbgemm"], "tbegen vs FBGEMM, apply_optimizer_in_backward")
    # (sgd has no eps)
    assert set(r["updated"]) == {(0.25, -1.0), (0.25, 1e-4)}, r["updated"]
    # every table and state moved during training (not a comparison of untouched initial values)
    initial = example.build_model(example.table_names(optimizers, types), ROWS).state_dict()
    for t in tables:
        start = initial[f"model.sparse_arch.embedding_bag_collection.embedding_bags.{t}.weight"]
        moved = (r["fbgemm"][f"{t}.weight"] - start).abs().max() / start.abs().max()
        assert moved > 50 * TOLERANCE, (t, moved)  # so that a wrong learning rate or update would show
    _check_close(r["tbegen_from_fbgemm"], r["fbgemm"], "FBGEMM checkpoint restored into tbegen, trained on")
    _check_close(r["fbgemm_from_tbegen"], r["tbegen"], "tbegen checkpoint restored into FBGEMM, trained on")
    _check_close(r["tbegen_given_fbgemm"], r["fbgemm"], "FBGEMM's state_dicts loaded into tbegen in memory, trained on")
    _check_close(r["fbgemm_given_tbegen"], r["tbegen"], "tbegen's state_dicts loaded into FBGEMM in memory, trained on")


def test_trains_like_fbgemm_with_apply_optimizer_in_backward(results):
    world, r = results
    _check_per_table(r["per_table"], list(example.FBGEMM_CPU_OPTIMIZERS), CPU_TYPES)


def test_trains_like_fbgemm_with_fused_params(results):
    world, r = results
    assert set(r["fused_params"]["tbegen"]) == {f"fp_{t}.{s}" for t in CPU_TYPES for s in ("weight", "momentum1")}
    _check_close(r["fused_params"]["tbegen"], r["fused_params"]["fbgemm"], "tbegen vs FBGEMM, fused_params")


def test_adam_trains_like_fbgemms_adam_on_cpu(results):
    world, r = results
    # the reference is in float32 as well, summed in another order (one process, dense gradients)
    _check_close(r["adam"]["tbegen"], r["adam"]["reference"], "tbegen adam vs FBGEMM's adam written out")


def test_fbgemm_cpu_has_no_adam():
    """Why the CPU adam case compares with a written-out update: TorchRec's FBGEMM kernel cannot run
    it on the CPU. If a later fbgemm-gpu-cpu can, this fails: compare with it instead."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen

    with pytest.raises(AssertionError, match="not supported in CPU mode"):
        SplitTableBatchedEmbeddingBagsCodegen([(10, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)], optimizer=EmbOptimType.ADAM)


def test_refusals_are_errors_on_every_rank(results):
    world, r = results
    assert sorted(r["refusals"]) == list(range(world))
    for rank, seen in r["refusals"].items():
        assert seen["no optimizer"] is not None and "no optimizer is configured" in seen["no optimizer"], seen
        assert "two optimizers are configured" in (seen["conflict"] or ""), seen
        assert "does not use momentum=0.9" in (seen["unused momentum"] or ""), seen
        assert "lr_decay" in (seen["torch-only argument"] or ""), seen


@pytest.mark.cuda
def test_nccl_one_gpu_trains_like_fbgemm(tmp_path):
    """One NCCL rank on the GPU: tbegen vs FBGEMM_GPU for sgd, adagrad, rowwise_adagrad and adam
    (apply_optimizer_in_backward), table-wise, column-wise and row-wise, checkpoints across, and
    the fused_params configuration."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ[k] = v
    r = _launch("cuda", 1, tmp_path, "spawn")
    types = ["table_wise", "column_wise", "row_wise"]
    _check_per_table(r["per_table"], list(example.OPTIMIZERS), types)
    _check_close(r["fused_params"]["tbegen"], r["fused_params"]["fbgemm"], "tbegen vs FBGEMM, fused_params")
    for seen in r["refusals"].values():
        assert "no optimizer is configured" in (seen["no optimizer"] or ""), seen


# ---- the configuration rules, without processes ---------------------------------------------------


def _resolve(fused_params, sharder_optimizer=None, **sharder_kwargs):
    from tbegen.torchrec import TbegenEmbeddingBagCollectionSharder
    from tbegen.torchrec.config import resolve

    sharder = TbegenEmbeddingBagCollectionSharder(sharder_optimizer, **sharder_kwargs)
    return resolve({**sharder.fused_params, **fused_params}, "table 't'")


def test_each_emb_optim_type_maps_to_the_same_update_with_fbgemms_defaults():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    r = _resolve({"optimizer": EmbOptimType.ADAM})
    # FBGEMM's defaults (learning rate 0.01), not the spec's (adam's is 0.001)
    assert (r.spec.name, r.fbgemm_optimizer) == ("adam", "ADAM")
    assert r.hyperparameters == {"learning_rate": 0.01, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}
    r = _resolve({"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.3, "eps": 1e-5})
    assert (r.spec.name, r.hyperparameters) == ("adagrad", {"learning_rate": 0.3, "eps": 1e-5})
    r = _resolve({"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "weight_decay": 0.01, "weight_decay_mode": 2})
    assert r.spec.name == "rowwise_adagrad" and r.hyperparameters["weight_decay_mode"] == 2
    assert _resolve({"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.2}).hyperparameters == {"learning_rate": 0.2}
    # weight decay 0 asks for nothing: accepted by an optimizer without it
    assert _resolve({"optimizer": EmbOptimType.EXACT_SGD, "weight_decay": 0.0}).spec.name == "sgd"
    # the plan's and the user's kernel settings
    r = _resolve({"optimizer": EmbOptimType.EXACT_SGD, "stochastic_rounding": False, "output_dtype": "fp16"})
    assert (r.stochastic_rounding, r.output_dtype) == (False, torch.float16)
    assert _resolve({"optimizer": EmbOptimType.EXACT_SGD}).stochastic_rounding is True


def test_a_tbegen_spec_stays_available_by_name_and_agrees_or_conflicts():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    # by name alone: the spec's own defaults (the existing way)
    r = _resolve({}, "adam")
    assert r.hyperparameters["learning_rate"] == 0.001 and r.source == "tbegen spec 'adam'"
    r = _resolve({}, str(ROOT / "optimizers" / "ftrl.yaml"))
    assert r.spec.name == "ftrl" and r.fbgemm_optimizer is None
    # the same update both ways: one optimizer, hyperparameters from both
    r = _resolve({"optimizer": EmbOptimType.ADAM, "learning_rate": 0.05}, "adam", eps=1e-6)
    assert (r.hyperparameters["learning_rate"], r.hyperparameters["eps"]) == (0.05, 1e-6)
    with pytest.raises(ValueError, match="two optimizers are configured"):
        _resolve({"optimizer": EmbOptimType.EXACT_SGD}, "adam")
    with pytest.raises(ValueError, match="given twice with different values"):
        _resolve({"optimizer": EmbOptimType.ADAM, "learning_rate": 0.05}, "adam", learning_rate=0.1)
    with pytest.raises(ValueError, match="stochastic_rounding"):
        _resolve({"optimizer": EmbOptimType.ADAM, "stochastic_rounding": True}, stochastic_rounding=False)


def test_what_tbegen_cannot_honour_is_an_error():
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from tbegen.torchrec import TbegenEmbeddingBagCollectionSharder

    with pytest.raises(ValueError, match="no optimizer is configured"):
        _resolve({})
    with pytest.raises(ValueError, match="no optimizer is configured"):
        _resolve({"learning_rate": 0.1})  # FBGEMM would train EXACT_SGD
    with pytest.raises(ValueError, match="does not use momentum=0.9"):
        _resolve({"optimizer": EmbOptimType.EXACT_SGD, "momentum": 0.9})
    with pytest.raises(ValueError, match="does not use weight_decay=0.1"):
        _resolve({"optimizer": EmbOptimType.EXACT_ADAGRAD, "weight_decay": 0.1})
    with pytest.raises(TypeError, match="betas"):
        _resolve({"optimizer": EmbOptimType.ADAM, "betas": (0.9, 0.99)})
    with pytest.raises(NotImplementedError, match="EmbOptimType.NONE"):
        _resolve({"optimizer": EmbOptimType.NONE})
    with pytest.raises(NotImplementedError, match="weight_decay_mode COUNTER"):
        _resolve({"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "weight_decay_mode": 3})
    with pytest.raises(NotImplementedError, match="gradient_clipping"):
        _resolve({"optimizer": EmbOptimType.EXACT_SGD, "gradient_clipping": True})
    with pytest.raises(NotImplementedError, match="bounds_check_mode WARNING"):
        _resolve({"optimizer": EmbOptimType.EXACT_SGD, "bounds_check_mode": 1})
    with pytest.raises(NotImplementedError, match="output_dtype INT8"):
        _resolve({"optimizer": EmbOptimType.EXACT_SGD, "output_dtype": "int8"})
    with pytest.raises(TypeError, match="must be an EmbOptimType"):
        _resolve({"optimizer": "adam"})
    # the sharder's own fused_params are checked when it is built
    with pytest.raises(ValueError, match="does not use momentum"):
        TbegenEmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.ADAM, "momentum": 0.5})
    with pytest.raises(TypeError, match="without a tbegen optimizer"):
        TbegenEmbeddingBagCollectionSharder(learning_rate=0.1)
    # TorchRec's sharder takes fused_params first: so does tbegen's
    s = TbegenEmbeddingBagCollectionSharder({"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.1})
    assert s.fused_params["optimizer"] == EmbOptimType.EXACT_ADAGRAD and s.options.spec is None


def test_torchrec_state_names():
    from tbegen.spec import find_spec, load_spec
    from tbegen.torchrec.config import torchrec_state_names

    names = {n: torchrec_state_names(load_spec(find_spec(n)))
             for n in ("sgd", "adagrad", "rowwise_adagrad", "adam", "lars_sgd", "partial_rowwise_adam", "ftrl")}
    assert names == {"sgd": (), "adagrad": ("momentum1",), "rowwise_adagrad": ("momentum1",),
                     "adam": ("momentum1", "exp_avg_sq"), "lars_sgd": ("momentum1",),
                     "partial_rowwise_adam": ("momentum1", "exp_avg_sq"), "ftrl": None}
