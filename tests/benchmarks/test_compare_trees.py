"""benchmarks/e2e/compare_trees.py on CPU: the tiny model trained by this checkout and by a second one (here the same
tree), every mode measured, the JSON written; a --before that is no checkout is one error line."""
import json

from tests.benchmarks.conftest import ROOT, run_module


def test_both_trees_train_and_the_summary_has_every_mode(tmp_path):
    out = tmp_path / "compare.json"
    proc = run_module("benchmarks.e2e.compare_trees", "--before", ROOT, "--model", "tiny", "--micro-batch-size", "2",
                      "--warmup", "2", "--iters", "2", "--log-interval", "2", "--repeats", "1",
                      "--cache", str(tmp_path / "cache"), "--out", str(out), timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads(out.read_text())["summary"]
    assert set(summary) == {"bf16", "coat", "coat_before"}
    assert summary["bf16"]["ratio_vs_bf16"] == 1.0 and all(s["median_tokens_per_s"] > 0 for s in summary.values())


def test_before_must_be_a_checkout(tmp_path):
    proc = run_module("benchmarks.e2e.compare_trees", "--before", str(tmp_path), "--model", "tiny")
    assert proc.returncode == 2 and "--before" in proc.stderr and "Traceback" not in proc.stderr
