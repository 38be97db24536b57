"""FBGEMM's WARNING / IGNORE bounds check in the FBGEMM-compatible class without a host wait on
the GPU (tbegen/fbgemm_compat.py, `_zero_out_of_range_on_device`): every out-of-range index
becomes 0 as on the CPU path, and the WARNING comes from a finding read later (a pinned copy
behind an event), once per module. The CPU tests run the device path on CPU tensors (no event
there) against the CPU path; the `cuda` tests check that a forward with the check waits for
nothing (torch's sync debug mode) and still warns."""

from __future__ import annotations

import warnings

import pytest
import torch

from tbegen.fbgemm_compat import BoundsCheckMode, ComputeDevice, EmbeddingLocation, EmbOptimType
from tbegen.fbgemm_compat import SplitTableBatchedEmbeddingBagsCodegen as Compat

TABLES = [(7, 4), (3, 8), (11, 4)]
FTM = [0, 1, 2, 0]


def _compat(mode, device="cpu"):
    where = (EmbeddingLocation.HOST, ComputeDevice.CPU) if device == "cpu" else (EmbeddingLocation.DEVICE, ComputeDevice.CUDA)
    return Compat([(E, D, *where) for E, D in TABLES], feature_table_map=FTM, optimizer=EmbOptimType.EXACT_SGD,
                  learning_rate=0.1, bounds_check_mode=mode)


def _batch(seed, B=5, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(FTM) * B,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    idx = torch.randint(-3, 14, (int(offsets[-1]),), generator=g)  # (some below 0, some past their table)
    return idx.to(device), offsets.to(device)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_device_path_zeroes_what_the_cpu_path_zeroes(seed, dtype):
    m = _compat(BoundsCheckMode.IGNORE)
    idx, offsets = _batch(seed)
    idx, offsets = idx.to(dtype), offsets.to(dtype)
    want = m._zero_out_of_range(idx, offsets)  # (the CPU path)
    got = m._zero_out_of_range_on_device(idx, offsets)
    assert got.dtype == idx.dtype and torch.equal(got, want)
    assert bool((idx != want).any())  # (the batches do have bad indices)


def test_device_path_leaves_malformed_offsets_to_the_operators():
    m = _compat(BoundsCheckMode.IGNORE)
    idx = torch.tensor([1, 20, 2])
    for offsets in (torch.tensor([0, 1, 3]), torch.zeros(0, dtype=torch.int64)):  # (not F * B + 1 entries)
        assert m._zero_out_of_range_on_device(idx, offsets) is idx


def test_device_path_warns_once_from_its_finding():
    m = _compat(BoundsCheckMode.WARNING)
    idx, offsets = torch.tensor([1, 9, 2, 0, 5, -1]), torch.tensor([0, 2, 3, 5, 6])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = m._zero_out_of_range_on_device(idx, offsets)  # (the finding is kept, not read)
    assert torch.equal(out, torch.tensor([1, 0, 2, 0, 5, 0]))
    with pytest.warns(UserWarning, match=r"2 index\(es\) out of range .* indices\[1\] = 9 for feature 0, whose table has 7 rows"):
        m._poll_bounds_warning()
    assert m._bounds_pending is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (once per module)
        m._zero_out_of_range_on_device(idx, offsets)
        m._poll_bounds_warning()
    # a batch without bad indices: no warning, and a later bad batch still warns
    m2 = _compat(BoundsCheckMode.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m2._zero_out_of_range_on_device(torch.tensor([1, 2, 2, 0, 5, 0]), offsets)
        m2._poll_bounds_warning()
    m2._zero_out_of_range_on_device(idx, offsets)
    with pytest.warns(UserWarning, match="out of range"):
        m2._poll_bounds_warning()



@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_device_path_and_its_warning_read_nothing_on_the_host(dtype):
    """The device path with WARNING, then the poll that warns: no value of a (stand-in) device
    tensor read by the host (the sync audit's simulate mode). x[t] with a 0-d tensor t is such a
    read (TensorIndexing.h calls t.item()), and so was int() of the table's rows in the warning;
    the pinned finding's tolist is host memory and is not counted here."""
    from tbegen._sync_audit import SyncAudit

    m = _compat(BoundsCheckMode.WARNING)
    idx, offsets = _batch(3)
    idx, offsets = idx.to(dtype), offsets.to(dtype)
    with SyncAudit(simulate=True) as audit:
        m._zero_out_of_range_on_device(idx, offsets)
        with pytest.warns(UserWarning, match="out of range"):
            m._poll_bounds_warning()
    reads = [e for e in audit.events if not e.what.startswith("Tensor.tolist()")]
    assert not reads, audit.report(reads)

# ---- on the GPU ----------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("mode", [BoundsCheckMode.WARNING, BoundsCheckMode.IGNORE])
def test_cuda_bounds_check_waits_for_nothing_and_matches_the_cpu(mode):
    """Each forward waits for nothing (sync debug mode 'error') and matches the CPU's; WARNING
    warns once, from a later call (the next forward, once the GPU has copied the first batch's
    finding: the .cpu() below waits for it) or the final poll, IGNORE never. (The module's first
    forward reads its features table to the host once, HostFeaturesCache in cuda_ops.cuh, a wait
    that landing10 saw here: a forward of an in-range batch first, outside the check.)"""
    cpu, gpu = _compat(mode), _compat(mode, "cuda")
    with torch.no_grad():  # (the same starting weights: the two placements' state_dict keys differ)
        for theirs, ours in zip(cpu.split_embedding_weights(), gpu.split_embedding_weights()):
            ours.copy_(theirs)
        gpu(torch.zeros(len(FTM), dtype=torch.int64, device="cuda"), torch.arange(len(FTM) + 1, device="cuda"))
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in range(4):
            idx, offsets = _batch(seed)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                want = cpu(idx, offsets)
            # (on the GPU before the check: a copy from pageable host memory is itself a wait,
            # the caller's, not the forward's; landing9 failed here for that)
            idx, offsets = idx.cuda(), offsets.cuda()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                got = gpu(idx, offsets)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)
        gpu._poll_bounds_warning(wait=True)
    warned = [w for w in caught if "out of range" in str(w.message)]
    assert len(warned) == (1 if mode == BoundsCheckMode.WARNING else 0), [str(w.message) for w in caught]
