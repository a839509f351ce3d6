"""benchmarks/kernels/cast_transpose.py --kernel transpose runs end to end (tiny shapes, the kernel under the interpreter): each tile writes
the reference transpose's bytes, the library tile first; a bad tile is one line and exit 2."""
import json

import pytest
import torch

from tests.benchmarks.conftest import run_module


def test_cpu_smoke_writes_its_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_module("benchmarks.kernels.cast_transpose", "--kernel", "transpose", "--cpu-smoke", "--sweep", "128:32:4", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["complete"] is True and not (tmp_path / "bench.json.tmp").exists()
    rows = result["results"]
    assert [r["tile"]["library"] for r in rows] == [True, False]
    assert rows[1]["tile"] == {"BM": 128, "BN": 32, "warps": 4, "library": False}
    assert all(r["same_bytes"] is True and r["bytes"] == 2 * 96 * 160 for r in rows)
    assert sum(line.startswith("best smoke") for line in proc.stdout.splitlines()) == 1


@pytest.mark.parametrize("tile", ["64:64", "100:64:4", "64:64:3"])
def test_bad_tile_is_one_line_and_exit_2(tmp_path, tile):
    proc = run_module("benchmarks.kernels.cast_transpose", "--kernel", "transpose", "--cpu-smoke", "--sweep", tile,
                      "--out", str(tmp_path / "bench.json"))
    assert proc.returncode == 2 and "--sweep" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script runs the real benchmark")
def test_without_a_gpu_or_cpu_smoke_is_one_line_and_exit_2(tmp_path):
    proc = run_module("benchmarks.kernels.cast_transpose", "--kernel", "transpose", "--out", str(tmp_path / "bench.json"))
    assert proc.returncode == 2 and proc.stderr.strip() == "error: needs a CUDA GPU (or --cpu-smoke)"
    assert not (tmp_path / "bench.json").exists()
