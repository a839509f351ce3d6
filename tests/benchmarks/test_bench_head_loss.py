"""benchmarks/kernels/head_loss.py runs end to end (tiny shapes, the kernels under the interpreter): every part's rows,
the library's setting first in each group, each checked against its reference; a bad tile is one line and exit 2."""
import json

import pytest

from tests.benchmarks.conftest import run_module


def test_cpu_smoke_writes_its_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_module("benchmarks.kernels.head_loss", "--cpu-smoke", "--sweep-corrections", "16:64:4",
                      "--sweep-stats", "256:4", "--sweep-grad", "32:32:4", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["complete"] is True and not (tmp_path / "bench.json.tmp").exists()
    rows = result["results"]
    assert all(r["same_bytes"] is True for r in rows)
    corrections = [r for r in rows if r["part"] == "corrections"]
    assert [(r["labels"], r["setting"] == "torch reference", r["library"]) for r in corrections] == [
        ("uniform", True, False), ("uniform", False, True), ("uniform", False, False),
        ("zipf", True, False), ("zipf", False, True), ("zipf", False, False)]
    assert [r["setting"] for r in rows if r["part"] == "stats"][1] == {"BLOCK": 256, "warps": 4}
    assert [r["setting"] for r in rows if r["part"] == "grad"][1] == {"BM": 32, "BN": 32, "warps": 4}
    assert sum(line.startswith("best ") for line in proc.stdout.splitlines()) == 4  # two label draws, stats, grad


@pytest.mark.parametrize("flag,tile", [("--sweep-corrections", "32:100:4"), ("--sweep-stats", "4096"),
                                       ("--sweep-grad", "64:64:3")])
def test_bad_tile_is_one_line_and_exit_2(tmp_path, flag, tile):
    proc = run_module("benchmarks.kernels.head_loss", "--cpu-smoke", flag, tile, "--out", str(tmp_path / "b.json"))
    assert proc.returncode == 2 and flag in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
