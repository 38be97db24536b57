"""The CPU backward sums a run's gradient from +0, whatever the run's length.

Runs of one and two occurrences (most runs of a uniform batch) are summed inline
(cpu_simd.h, `sum_of_one` / `sum_of_two`), longer ones by `sum_rows`; all start from 0, so that a
gradient of -0.0 sums to +0.0 (0 + -0 is +0) and the step's bits do not depend on which path a run
took. A plain copy of a single occurrence would keep -0.0, and a -0.0 weight would then step to
+0.0 (-0 - -0) instead of staying -0.0 (-0 - +0). Rows of 64 (16-float vectors), 24 (16 + 4 + 4)
and 8 (4-float vectors) columns."""

import torch

import tbegen

NEG_ZERO = -(2**31)  # the bits of -0.0 as int32


def test_runs_of_one_two_and_three_sum_from_positive_zero():
    torch.set_num_threads(1)
    try:
        tables = [(6, 64), (6, 24), (6, 8)]
        emb = tbegen.TableBatchedEmbeddingBags(tables=tables, optimizer="rowwise_adagrad", device="cpu",
                                               learning_rate=0.1, eps=1e-8)
        with torch.no_grad():
            for w in emb.split_embedding_weights():
                w.fill_(-0.0)
        # per feature, bags [1, 2, 3], [2, 3], [3, 4]: row 1 and row 4 once, row 2 twice, row 3 three times
        per_feature = [1, 2, 3, 2, 3, 3, 4]
        indices = torch.tensor(per_feature * len(tables), dtype=torch.int64)
        lengths = [3, 2, 2] * len(tables)
        offsets = torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
        out = emb(indices, offsets)
        out.backward(torch.full_like(out, -0.0))
        for t, w in enumerate(emb.split_embedding_weights()):
            bits = w.detach().view(torch.int32)
            for r in range(tables[t][0]):
                assert bool((bits[r] == NEG_ZERO).all()), (
                    f"table {t} row {r}: weights {w[r].tolist()[:4]}... should stay -0.0 (gradient +0)")
    finally:
        torch.set_num_threads(2)
