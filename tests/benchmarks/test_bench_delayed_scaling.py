"""benchmarks/kernels/delayed_scaling.py runs end to end (tiny shapes, kernels under the interpreter) and checks that
delayed scaling writes current scaling's bytes where the history holds the call's own amax, at every site."""
import json

import pytest

from tests.benchmarks.conftest import run_module


def test_cpu_smoke_writes_its_json(tmp_path):
    """Each op's library setting first, then the swept ones, each checked byte for byte against current scaling
    (a tile that changed the bytes would fail the run)."""
    out = tmp_path / "bench.json"
    proc = run_module("benchmarks.kernels.delayed_scaling", "--cpu-smoke", "--sweep", "128:8", "--sweep-fwd", "64:8",
                      "--sweep-norm", "128", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["complete"] is True
    rows = result["results"]
    assert [r["op"] for r in rows] == ["swiglu_bwd"] * 2 + ["swiglu_fwd"] * 2 + ["rmsnorm_fwd"] * 2 + ["rope_qkv_bwd"]
    assert all(r["same_bytes"] is True for r in rows)
    assert [r["kernel_setting"]["library"] for r in rows] == [True, False] * 3 + [True]
    assert rows[1]["kernel_setting"] == {"BM": 128, "warps": 8, "library": False}
    assert rows[3]["kernel_setting"] == {"BM": 64, "warps": 8, "library": False}
    assert rows[5]["kernel_setting"] == {"per_warp": 128, "library": False}
    assert all(r["bytes"]["current"] > r["bytes"]["delayed"] > 0 for r in rows)
    assert all(set(r["ms"]) == {"current", "delayed"} for r in rows)
    assert sum(line.startswith("best ") for line in proc.stdout.splitlines()) == 3  # one per swept op and shape


@pytest.mark.parametrize("flag, value", [("--sweep", "100:8"), ("--sweep-fwd", "64"), ("--sweep-norm", "100")])
def test_bad_sweep_is_one_line_and_exit_2(tmp_path, flag, value):
    proc = run_module("benchmarks.kernels.delayed_scaling", "--cpu-smoke", flag, value,
                      "--out", str(tmp_path / "bench.json"))
    assert proc.returncode == 2 and flag in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
