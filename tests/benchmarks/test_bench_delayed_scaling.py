"""benchmarks/bench_delayed_scaling.py runs end to end (tiny shapes, kernels under the interpreter) and checks that
delayed scaling writes current scaling's bytes where the history holds the call's own amax, at every site."""
import json

from tests.benchmarks.conftest import run_script


def test_cpu_smoke_writes_its_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_script("benchmarks/bench_delayed_scaling.py", "--cpu-smoke", "--sweep", "128:8", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())["results"]
    assert [r["op"] for r in rows] == ["swiglu_bwd", "swiglu_bwd", "swiglu_fwd", "rmsnorm_fwd"]
    assert all(r["same_bytes_at_equal_amax"] is True for r in rows)
    assert [r["cast_pass"]["library"] for r in rows[:2]] == [True, False] and rows[1]["cast_pass"]["BM"] == 128
    assert all(r["bytes"]["current"] > r["bytes"]["delayed"] > 0 for r in rows)
    assert all(set(r["ms"]) == {"current", "delayed"} for r in rows)


def test_bad_sweep_is_one_line_and_exit_2(tmp_path):
    proc = run_script("benchmarks/bench_delayed_scaling.py", "--cpu-smoke", "--sweep", "100:8",
                      "--out", str(tmp_path / "bench.json"))
    assert proc.returncode == 2 and "--sweep" in proc.stderr and "Traceback" not in proc.stderr
