"""benchmarks/bench_cache.py on the CPU (its --device cpu check of the script, a small shape): the
control rows (--control) time the default again after a cell's variants, and are labelled so."""
import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_control_rows_follow_the_variants(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_cache

    argv = ["--device", "cpu", "--tables", "2", "--rows", "500", "--batch", "16", "--cache", "0.2,0.5",
            "--warmup", "1", "--iters", "2", "--variant", "TBEGEN_CACHE_PREFETCH_WARM=1", "--control",
            "--out", str(tmp_path)]
    assert bench_cache.main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    cached = [(r["placement"], r.get("variant"), r.get("control")) for r in results if r["placement"] != "device"]
    assert cached == [(p, v, c) for p in ("managed_caching 0.2", "managed_caching 0.5")
                      for v, c in ((None, False), ("TBEGEN_CACHE_PREFETCH_WARM=1", False), (None, True))], cached
    md = (tmp_path / "results.md").read_text()
    assert md.count("(control: the default again)") == 2


def test_without_control_no_control_rows(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_cache

    argv = ["--device", "cpu", "--tables", "2", "--rows", "500", "--batch", "16", "--cache", "0.2",
            "--warmup", "1", "--iters", "2", "--out", str(tmp_path)]
    assert bench_cache.main(argv) == 0
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert not any(r.get("control") for r in results)
    assert "control" not in (tmp_path / "results.md").read_text()
