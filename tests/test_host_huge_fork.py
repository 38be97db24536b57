"""host_empty_huge's mapping is not inherited by a forked child (review 4 of issue 27).

The buffer is a private anonymous mapping whose pages cudaHostRegister pins. Current drivers pin
with pin_user_pages, and then Linux copies every pinned page of such a mapping into the child
at fork time. A DataLoader worker forked from a training process holding tens of GB of tables
would copy all of them. With get_user_pages (older drivers), the parent's next CPU write would
move its page away from the one the GPU reads. host_empty_huge therefore advises MADV_DONTFORK
(smaps VmFlags "dc"), as the driver's own cudaHostAlloc mappings are not copied either.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Optional

import pytest
import torch

cuda = pytest.mark.cuda
linux = pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux only")


def vm_flags(address: int, smaps: str = "/proc/self/smaps") -> Optional[set]:
    """The VmFlags of this process's mapping that holds `address` (None: no mapping holds it)."""
    inside = False
    with open(smaps) as f:
        for line in f:
            head = line.split(None, 1)[0] if line.strip() else ""
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    return None


@linux
@pytest.mark.skipif(not hasattr(mmap, "MADV_DONTFORK"), reason="no MADV_DONTFORK in this Python")
def test_vm_flags_tell_a_mapping_advised_dontfork():
    """What the cuda test below reads: "dc" appears once a mapping is advised MADV_DONTFORK, and
    not before (so that test fails for the right reason on a buffer without the advice)."""
    size = 4 << 20
    m = mmap.mmap(-1, size)
    view = ctypes.c_char.from_buffer(m)
    try:
        address = ctypes.addressof(view)
        before = vm_flags(address)
        assert before is not None and "dc" not in before
        m.madvise(mmap.MADV_DONTFORK)
        assert "dc" in vm_flags(address)
        assert vm_flags(0) is None
    finally:
        del view
        m.close()


@cuda
@linux
def test_cuda_host_empty_huge_is_not_inherited_by_a_fork():
    from tbegen.module import TableBatchedEmbeddingBags

    ops = TableBatchedEmbeddingBags([(8, 4)], optimizer="sgd", device="cuda")._ops
    t = ops.host_empty_huge((8 << 20) // 4, torch.float32, torch.device("cuda"))
    flags = vm_flags(t.data_ptr())
    assert flags is not None and "dc" in flags, flags
    # (the contents still reach the GPU and back)
    t.fill_(3.0)
    assert float(t.sum()) == 3.0 * t.numel()
