"""tbegen/_sync_audit.py: the counter of operations that would make the host wait for a CUDA
device, run on the CPU. Each known waiting operation is counted once with its call site; the
operations that do not wait (integer indexing, sized repeat_interleave, sorts, H2D tensors) are not."""

from __future__ import annotations

import torch

from tbegen._sync_audit import SyncAudit

HERE = __file__


def _count(fn):
    x = torch.arange(12)
    with SyncAudit(paths=[HERE], simulate=True) as audit:
        fn(x)
    return audit


def test_waiting_operations_are_counted_with_their_site():
    waits = {
        "nonzero": lambda x: x.nonzero(),
        "where(cond)": lambda x: torch.where(x > 3),
        "unique": lambda x: torch.unique(x, return_counts=True),
        "unique_consecutive": lambda x: torch.unique_consecutive(x),
        "bool mask read": lambda x: x[x > 3],
        "bool mask write": lambda x: x.__setitem__(x > 3, torch.tensor(0)),
        "masked_select": lambda x: torch.masked_select(x, x > 3),
        "repeat_interleave": lambda x: torch.repeat_interleave(x[:3]),
        "item": lambda x: x[1].item(),
        "int": lambda x: int(x.sum()),
        "bool": lambda x: bool((x > 3).any()),
        "if tensor": lambda x: 1 if x[2] else 0,
        "tolist": lambda x: x.tolist(),
        "numpy": lambda x: x.numpy(),
        "cpu": lambda x: x.cpu(),
        "to cpu": lambda x: x.to("cpu"),
        "tensor of tensors": lambda x: torch.tensor([x[0], x[1]]),
        "bincount": lambda x: torch.bincount(x),
        "equal": lambda x: torch.equal(x, x),
        "tensor to the device": lambda x: torch.tensor([1, 2], device=x.device),
        "as_tensor to the device": lambda x: torch.as_tensor([1, 2], device=x.device),
        # (torch 2.11-2.13 on CUDA: the number becomes a CPU tensor that index_put_ copies to the
        # device without non_blocking)
        "setitem of a number at a tensor index": lambda x: x.__setitem__(torch.tensor([1, 3]), 5),
        "setitem of a bool at a tensor index": lambda x: (x > 3).__setitem__(torch.tensor([1]), True),
        "setitem of a number at a list index": lambda x: x.__setitem__([1, 3], 5),
        "setitem of a number at a row and tensor index": lambda x: x.view(3, 4).__setitem__((1, torch.tensor([0, 2])), 7),
        "setitem of a number into one element": lambda x: x.__setitem__(1, 5),
        "setitem of a number into one element of a matrix": lambda x: x.view(3, 4).__setitem__((1, 2), 5),
    }
    for name, fn in waits.items():
        audit = _count(fn)
        assert audit.count == 1, (name, audit.events)
        (site,) = audit.by_site()
        assert site.startswith("tests/test_sync_audit.py:") and site.endswith("<lambda>"), (name, site)


def test_operations_that_do_not_wait_are_not_counted():
    quiet = {
        "integer index": lambda x: x[torch.tensor([1, 3])],
        "integer index write": lambda x: x.__setitem__(torch.tensor([1, 3]), torch.tensor([5, 6])),
        "index_select / index_copy_": lambda x: x.index_copy_(0, torch.tensor([0]), x.index_select(0, torch.tensor([2]))),
        "sized repeat_interleave": lambda x: torch.repeat_interleave(x[:3], x[:3], output_size=3),
        "sort, cumsum, searchsorted": lambda x: torch.searchsorted(torch.sort(x).values.cumsum(0), x),
        "masked_fill with a number": lambda x: x.masked_fill(x > 3, 0),
        "where(cond, a, b)": lambda x: torch.where(x > 3, x, -x),
        "tensor of numbers": lambda x: torch.tensor([1, 2, 3]),
        "nonzero_static": lambda x: torch.nonzero_static(x > 3, size=4),
        "isin": lambda x: torch.isin(x, torch.tensor([1, 2])),
        "factories": lambda x: (torch.zeros(3, device=x.device), torch.arange(4, device=x.device),
                                x.new_full((2,), 7), torch.full_like(x, 3)),
        "setitem of a number into a slice or a row": lambda x: (x.__setitem__(slice(1, 2), 5), x.view(3, 4).__setitem__(1, 5)),
        "setitem of a device tensor at a tensor index": lambda x: x.__setitem__(torch.tensor([1]), x[2:3] * 2),
        "index_fill_ with a number": lambda x: x.index_fill_(0, torch.tensor([1, 3]), 5),
        "dtype change": lambda x: x.to(torch.int32),
    }
    for name, fn in quiet.items():
        assert _count(fn).count == 0, name


def test_patched_methods_are_restored_and_sections_split():
    before = (torch.Tensor.tolist, torch.Tensor.to, torch.tensor, torch.Tensor.__setitem__)
    x = torch.arange(4)
    with SyncAudit(paths=[HERE]) as audit:
        audit.mark("a")
        x.tolist()
        audit.mark("b")
        x[x > 1]
        x.nonzero()
    assert (torch.Tensor.tolist, torch.Tensor.to, torch.tensor, torch.Tensor.__setitem__) == before
    assert "to" not in vars(torch.Tensor) and "__setitem__" not in vars(torch.Tensor)  # (inherited again)
    assert [len(audit.sections[k]) for k in "ab"] == [1, 2]
    assert "in all" in audit.report()
