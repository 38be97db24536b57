#!/usr/bin/env python3
"""What mode="reduce-overhead" hands inductor's CUDA-graph trees (GPU; issue 29).

On the H200 (torch 2.11) a compiled training step with the module fails in cudagraph_trees'
`_allocate_and_copy_recording_inputs` (`assert isinstance(inp, (int, torch.Generator))`): some
input of a recorded graph is neither a tensor, an int nor a generator. This prints the type and
value of every such input before the assertion (one line per recorded graph), then lets the step
run (or fail) as it would, once per variant, each in a process of its own:

- default: inductor's defaults (torch 2.11: graph partitions around cudagraph-unsafe operators,
  which tbegen's two compile operators are, tbegen/compiled.py);
- no-partition: torch._inductor.config.graph_partition = False (a graph holding a cudagraph-unsafe
  operator is then run without CUDA graphs as a whole).

The suspicion to confirm: the effect token threaded through tbegen's ordered-effect operators
crosses a partition boundary and arrives as None.

    PYTHONPATH=$PWD python3 benchmarks/tools/compile_probe.py            # every variant
    PYTHONPATH=$PWD python3 benchmarks/tools/compile_probe.py default    # one
"""

import subprocess
import sys

VARIANTS = ("default", "no-partition")


def run(variant: str) -> None:
    import torch
    import torch._inductor.cudagraph_trees as cgt

    import tbegen

    if variant == "no-partition":
        torch._inductor.config.graph_partition = False
    original = cgt.CUDAGraphNode._allocate_and_copy_recording_inputs

    def probe(self, inputs):
        odd = [(i, type(x).__name__, repr(x)[:40]) for i, x in enumerate(inputs)
               if not isinstance(x, (torch.Tensor, int, torch.Generator))]
        print(f"recording a graph of {len(inputs)} inputs; not tensor/int/generator: {odd}", flush=True)
        return original(self, inputs)

    cgt.CUDAGraphNode._allocate_and_copy_recording_inputs = probe
    emb = tbegen.TableBatchedEmbeddingBags([(50, 8), (40, 8)], optimizer="rowwise_adagrad", device="cuda",
                                           learning_rate=0.1)
    lin = torch.nn.Linear(16, 1, device="cuda")

    def step(indices, offsets):
        return lin(emb(indices, offsets)).sum()

    compiled = torch.compile(step, mode="reduce-overhead")
    indices = torch.randint(0, 40, (12,), device="cuda")
    offsets = torch.tensor([0, 3, 6, 9, 12], device="cuda")
    for i in range(3):
        try:
            torch.compiler.cudagraph_mark_step_begin()
            loss = compiled(indices, offsets)
            loss.backward()
            print(f"step {i}: ok, loss {loss.item():.6f}", flush=True)
        except Exception as e:  # (the point is the line above the error)
            print(f"step {i}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            break


if __name__ == "__main__":
    if len(sys.argv) > 1:
        run(sys.argv[1])
    else:
        for v in VARIANTS:
            print(f"== variant {v}", flush=True)
            subprocess.run([sys.executable, __file__, v], timeout=120, check=False)
