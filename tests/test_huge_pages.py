"""Large CPU buffers are advised into transparent huge pages (tbegen/placement.py,
`advise_huge_pages`; TBEGEN_HUGE_PAGES=0 switches it off): a hint that changes no result."""

import re
import sys

import pytest
import torch

from tbegen import placement
from tbegen.module import TableBatchedEmbeddingBags

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc/self/smaps are Linux's")


def _advised(address: int) -> bool:
    """Whether the mapping that holds `address` carries MADV_HUGEPAGE (VmFlags "hg")."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                inside = int(m.group(1), 16) <= address < int(m.group(2), 16)
            elif inside and line.startswith("VmFlags:"):
                return "hg" in line.split()
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.fixture
def huge_pages(monkeypatch):
    def switch(on: bool):
        monkeypatch.setenv("TBEGEN_HUGE_PAGES", "1" if on else "0")
        placement._libc_madvise.cache_clear()
    yield switch
    placement._libc_madvise.cache_clear()


@linux
def test_a_large_cpu_buffer_is_advised_and_a_small_one_is_not(huge_pages):
    huge_pages(True)
    big = torch.empty(3 << 20)  # (12 MB)
    assert placement.advise_huge_pages(big)
    assert _advised(big.data_ptr() + (6 << 20))
    assert not placement.advise_huge_pages(torch.empty(1 << 18))  # (1 MB: no whole huge page to gain)
    huge_pages(False)
    other = torch.empty(3 << 20)
    assert not placement.advise_huge_pages(other)
    assert not _advised(other.data_ptr() + (6 << 20))


@linux
def test_a_modules_weights_and_states_are_advised(huge_pages):
    huge_pages(True)
    emb = TableBatchedEmbeddingBags([(40_000, 64), (20, 8)], optimizer="adagrad")  # (10 MB of weights)
    middle = emb.weights.numel() * emb.weights.element_size() // 2
    assert _advised(emb.weights.data_ptr() + middle)
    state = next(iter(emb.states.buffers()))
    assert _advised(state.data_ptr() + middle)


def test_the_results_are_the_same_with_and_without(huge_pages):
    results = []
    for on in (True, False):
        huge_pages(on)
        torch.manual_seed(0)
        emb = TableBatchedEmbeddingBags([(40_000, 32), (30_000, 16)], optimizer="rowwise_adagrad",
                                        learning_rate=0.1)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            indices = torch.randint(0, 30_000, (64,), generator=g)
            offsets = torch.arange(0, 65, 4)
            out = emb(indices, offsets)
            out.backward(torch.randn(out.shape, generator=g))
        results.append((emb.weights.clone(), out.detach().clone()))
    assert all(torch.equal(a, b) for a, b in zip(*results))
