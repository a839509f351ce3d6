"""benchmarks/kernels/variants.py runs end to end (a tiny shape, the kernels under the interpreter): every
variant, rewritten from the library's source, writes the library's bytes; without a GPU or --cpu-smoke it is one
line and exit 2."""
import importlib
import json

import pytest
import torch

from tests.benchmarks.conftest import run_module


def test_cpu_smoke_variants_write_the_library_bytes(tmp_path):
    out = tmp_path / "bench.json"
    # 320 rows are 5 row blocks of 64: grouped4's last super-row is short, where a wrong index would skip a tile; the
    # norm's output at 128 rows a tile has a partial last tile
    proc = run_module("benchmarks.kernels.variants", "--cpu-smoke", "--ops", "cast_both", "norm_out_t",
                      "--variants", "both", "columns_first", "grouped4", "--norm-out-tiles", "128:4",
                      "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["complete"] is True and not (tmp_path / "bench.json.tmp").exists()
    rows = result["results"]
    variants = ("library", "both", "columns_first", "grouped4", "norm_out 128x4")
    assert [(r["op"], r["variant"]) for r in rows] == [(op, v) for op in ("cast_both", "norm_out_t") for v in variants]
    assert all(r["same_bytes"] is True for r in rows)
    assert result["variants"]["grouped4"] == {"order": 4} and result["variants"]["library"] is None
    assert result["variants"]["norm_out 128x4"] == {"norm_out_tile": [128, 4]}


@pytest.mark.parametrize("tile", ["128", "100:4", "128:3"])
def test_bad_norm_out_tile_is_one_line_and_exit_2(tmp_path, tile):
    proc = run_module("benchmarks.kernels.variants", "--cpu-smoke", "--norm-out-tiles", tile,
                      "--out", str(tmp_path / "bench.json"))
    assert proc.returncode == 2 and "--norm-out-tiles" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "bench.json").exists()


def test_rewrites_reach_the_source(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)  # the script imports its siblings (sweep_common, bench_delayed_scaling)
    bench = importlib.import_module("benchmarks.kernels.variants")
    from megacoat.ops import rmsnorm
    kernels = bench._variant(rmsnorm, {"hint": {**bench.EVICT, **bench.STREAM}, "order": 8}, str(tmp_path), "t")
    src = next(tmp_path.glob("*.py")).read_text()
    assert src.count("eviction_policy='evict_first'") == src.count("tl.load(") > 0  # ast.unparse's quotes
    assert src.count("cache_modifier='.cs'") == src.count("tl.store(") > 0
    assert isinstance(kernels["_out_kernel"], bench._Reordered)  # a tiled kernel: launched on the grouped grid
    assert not isinstance(kernels["_fwd_kernel"], bench._Reordered)  # one program per row: its order is kept


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script runs the real benchmark")
def test_without_a_gpu_or_cpu_smoke_is_one_line_and_exit_2(tmp_path):
    proc = run_module("benchmarks.kernels.variants", "--out", str(tmp_path / "bench.json"))
    assert proc.returncode == 2 and proc.stderr.strip() == "error: needs a CUDA GPU (or --cpu-smoke)"
    assert not (tmp_path / "bench.json").exists()
