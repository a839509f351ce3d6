"""benchmarks/bench_swiglu_grad_scaling.py runs end to end (a tiny shape, kernels under the interpreter) and checks
that delayed scaling writes current scaling's bytes where the history holds the call's own amax."""
import json

from tests.benchmarks.conftest import run_script


def test_cpu_smoke_writes_its_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_script("benchmarks/bench_swiglu_grad_scaling.py", "--cpu-smoke", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["results"]
    assert [r["shape"] for r in rows] == ["smoke"] and rows[0]["same_bytes_at_equal_amax"] is True
    assert rows[0]["bytes"]["current"] > rows[0]["bytes"]["delayed"] > 0
