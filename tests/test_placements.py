"""Table placements (tbegen/placement.py, docs/placements.md): the `placements` argument of
TableBatchedEmbeddingBags, its errors, and its mapping from FBGEMM's EmbeddingLocation and
TorchRec's compute kernels.

CPU tests check the API. CUDA tests (marked `cuda`, skipped without a GPU) check that a module
with managed tables trains bitwise like an all-device one, that its buffers really are managed
memory with the per-table hints, and that state_dicts move between placements.
"""

from __future__ import annotations

import io
import types

import pytest
import torch

import tbegen
from tbegen import placement
from tbegen.fbgemm_compat import ComputeDevice, EmbeddingLocation, SplitTableBatchedEmbeddingBagsCodegen, _devices
from tbegen.module import TableBatchedEmbeddingBags

cuda = pytest.mark.cuda
TABLES = [(40, 8), (25, 12), (16, 4)]


@pytest.fixture(scope="module", autouse=True)
def built(prebuilt):
    for name in ("sgd", "adam"):
        TableBatchedEmbeddingBags([(4, 4)], optimizer=name)


def batches(tables, steps, B=6, L=3, seed=1, device="cpu", weighted=False):
    """`steps` batches of ragged bags (some empty, up to 2L-1 long, repeats likely) with an output
    gradient each: [indices, offsets, per-sample weights or None, grad]."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        lengths = [int(n) for n in torch.randint(0, 2 * L, (len(tables) * B,), generator=g)]
        idx = torch.cat([torch.randint(0, tables[k // B][0], (n,), generator=g) for k, n in enumerate(lengths)])
        offsets = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
        psw = torch.rand(idx.numel(), generator=g) if weighted else None
        grad = torch.randn(B, sum(D for _, D in tables), generator=g)
        out.append([t.to(device) if t is not None else None for t in (idx, offsets, psw, grad)])
    return out


def train(emb, data):
    for idx, offsets, psw, grad in data:
        emb(idx, offsets, psw).backward(grad)
    return emb


def assert_same_training_state(a, b):
    assert torch.equal(a.weights, b.weights)
    for s in a.spec.states:
        assert torch.equal(a.optimizer_state(s.name), b.optimizer_state(s.name)), s.name
    assert a.step == b.step


# ---- the argument ------------------------------------------------------------------------------


def test_default_is_device_and_one_string_means_every_table():
    emb = TableBatchedEmbeddingBags(TABLES, optimizer="sgd")
    assert emb.placements == ("device",) * 3
    assert "placements" not in repr(emb)
    emb = TableBatchedEmbeddingBags(TABLES, optimizer="sgd", placements="managed")
    assert emb.placements == ("managed",) * 3
    emb = TableBatchedEmbeddingBags(TABLES, optimizer="sgd", placements=("device", "managed", "device"))
    assert emb.placements == ("device", "managed", "device")
    assert "placements=['device', 'managed', 'device']" in repr(emb)
    assert emb.state_dict()["_extra_state"]["placements"] == ["device", "managed", "device"]


@pytest.mark.parametrize(
    "placements,error,message",
    [
        (["device", "hbm", "device"], ValueError,
         r"placements\[1\] must be one of \['device', 'managed', 'managed_caching', 'host'\], got 'hbm'"),
        (["device", "managed"], ValueError, r"placements has 2 entries but the module has 3 table\(s\)"),
        (3, TypeError, r"placements must be a list with one placement per table"),
        ([None, "device", "device"], ValueError, r"placements\[0\] must be one of"),
    ],
)
def test_bad_placements_are_named(placements, error, message):
    with pytest.raises(error, match=message):
        TableBatchedEmbeddingBags(TABLES, optimizer="sgd", placements=placements)


def test_misspelt_argument_gets_a_suggestion():
    with pytest.raises(TypeError, match=r"'placement' \(did you mean 'placements'\?\)"):
        TableBatchedEmbeddingBags(TABLES, optimizer="sgd", placement="managed")


def test_managed_refused_with_dense_gradients():
    with pytest.raises(ValueError, match=r"placement 'managed' with optimizer 'none' \(dense gradients\)"):
        TableBatchedEmbeddingBags(TABLES, optimizer="none", placements=["device", "managed", "device"])
    TableBatchedEmbeddingBags(TABLES, optimizer="none", placements="device")  # the default stays allowed


def test_cpu_managed_is_host_memory_and_trains_like_device():
    """On the CPU "managed" is ordinary host memory: same buffers, same numbers."""
    data = batches(TABLES, 4, weighted=True)
    a = train(TableBatchedEmbeddingBags(TABLES, optimizer="adam", learning_rate=0.05), data)
    b = train(TableBatchedEmbeddingBags(TABLES, optimizer="adam", learning_rate=0.05,
                                        placements=["managed", "device", "managed"]), data)
    assert not placement.needs_managed(b.placements, b.weights.device)
    assert placement.memory_kind(None, b.weights) == "cpu"
    assert_same_training_state(a, b)


def test_state_dict_moves_between_placements_on_the_cpu():
    data = batches(TABLES, 3, seed=2)
    a = train(TableBatchedEmbeddingBags(TABLES, optimizer="adam", placements="managed"), data[:2])
    b = TableBatchedEmbeddingBags(TABLES, optimizer="adam", seed=9)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b.load_state_dict(torch.load(buf))
    assert b.placements == ("device",) * 3  # the placements are the module's, not the checkpoint's
    assert_same_training_state(train(a, data[2:]), train(b, data[2:]))


def test_placements_with_narrow_and_int_states_on_the_cpu():
    """States are allocated in their storage dtype wherever they live (a bf16 state, an int64
    state), and train as with the default placement."""
    data = batches(TABLES, 3, seed=4, weighted=True)
    kw = dict(optimizer="rowwise_adagrad_with_counter", learning_rate=0.05, state_dtypes={"momentum": "bf16"})
    a = train(TableBatchedEmbeddingBags(TABLES, **kw), data)
    b = train(TableBatchedEmbeddingBags(TABLES, placements=["managed", "device", "managed"], **kw), data)
    for m in (a, b):
        assert m.optimizer_state("momentum").dtype == torch.bfloat16
        assert m.optimizer_state("prev_iter").dtype == torch.int64
        assert m.optimizer_state("row_counter").dtype == torch.float32
    assert_same_training_state(a, b)
    assert int(b.optimizer_state("prev_iter").max()) == 3  # (the last step touched some row)


def test_cpu_host_is_host_memory_and_trains_like_device():
    """On the CPU "host" is ordinary host memory, as "managed" is: same buffers, same numbers."""
    data = batches(TABLES, 4, weighted=True)
    a = train(TableBatchedEmbeddingBags(TABLES, optimizer="adam", learning_rate=0.05), data)
    b = train(TableBatchedEmbeddingBags(TABLES, optimizer="adam", learning_rate=0.05, placements="host"), data)
    c = train(TableBatchedEmbeddingBags(TABLES, optimizer="adam", learning_rate=0.05,
                                        placements=["host", "device", "managed"]), data)
    assert placement.memory_kind(None, b.weights) == "cpu"
    assert_same_training_state(a, b)
    assert_same_training_state(a, c)


def test_what_the_buffers_are_allocated_in():
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert placement.buffer_memory(["host", "host"], gpu) == "host"  # page-locked, mapped
    assert placement.buffer_memory(["host", "device"], gpu) == "managed"  # host tables hinted as managed
    assert placement.buffer_memory(["managed_caching", "host"], gpu) == "managed"
    assert placement.buffer_memory(["device", "device"], gpu) is None
    assert placement.buffer_memory(["host", "managed"], cpu) is None


def test_host_refused_with_dense_gradients():
    with pytest.raises(ValueError, match=r"placement 'host' with optimizer 'none'"):
        TableBatchedEmbeddingBags(TABLES, optimizer="none", placements=["device", "host", "device"])


def test_allocate_off_the_gpu_is_an_ordinary_tensor():
    t = placement.allocate(None, 10, torch.float16, torch.device("cpu"), ["managed"], [(0, 10)])
    assert t.shape == (10,) and t.dtype == torch.float16 and t.device.type == "cpu"
    assert placement.needs_managed(["device", "managed"], torch.device("cuda"))
    assert not placement.needs_managed(["device", "device"], torch.device("cuda"))


def test_managed_operators_missing_from_a_cpu_build_are_named():
    cpu_ops = types.SimpleNamespace()  # a CPU-only extension has no managed_empty
    with pytest.raises(RuntimeError, match="built without CUDA, so it has no managed-memory operators"):
        placement.allocate(cpu_ops, 10, torch.float32, torch.device("cuda"), ["managed"], [(0, 10)])


# ---- FBGEMM's EmbeddingLocation and TorchRec's compute kernels ------------------------------------


def test_fbgemm_locations_map_onto_placements():
    specs = [(10, 4, EmbeddingLocation.MANAGED, ComputeDevice.CUDA), (7, 8, "DEVICE", "CUDA"), (5, 4, 1, 1),
             (6, 4, EmbeddingLocation.MANAGED_CACHING, ComputeDevice.CUDA)]
    tables, placements, dev = _devices(specs, "cuda:0")
    assert tables == [(10, 4), (7, 8), (5, 4), (6, 4)]
    assert placements == ["managed", "device", "managed", "managed_caching"]
    assert dev == torch.device("cuda", 0)
    tables, placements, dev = _devices([(10, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)], None)
    assert placements == ["device"] and dev.type == "cpu"  # a CPU module's "device" memory is host memory


def test_fbgemm_host_location_of_a_cuda_table_is_placement_host():
    specs = [(10, 4, EmbeddingLocation.DEVICE, ComputeDevice.CUDA), (10, 4, EmbeddingLocation.HOST, ComputeDevice.CUDA)]
    assert _devices(specs, "cuda:0")[1] == ["device", "host"]


def test_torchrec_kernels_map_onto_placements():
    pytest.importorskip("torchrec")
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel as K

    from tbegen.torchrec.kernel import _placements

    def group(*kernels):
        tables = [types.SimpleNamespace(name=f"t{i}", compute_kernel=k) for i, k in enumerate(kernels)]
        return types.SimpleNamespace(embedding_tables=tables, compute_kernel=K.FUSED)

    assert _placements(group(K.FUSED, K.FUSED_UVM, K.FUSED)) == ["device", "managed", "device"]
    assert _placements(group(K.FUSED, K.FUSED_UVM_CACHING)) == ["device", "managed_caching"]
    with pytest.raises(ValueError, match=r"plan asks for 'dense' for table 't0'"):
        _placements(group(K.DENSE))


def test_torchrec_cache_parameters_become_the_modules_cache_arguments():
    """FUSED_UVM_CACHING tables: the plan's cache_load_factor and cache_algorithm (which TorchRec
    copies into the group's fused_params) size and run tbegen's cache; TorchRec's default load
    factor 0.2 where the plan has none."""
    pytest.importorskip("torchrec")
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm

    from tbegen.torchrec.kernel import _cache_arguments

    def group(fused_params):
        return types.SimpleNamespace(fused_params=fused_params)

    assert _cache_arguments(group({"cache_load_factor": 0.5}), ["device", "managed"]) == {}
    assert _cache_arguments(group(None), ["managed_caching"]) == {"cache_load_factor": 0.2, "cache_algorithm": "lru"}
    assert _cache_arguments(group({"cache_load_factor": 0.05, "cache_algorithm": CacheAlgorithm.LFU}),
                            ["device", "managed_caching"]) == {"cache_load_factor": 0.05, "cache_algorithm": "lfu"}
    with pytest.raises(ValueError, match="LRU or LFU"):
        _cache_arguments(group({"cache_algorithm": "random"}), ["managed_caching"])
    # the arguments are the module's own: a module with them caches as asked
    from tbegen.module import TableBatchedEmbeddingBags

    emb = TableBatchedEmbeddingBags([(40, 8), (30, 4)], optimizer="sgd", placements=["device", "managed_caching"],
                                    **_cache_arguments(group({"cache_load_factor": 0.1}), ["device", "managed_caching"]))
    assert emb.cache_stats()["cache_rows"] == {1: 3}  # 10% of table 1's 30 rows


# ---- on the GPU ----------------------------------------------------------------------------------

# Tables big enough that each one spans whole pages of managed memory (a page shared by two
# tables follows the later hint, so the hint checks look at each table's interior).
BIG = [(4096, 128), (3000, 64), (2048, 256), (1000, 32)]
MIXED = ["managed", "device", "managed", "device"]


def _interior(ranges, itemsize, margin=2 << 20):
    """The part of each (start, count) range more than `margin` bytes from its ends (None if empty)."""
    m = margin // itemsize
    return [(s + m, c - 2 * m) if c > 2 * m else None for s, c in ranges]


@cuda
@pytest.mark.parametrize("optimizer,dtype,weighted", [
    ("sgd", torch.float32, False),
    ("rowwise_adagrad", torch.float32, True),
    ("adam", torch.float32, False),
    ("adam", torch.float16, True),  # stochastic rounding: the random bits are the row's, wherever it lives
])
def test_cuda_mixed_placements_train_bitwise_like_device(optimizer, dtype, weighted):
    data = batches(BIG, 5, B=64, L=8, seed=3, device="cuda", weighted=weighted)
    kw = dict(optimizer=optimizer, weights_dtype=dtype, device="cuda", learning_rate=0.05)
    device = train(TableBatchedEmbeddingBags(BIG, **kw), data)
    mixed = train(TableBatchedEmbeddingBags(BIG, placements=MIXED, **kw), data)
    managed = train(TableBatchedEmbeddingBags(BIG, placements="managed", **kw), data)
    torch.cuda.synchronize()
    assert_same_training_state(device, mixed)
    assert_same_training_state(device, managed)
    # and the forward reads them the same
    idx, offsets, psw, _ = data[0]
    with torch.no_grad():
        assert torch.equal(device(idx, offsets, psw), mixed(idx, offsets, psw))


@cuda
def test_cuda_managed_narrow_and_int_states_train_bitwise_like_device():
    """The managed allocator takes 16-bit and int64 states (and moves them back into managed
    memory after .cuda() with their dtype kept); training matches the device placement bitwise."""
    data = batches(BIG, 4, B=64, L=8, seed=5, device="cuda", weighted=True)
    kw = dict(optimizer="rowwise_adagrad_with_counter", device="cuda", learning_rate=0.05,
              state_dtypes={"momentum": torch.bfloat16, "row_counter": torch.float16})
    device = train(TableBatchedEmbeddingBags(BIG, **kw), data)
    managed = train(TableBatchedEmbeddingBags(BIG, placements=MIXED, **kw), data)
    torch.cuda.synchronize()
    for s in managed.spec.states:
        buf = managed.optimizer_state(s.name)
        assert placement.memory_kind(managed._ops, buf) == "managed", s.name
        assert buf.dtype == {"momentum": torch.bfloat16, "row_counter": torch.float16, "prev_iter": torch.int64}[s.name]
    assert_same_training_state(device, managed)
    moved = managed.cpu().cuda()
    for s in moved.spec.states:
        assert placement.memory_kind(moved._ops, moved.optimizer_state(s.name)) == "managed", s.name


# Tables large enough that each of the first three has pages of its own (more than 2 MiB, the
# largest page the driver may use, from either end; BIG's are not: 2 MiB and less).
HINTED = [(20000, 128), (24000, 64), (8192, 256), (1000, 32)]


@cuda
def test_cuda_buffers_are_managed_with_per_table_hints():
    emb = TableBatchedEmbeddingBags(HINTED, optimizer="adam", device="cuda", placements=MIXED)
    ops = emb._ops
    buffers = {"weights": (emb.weights, "element")}
    buffers.update({s.name: (emb.optimizer_state(s.name), s.per) for s in emb.spec.states})
    for name, (buf, per) in buffers.items():
        assert placement.memory_kind(ops, buf) == "managed", name
        inner = _interior(emb._buffer_ranges(per), buf.element_size())
        checked = [(r, p) for r, p in zip(inner, MIXED) if r is not None]
        assert [p for _, p in checked] == MIXED[:3], name  # the first three tables have an interior
        got = placement.preferred_locations(ops, buf, [r for r, _ in checked])
        assert got == [("host" if p == "managed" else "device") for _, p in checked], name
    # an all-device module allocates as before: ordinary device memory
    plain = TableBatchedEmbeddingBags(HINTED, optimizer="adam", device="cuda")
    assert placement.memory_kind(ops, plain.weights) == "device"
    assert placement.memory_kind(ops, plain.optimizer_state("exp_avg")) == "device"


@cuda
def test_cuda_managed_operators_check_their_arguments():
    emb = TableBatchedEmbeddingBags([(8, 4)], optimizer="sgd", device="cuda")
    ops = emb._ops
    t = ops.managed_empty(16, torch.float32, torch.device("cuda"))
    assert t.shape == (16,) and t.is_cuda and ops.memory_kind(t) == "managed"
    with pytest.raises(RuntimeError, match="location must be 'host' or 'device'"):
        ops.managed_advise(t, 0, 16, "hbm")
    with pytest.raises(RuntimeError, match=r"elements \[8, 24\) are not inside the tensor's 16"):
        ops.managed_advise(t, 8, 16, "host")
    with pytest.raises(RuntimeError, match="not in managed memory"):
        ops.managed_advise(emb.weights, 0, 4, "host")
    with pytest.raises(RuntimeError, match="must be a CUDA device"):
        ops.managed_empty(4, torch.float32, torch.device("cpu"))
    assert ops.managed_empty(0, torch.float32, torch.device("cuda")).numel() == 0


@cuda
def test_cuda_state_dict_round_trip_between_placements():
    data = batches(BIG, 4, B=32, L=4, seed=5, device="cuda")
    kw = dict(optimizer="rowwise_adagrad", device="cuda", learning_rate=0.1)
    mixed = train(TableBatchedEmbeddingBags(BIG, placements=MIXED, **kw), data[:2])
    buf = io.BytesIO()
    torch.save(mixed.state_dict(), buf)
    # into an all-device module, and into a fresh mixed one (whose buffers must stay managed)
    for target in (TableBatchedEmbeddingBags(BIG, seed=7, **kw), TableBatchedEmbeddingBags(BIG, seed=7, placements=MIXED, **kw)):
        buf.seek(0)
        target.load_state_dict(torch.load(buf))
        assert_same_training_state(mixed, target)
        if target.placements == tuple(MIXED):
            assert placement.memory_kind(target._ops, target.weights) == "managed"
            assert placement.memory_kind(target._ops, target.optimizer_state("momentum")) == "managed"
    reference = train(TableBatchedEmbeddingBags(BIG, **kw), data)
    assert_same_training_state(train(mixed, data[2:]), reference)


@cuda
def test_cuda_moving_a_managed_module_keeps_it_managed():
    emb = TableBatchedEmbeddingBags(BIG, optimizer="adam", device="cuda", placements=MIXED)
    before = emb.weights.clone()
    emb.cpu()
    assert emb.weights.device.type == "cpu"
    emb.cuda()
    assert placement.memory_kind(emb._ops, emb.weights) == "managed"
    assert placement.memory_kind(emb._ops, emb.optimizer_state("exp_avg_sq")) == "managed"
    assert torch.equal(emb.weights, before)


@cuda
def test_cuda_fbgemm_managed_location():
    specs = [(4096, 128, EmbeddingLocation.MANAGED, ComputeDevice.CUDA), (3000, 64, EmbeddingLocation.DEVICE, ComputeDevice.CUDA)]
    kw = dict(optimizer="EXACT_ROWWISE_ADAGRAD", learning_rate=0.1, device="cuda")
    managed = SplitTableBatchedEmbeddingBagsCodegen(specs, **kw)
    device = SplitTableBatchedEmbeddingBagsCodegen([(E, D, EmbeddingLocation.DEVICE, c) for E, D, _, c in specs], **kw)
    assert managed.tbe.placements == ("managed", "device")
    assert placement.memory_kind(managed.tbe._ops, managed.tbe.weights) == "managed"
    tables = [(E, D) for E, D, _, _ in specs]
    for idx, offsets, _, grad in batches(tables, 3, B=16, L=4, seed=4, device="cuda"):
        managed(idx, offsets).backward(grad)
        device(idx, offsets).backward(grad)
    assert_same_training_state(managed.tbe, device.tbe)
    sd = managed.state_dict()
    assert "weights_uvm" in sd and "weights_dev" not in sd
    assert sd["weights_placements"].tolist() == [EmbeddingLocation.MANAGED.value] * 2
    device.load_state_dict(sd)  # FBGEMM's keys: the uvm buffer read back into device memory
    assert_same_training_state(managed.tbe, device.tbe)


@cuda
def test_cuda_host_placement_is_mapped_host_memory_and_trains_bitwise_like_device():
    """Every table "host": the buffers are page-locked host memory mapped for the GPU (host_empty),
    read and written in place by the kernels; mixed with other placements, managed memory with the
    host tables hinted to the host. Both train bitwise like "device", and moving the module keeps
    the memory kind."""
    data = batches(BIG, 4, B=64, L=8, seed=6, device="cuda", weighted=True)
    kw = dict(optimizer="adam", device="cuda", learning_rate=0.05)
    device = train(TableBatchedEmbeddingBags(BIG, **kw), data)
    host = train(TableBatchedEmbeddingBags(BIG, placements="host", **kw), data)
    mixed = train(TableBatchedEmbeddingBags(BIG, placements=["host", "device", "managed", "host"], **kw), data)
    torch.cuda.synchronize()
    ops = host._ops
    for buf in [host.weights] + [host.optimizer_state(s.name) for s in host.spec.states]:
        assert placement.memory_kind(ops, buf) == "host"
    assert placement.memory_kind(ops, mixed.weights) == "managed"
    assert_same_training_state(device, host)
    assert_same_training_state(device, mixed)
    idx, offsets, psw, _ = data[0]
    with torch.no_grad():
        assert torch.equal(device(idx, offsets, psw), host(idx, offsets, psw))
    moved = host.cpu().cuda()
    assert placement.memory_kind(ops, moved.weights) == "host"
    assert placement.memory_kind(ops, moved.optimizer_state("exp_avg")) == "host"
    assert_same_training_state(device, moved)


@cuda
def test_cuda_host_empty_checks_its_arguments():
    emb = TableBatchedEmbeddingBags([(8, 4)], optimizer="sgd", device="cuda")
    ops = emb._ops
    t = ops.host_empty(16, torch.float32, torch.device("cuda"))
    assert t.shape == (16,) and t.is_cuda and ops.memory_kind(t) == "host"
    t.fill_(2.0)  # a kernel writes it in place
    assert t.sum().item() == 32.0
    with pytest.raises(RuntimeError, match="must be a CUDA device"):
        ops.host_empty(4, torch.float32, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="numel must be >= 0"):
        ops.host_empty(-1, torch.float32, torch.device("cuda"))
    assert ops.host_empty(0, torch.float32, torch.device("cuda")).numel() == 0


@cuda
def test_cuda_fbgemm_uvm_host_mapped_is_placement_host():
    specs = [(4096, 128, EmbeddingLocation.MANAGED, ComputeDevice.CUDA), (3000, 64, EmbeddingLocation.MANAGED, ComputeDevice.CUDA)]
    kw = dict(optimizer="EXACT_ROWWISE_ADAGRAD", learning_rate=0.1, device="cuda")
    mapped = SplitTableBatchedEmbeddingBagsCodegen(specs, uvm_host_mapped=True, **kw)
    managed = SplitTableBatchedEmbeddingBagsCodegen(specs, **kw)
    assert mapped.tbe.placements == ("host", "host")
    assert placement.memory_kind(mapped.tbe._ops, mapped.tbe.weights) == "host"
    tables = [(E, D) for E, D, _, _ in specs]
    for idx, offsets, _, grad in batches(tables, 3, B=16, L=4, seed=4, device="cuda"):
        mapped(idx, offsets).backward(grad)
        managed(idx, offsets).backward(grad)
    assert_same_training_state(mapped.tbe, managed.tbe)
    sd = mapped.state_dict()
    assert "weights_uvm" in sd and sd["weights_placements"].tolist() == [EmbeddingLocation.MANAGED.value] * 2
