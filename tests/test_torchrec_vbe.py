"""Variable batch size per feature (VBE) through TorchRec: a KeyedJaggedTensor whose features have
different batch sizes (stride_per_key_per_rank, with inverse_indices, as TorchRec feeds VBE)
into an EmbeddingBagCollection under DistributedModelParallel, 2 gloo ranks, table-wise and
column-wise, with tbegen's sharder and with TorchRec's FBGEMM sharder: the outputs and the
weights after each step agree (float32 rounding: both kernels sum in different orders).
"""

from __future__ import annotations

import os

import pytest
import torch
from ranks import free_port  # (tests/ranks.py)

torchrec = pytest.importorskip("torchrec")
pytest.importorskip("fbgemm_gpu")

from tbegen import TableBatchedEmbeddingBags  # noqa: E402
from tbegen.torchrec import TbegenEmbeddingBagCollectionSharder, dlrm  # noqa: E402

WORLD = 2
STEPS = 2
TABLES = [("t0", 23, 8, "table_wise"), ("t1", 17, 12, "column_wise"), ("t2", 19, 4, "table_wise")]
LR = 0.1


def _kjt(step, rank):
    """This rank's batch: feature f has its own batch size (1 to 4 + rank), bags of 0-3 indices."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(100 * step + rank)
    keys, lengths, values, strides = [], [], [], []
    for name, rows, _, _ in TABLES:
        b = int(torch.randint(1, 5 + rank, (1,), generator=gen))
        ln = torch.randint(0, 4, (b,), generator=gen)
        keys.append("f_" + name)
        strides.append([b])
        lengths.append(ln)
        values.append(torch.randint(0, rows, (int(ln.sum()),), generator=gen))
    B = max(s[0] for s in strides)
    # each sample of the full batch B reads one of its feature's bags
    inverse = torch.stack([torch.arange(B) % s[0] for s in strides])
    return KeyedJaggedTensor(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths).to(torch.int64),
                             stride_per_key_per_rank=strides, inverse_indices=(keys, inverse))


def _model(mean=()):
    """The collection; the tables named in `mean` pool by mean (TorchRec then groups them apart
    from the sum tables: two kernels on a rank, whose VBE outputs TorchRec merges)."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    torch.manual_seed(0)
    return EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=n, num_embeddings=E, embedding_dim=D, feature_names=["f_" + n],
                           pooling=PoolingType.MEAN if n in mean else PoolingType.SUM)
        for n, E, D, _ in TABLES
    ], device=torch.device("cpu"))


def _run(sharder, rank, out, mean=()):
    import torch.distributed as dist

    # (with a mean table, every table table-wise: a rank holding a sum and the mean table has two
    # kernels in one lookup)
    sharding = {n: "table_wise" if mean else st for n, _, _, st in TABLES}
    dmp, _ = dlrm.shard(_model(mean), sharder, sharding, dist.group.WORLD, torch.device("cpu"), "cpu", min_partition=4)
    out["groups"] = max(len(lookup._emb_modules) for m in _sharded_collections(dmp) for lookup in m._lookups)
    outs = []
    for step in range(STEPS):
        kt = dmp(_kjt(step, rank))
        values = kt.values()
        out["keys"] = list(kt.keys())  # (the sharded output's column order: by sharding, then group)
        outs.append(values.detach().clone())
        proj = torch.randn(values.shape, generator=torch.Generator().manual_seed(7 + step + 10 * rank))
        (values * proj).sum().backward()
    weights = {k: v for k, v in dmp.state_dict().items() if k.endswith(".weight")}
    out.update(outputs=outs, weights=dlrm.gather_sharded(weights))


def _sharded_collections(dmp):
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    return [m for m in dmp.modules() if isinstance(m, ShardedEmbeddingBagCollection)]


def _worker(rank, port, outdir, mean=()):
    import torch.distributed as dist
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel  # noqa: F401
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    calls = []
    vbe = TableBatchedEmbeddingBags._forward_vbe
    # (counts the module's VBE calls in this forked rank: the kernel must take the VBE path)
    TableBatchedEmbeddingBags._forward_vbe = lambda self, *a: calls.append(a[-1]) or vbe(self, *a)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        res = {}
        kinds = [("tbegen", TbegenEmbeddingBagCollectionSharder("sgd", learning_rate=LR))]
        if not mean:  # (FBGEMM CPU cannot merge a VBE batch over two kernels: "pre-allocated vbe_output is
            # not supported on CPU"; that case is checked against the unsharded collection instead)
            kinds.append(("fbgemm", EmbeddingBagCollectionSharder(fused_params={"optimizer": EmbOptimType.EXACT_SGD,
                                                                                "learning_rate": LR})))
        for kind, sharder in kinds:
            res[kind] = {}
            _run(sharder, rank, res[kind], mean)
            res[kind]["vbe_calls"] = list(calls)
            calls.clear()
        torch.save(res, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _unsharded(mean, keys):
    """The same training on the unsharded collection (plain SGD over both ranks' batches, their
    gradients averaged, as TorchRec's gradient division does for the sharded fused SGD): each
    rank's outputs per step (in the sharded output's column order `keys`), the final weights."""
    ebc = _model(mean)
    opt = torch.optim.SGD(ebc.parameters(), lr=LR / WORLD)
    outs = {rank: [] for rank in range(WORLD)}
    for step in range(STEPS):
        opt.zero_grad()
        for rank in range(WORLD):
            kt = ebc(_kjt(step, rank))
            values = torch.cat([kt[k] for k in keys], dim=1)  # (in the sharded output's column order)
            outs[rank].append(values.detach().clone())
            proj = torch.randn(values.shape, generator=torch.Generator().manual_seed(7 + step + 10 * rank))
            (values * proj).sum().backward()
        opt.step()
    return outs, {k: v.detach().clone() for k, v in ebc.state_dict().items()}


@pytest.mark.parametrize("mean", [(), ("t2",)], ids=["one-group", "sum-and-mean-groups"])
def test_vbe_kjt_under_dmp_trains_like_fbgemm(tmp_path, mean):
    """One kernel per lookup: tbegen's sharder against TorchRec's FBGEMM sharder. With t2 pooled
    by mean (every table table-wise), a rank's lookup has two kernels (a sum group and a mean
    group), whose VBE outputs TorchRec merges into one rank-major output (FBGEMM's kernels write
    into a preallocated output, which FBGEMM CPU refuses; tbegen's lookup merges the kernels' own
    outputs by TorchRec's split and concatenation): tbegen's sharder against the unsharded
    collection trained with plain SGD."""
    TableBatchedEmbeddingBags([(4, 4)], optimizer="sgd")  # (built or loaded before the ranks fork)
    torch.multiprocessing.start_processes(_worker, args=(free_port(), str(tmp_path), mean), nprocs=WORLD, join=True,
                                          start_method="fork")
    groups = []
    if mean:
        outs, weights = _unsharded(mean, torch.load(tmp_path / "rank0.pt", weights_only=False)["tbegen"]["keys"])
    for rank in range(WORLD):
        res = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        groups.append(res["tbegen"]["groups"])
        if mean:
            res["fbgemm"] = {"outputs": outs[rank], "weights": weights if rank == 0 else {}, "vbe_calls": []}
        # every step's lookups went through the module's VBE path, with batch sizes that differ
        assert len(res["tbegen"]["vbe_calls"]) >= STEPS and not res["fbgemm"]["vbe_calls"]
        assert any(len({b for per_rank in bsfr for b in per_rank}) > 1 for bsfr in res["tbegen"]["vbe_calls"])
        for ours, theirs in zip(res["tbegen"]["outputs"], res["fbgemm"]["outputs"]):
            assert ours.shape == theirs.shape
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        if rank == 0:
            assert sorted(res["tbegen"]["weights"]) == sorted(res["fbgemm"]["weights"])
            initial = _model(mean).state_dict()
            for k, w in res["fbgemm"]["weights"].items():
                torch.testing.assert_close(res["tbegen"]["weights"][k], w, rtol=1e-5, atol=1e-6)
                assert not torch.equal(w, initial[k]), f"{k} did not move"
    assert max(groups) == (2 if mean else 1), groups
