#!/usr/bin/env python3
"""mode="reduce-overhead" over the module on CUDA, with and without each part of the fix (GPU; issue 29).

A Linear (trained: its input, the module's output, is saved for the backward) over the module
(rowwise_adagrad, two tables), compiled with mode="reduce-overhead", three steps on new batches,
beside the same model in eager. Each variant runs in a process of its own (120 s each) and prints
one line per step, then: whether the module's weights and momentum are eager's bits, its step
count, how many times tbegen's compile operators ran and how many of those inside a CUDA stream
capture (an operator captured into a CUDA graph would have its update replayed without its host
work). At a failure that names storage pointers ("not allocated in pool", "not tracked"), each
pointer is mapped to the live tensors that hold it (walking gc's objects: shape, dtype, whether
it is one of the module's buffers or the Linear's parameters) and to its block in
torch.cuda.memory_snapshot (pool id, stream, state, size).

Variants (benchmarks/NOTES-gpu.md, "reduce-overhead on CUDA: what the code says", has the
prediction for each):
- fixed: the committed tbegen/compiled.py (each operator returns one tensor; the operators named
  in torch._inductor.config.custom_should_partition_ops). Predicted: trains, eager's bits, no
  operator call inside a capture.
- no-partition-names: the same with tbegen's names taken out of custom_should_partition_ops (the
  cudagraph_unsafe tag alone, which inductor does not see through with_effects). Predicted: the
  backward operator is part of a CUDA-graph partition: its calls happen during a capture (the
  step count then lags the steps), or the first step fails in the pool check (module tensors
  allocated in the pool during warm-up).
- no-partition: torch._inductor.config.graph_partition = False (no CUDA graph for a graph with a
  CPU tensor in it: the run of 2026-12-04 trained this way). Predicted: trains, eager's bits.
- tuple-ops: the operators as they were before the fix (tbegen/compiled.py at 5a885d7, two
  results each), read with `git show`, so only where the checkout has its .git. Predicted: the
  first step fails as on 2026-12-04 ("storage data ptrs are not allocated in pool"; the pointer
  is the forward's output).

    PYTHONPATH=$PWD python3 benchmarks/tools/compile_probe.py              # every variant
    PYTHONPATH=$PWD python3 benchmarks/tools/compile_probe.py fixed no-partition-names   # some
    PROBE_LOGS=1 PYTHONPATH=$PWD python3 benchmarks/tools/compile_probe.py  # + TORCH_LOGS=+cudagraphs

(PROBE_DEVICE=cpu runs the same on the CPU, where there are no CUDA graphs: a check of the probe.)
"""

import gc
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

VARIANTS = ("fixed", "no-partition-names", "no-partition", "tuple-ops")
DEVICE = os.environ.get("PROBE_DEVICE", "cuda")  # (PROBE_DEVICE=cpu: a dry run of the probe itself)
OLD_COMMIT = "5a885d7"  # (the last commit with the two-result operators)


def _load_old_operators() -> bool:
    """Makes tbegen.compiled the pre-fix file (before tbegen.module imports it)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        text = subprocess.run(["git", "-C", root, "show", f"{OLD_COMMIT}:tbegen/compiled.py"], check=True,
                              capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"tuple-ops: skipped (no git history here: {e})", flush=True)
        return False
    path = os.path.join(tempfile.mkdtemp(), "compiled_old.py")
    with open(path, "w") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location("tbegen.compiled", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["tbegen.compiled"] = module
    spec.loader.exec_module(module)
    return True


def _explain_pointers(message: str, named) -> None:
    import torch

    ptrs = {int(p) for p in re.findall(r"\b(\d{9,})\b", message)}
    if not ptrs:
        return
    holders = {p: [] for p in ptrs}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == DEVICE:
                p = obj.untyped_storage().data_ptr()
                if p in holders:
                    name = next((n for n, t in named.items() if t is obj), None)
                    holders[p].append(f"{tuple(obj.shape)} {obj.dtype}" + (f" = {name}" if name else ""))
        except Exception:  # (some tensor subclasses refuse storage access)
            continue
    blocks = {}
    for seg in (torch.cuda.memory_snapshot() if DEVICE == "cuda" else []):
        addr = seg["address"]
        for block in seg["blocks"]:
            for p in ptrs:
                if addr <= p < addr + block["size"]:
                    blocks[p] = (f"segment pool {seg.get('segment_pool_id')}, stream {seg.get('stream')}, "
                                 f"block {block['state']} of {block['size']} bytes at +{p - addr}")
            addr += block["size"]
    for p in sorted(ptrs):
        print(f"  pointer {p}: held by {holders[p] or 'no live tensor'}; "
              f"{blocks.get(p, 'in no segment of the caching allocator')}", flush=True)


def run(variant: str) -> None:
    if variant == "tuple-ops" and not _load_old_operators():
        return
    import torch
    import torch._inductor.config as inductor_config

    import tbegen
    import tbegen.compiled as compiled_

    if variant == "no-partition":
        inductor_config.graph_partition = False
    if variant == "no-partition-names":
        names = getattr(compiled_, "PARTITION_OPS", ())
        inductor_config.custom_should_partition_ops = [
            n for n in inductor_config.custom_should_partition_ops if n not in names]
    print(f"torch {torch.__version__}; graph_partition={inductor_config.graph_partition}; "
          f"custom_should_partition_ops={inductor_config.custom_should_partition_ops}", flush=True)

    if DEVICE == "cuda":  # (explain a pool check's pointers while their tensors are still alive)
        import torch._inductor.cudagraph_trees as cgt

        pool_check = cgt.check_memory_pool

        def explained_pool_check(*args, **kwargs):
            try:
                return pool_check(*args, **kwargs)
            except Exception as e:
                print(f"pool check failed: {str(e)[:300]}", flush=True)
                _explain_pointers(str(e), named)
                raise

        cgt.check_memory_pool = explained_pool_check
    named = {}
    calls = {"all": 0, "capturing": 0}
    module_of = compiled_._module

    def spy(handle):
        calls["all"] += 1
        calls["capturing"] += int(DEVICE == "cuda" and torch.cuda.is_current_stream_capturing())
        return module_of(handle)

    compiled_._module = spy

    def make():
        torch.manual_seed(0)
        emb = tbegen.TableBatchedEmbeddingBags([(50, 8), (40, 8)], optimizer="rowwise_adagrad", device=DEVICE,
                                               learning_rate=0.1)
        lin = torch.nn.Linear(16, 1, device=DEVICE)
        return emb, lin

    emb_e, lin_e = make()
    emb, lin = make()

    def step(indices, offsets):
        return lin(emb(indices, offsets)).sum()

    compiled = torch.compile(step, mode="reduce-overhead")
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randint(0, 40, (12,), generator=g).to(DEVICE), torch.tensor([0, 3, 6, 9, 12]).to(DEVICE))
               for _ in range(3)]
    named.update({**{f"emb.{k}": v for k, v in emb.state_dict().items()},
             **{f"lin.{k}": v for k, v in lin.named_parameters()}})
    done = 0
    for i, (indices, offsets) in enumerate(batches):
        try:
            torch.compiler.cudagraph_mark_step_begin()
            loss = compiled(indices, offsets)
            loss.backward()
            print(f"step {i}: ok, loss {loss.item():.6f}", flush=True)
            done += 1
        except Exception as e:  # (the point is what follows the error)
            msg = str(e)
            print(f"step {i}: {type(e).__name__}: {msg[:400]}", flush=True)
            _explain_pointers(msg, named)
            break
    for indices, offsets in batches[:done]:
        lin_e(emb_e(indices, offsets)).sum().backward()
    try:
        emb.check_errors()
    except RuntimeError as e:
        print(f"check_errors: {e}", flush=True)
    same = all(torch.equal(a, b) for a, b in zip(emb_e.state_dict().values(), emb.state_dict().values())
               if isinstance(a, torch.Tensor))
    print(f"{done} steps; module state == eager's after as many steps: {same}; step count {emb._step} "
          f"(eager {emb_e._step}); module look-ups by handle {calls['all']} (operator bodies; autograd setup while tracing), {calls['capturing']} during a CUDA stream capture",
          flush=True)


if __name__ == "__main__":
    chosen = sys.argv[1:] or list(VARIANTS)
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        sys.exit(f"compile_probe: unknown variant(s) {unknown}; the variants: {', '.join(VARIANTS)}")
    if len(sys.argv) == 2 and os.environ.get("PROBE_CHILD"):
        run(sys.argv[1])
    else:
        env = dict(os.environ, PROBE_CHILD="1")
        if os.environ.get("PROBE_LOGS"):
            env["TORCH_LOGS"] = "+cudagraphs"
        for v in chosen:
            print(f"== variant {v}", flush=True)
            try:
                subprocess.run([sys.executable, __file__, v], timeout=120, check=False, env=env)
            except subprocess.TimeoutExpired:
                print(f"variant {v}: timed out after 120 s", flush=True)
