#!/usr/bin/env bash
# tbegen installed as users install it: build a wheel, install it into a fresh virtual environment
# (no access to this checkout or its editable install), and from a folder outside the checkout
# list the optimizers, render one, build it and train a step with it.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
# INSTALLED_VENV: where the fresh environment goes (kept afterwards: .ci/run reuses it for FBGEMM's
# test suite, which wants the same torch 2.13.0); default a temporary folder, removed at the end
work="$(mktemp -d /tmp/tbegen-installed.XXXXXX)"
trap 'rm -rf "$work"' EXIT
venv="${INSTALLED_VENV:-$work/venv}"
python3 -m pip wheel -q --no-deps -w "$work/dist" "$root"
rm -rf "$venv"
python3 -m venv "$venv"
# torch 2.13.0 (CPU build): on these machines a local file, installed in seconds
"$venv/bin/pip" install -q "torch==2.13.0" "$work"/dist/tbegen-*.whl
cd "$work"
export TBEGEN_BUILD_DIR="${TBEGEN_BUILD_DIR:-$work/cache}"
# (into a file first: with pipefail, `tbegen list | grep -q` fails whenever grep exits before
# tbegen has written its last line, which then dies of SIGPIPE)
"$venv/bin/tbegen" list > specs.txt
grep -q '^sgd ' specs.txt || { echo "installed tbegen lists no sgd:"; cat specs.txt; exit 1; }
"$venv/bin/tbegen" render --optimizer sgd >/dev/null
test -f generated/sgd/kernels_cuda.cu || { echo "installed tbegen rendered nothing"; exit 1; }
"$venv/bin/python" - <<'PY'
import torch
import tbegen
from tbegen.module import TableBatchedEmbeddingBags

assert "site-packages" in tbegen.__file__, tbegen.__file__
m = TableBatchedEmbeddingBags([(100, 8), (50, 16)], optimizer="sgd", learning_rate=0.5)
before = [w.clone() for w in m.split_embedding_weights()]
indices = torch.tensor([1, 2, 3, 4, 5])
offsets = torch.tensor([0, 2, 3, 4, 5])
out = m(indices, offsets)
out.backward(torch.ones_like(out))
# sgd with an all-ones output gradient: each looked-up row moves by -lr per occurrence
moved = before[0] - m.split_embedding_weights()[0]
assert torch.allclose(moved[[1, 2, 3]], torch.full((3, 8), 0.5), atol=1e-6), moved[[1, 2, 3]]
assert torch.equal(moved[0], torch.zeros(8))
print("installed tbegen", tbegen.__file__, "trained sgd: ok")
PY
