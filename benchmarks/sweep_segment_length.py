"""Backward time through the module against max_segment_length_per_warp (GPU).

Rows looked up at least that many times in a batch go to the segment kernels (cut into segments of
256 occurrences, a warp each, then a fixed-order second pass); shorter ones to the warp kernel. The
default is 32 (FBGEMM's). This sweeps it on the referee's configurations and batches
(.anchor/bench_tbe.py: make_configs, gen_sets, tbegen_module, time_loop), one module per
(config, optimizer), so that the default can be chosen from measurements:

    PYTHONPATH=.anchor:$PWD python3 benchmarks/sweep_segment_length.py --cells C2:sgd,C2:adagrad

Prints one line per setting: the backward's median ms (p10-p90) and its speed against the default
(32, when it comes first in --lengths' order or earlier).
"""

import argparse
import sys

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="C2:sgd,C2:adagrad,C1:adagrad,C3:adam",
                    help="config:optimizer pairs (optimizers: sgd, rowwise_adagrad, adagrad, adam)")
    ap.add_argument("--lengths", default="32,8,16,64,128,512")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    import bench_tbe as ref  # the referee (.anchor on PYTHONPATH)

    ref.TBG["fast_init"] = True
    names = {"sgd": "EXACT_SGD", "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD", "adagrad": "EXACT_ADAGRAD",
             "adam": "ADAM"}
    configs = ref.make_configs(1_000_000)
    lengths = [int(x) for x in args.lengths.split(",")]
    print(f"# max_segment_length_per_warp sweep, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    for cell in args.cells.split(","):
        cfg_name, opt = cell.split(":")
        cfg = configs[cfg_name]
        sets = ref.gen_sets(cfg, 4, seed=0)
        grad = torch.randn(cfg["B"], sum(cfg["Ds"]), device="cuda")
        emb = ref.tbegen_module(cfg["Ds"], cfg["E"], names[opt], cfg["wprec"])
        times = {}
        for n in lengths:
            emb.max_segment_length_per_warp = n

            def fwd(i):
                s = sets[i]
                return emb(s["indices"], s["offsets"], per_sample_weights=s["psw"])

            r = ref.time_loop(fwd, lambda out: out.backward(grad), len(sets), args.warmup, args.iters)
            times[n] = r["bwd_ms"]
            print(f"{cfg_name} {opt:16} max_segment_length_per_warp={n:5d}  bwd {r['bwd_ms']:.3f} ms "
                  f"(p10-p90 {r['bwd_p10']:.3f}-{r['bwd_p90']:.3f})"
                  + (f"  {times[32] / r['bwd_ms']:.3f}x the default's speed" if 32 in times else ""), flush=True)
        del emb, sets
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
