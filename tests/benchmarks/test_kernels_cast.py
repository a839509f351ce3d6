"""benchmarks/kernels/cast_transpose.py runs end to end (tiny shapes, the kernel under the interpreter): each tile and
layout writes the library tile's bytes (on the GPU: the torch reference's), the library tile first."""
import json

import pytest

from tests.benchmarks.conftest import run_module


def test_cpu_smoke_writes_its_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_module("benchmarks.kernels.cast_transpose", "--cpu-smoke", "--sweep", "128:32:4", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["complete"] is True and not (tmp_path / "bench.json.tmp").exists()
    rows = result["results"]
    assert [(r["tile"]["library"], r["layout"]) for r in rows] == [
        (library, layout) for library in (True, False) for layout in ("both", "rowwise", "transpose")]
    assert rows[3]["tile"] == {"BM": 128, "BN": 32, "warps": 4, "library": False}
    assert all(r["same_bytes"] is True for r in rows)
    assert [r["bytes"] for r in rows[:3]] == [4 * 96 * 160, 3 * 96 * 160, 3 * 96 * 160]
    assert sum(line.startswith("best smoke") for line in proc.stdout.splitlines()) == 3  # one per layout


@pytest.mark.parametrize("tile", ["64:64", "100:64:4", "64:64:3"])
def test_bad_tile_is_one_line_and_exit_2(tmp_path, tile):
    proc = run_module("benchmarks.kernels.cast_transpose", "--cpu-smoke", "--sweep", tile,
                      "--out", str(tmp_path / "bench.json"))
    assert proc.returncode == 2 and "--sweep" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
