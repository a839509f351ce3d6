"""benchmarks/fidelity.py: the whole benchmark (data, runs, gradients, report) end to end on the CPU in a tiny
configuration, and bad input."""
import json
import math
import os

import pytest

from tests.benchmarks.conftest import BENCHMARKS, load_benchmark, run_script

SCRIPT = os.path.join(BENCHMARKS, "fidelity.py")


@pytest.mark.slow
def test_end_to_end_tiny(tiny_data, tmp_path):
    runs_json, grads_json, report_json = (str(tmp_path / n) for n in ("runs.json", "grads.json", "report.json"))
    # two at a time: the second seed's pair waits in the queue for a free slot
    proc = run_script(SCRIPT, "run", "--preset", "tiny", "--modes", "bf16", "coat", "--seeds", "1", "2",
                "--parallel", "2", "--data", tiny_data, "--time-budget", "500", "--workdir", str(tmp_path / "runs"),
                "--save-checkpoint", "bf16:1", "--port-base", "29850", "--out", runs_json)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(runs_json) as f:
        runs = json.load(f)
    assert runs["kind"] == "fidelity_runs" and runs["environment"]["device"] == "cpu"
    assert runs["plan"]["eval_tokens"] <= runs["plan"]["held_out_tokens"] < runs["plan"]["eval_tokens"] + 9 * 8 * 32
    assert {(r["mode"], r["seed"]) for r in runs["runs"]} == {("bf16", 1), ("coat", 1), ("bf16", 2), ("coat", 2)}
    for r in runs["runs"]:
        assert r["status"] == "ok", r
        assert math.isfinite(r["final_val_loss"]) and r["val_loss"][-1] == [runs["plan"]["train_iters"],
                                                                            r["final_val_loss"]]
        assert len(r["train_loss"]) == runs["plan"]["train_iters"]
    # Same seed, same data order and initial weights: the first logged losses of bf16 and coat are close (FP8
    # rounding only), different seeds are not the same run.
    first = {(r["mode"], r["seed"]): r["train_loss"][0][1] for r in runs["runs"]}
    assert first[("bf16", 1)] != first[("bf16", 2)]
    assert abs(first[("coat", 1)] - first[("bf16", 1)]) < 0.05 * first[("bf16", 1)]

    checkpoint = next(r["checkpoint"] for r in runs["runs"] if r.get("checkpoint"))
    proc = run_script(SCRIPT, "grads", "--checkpoint", checkpoint, "--data", tiny_data, "--modes", "coat",
                "--batch-size", "2", "--out", grads_json)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_script(SCRIPT, "report", runs_json, grads_json, "--out", report_json)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(report_json) as f:
        rep = json.load(f)
    assert os.path.isfile(str(tmp_path / "report.png"))
    finals = {(r["mode"], r["seed"]): r["final_val_loss"] for r in runs["runs"]}
    for mode in ("bf16", "coat"):
        assert rep["modes"][mode]["seeds"] == [1, 2]
        assert rep["modes"][mode]["mean"] == pytest.approx((finals[(mode, 1)] + finals[(mode, 2)]) / 2)
    d = [100 * (finals[("coat", s)] - finals[("bf16", s)]) / finals[("bf16", s)] for s in (1, 2)]
    mean, half = sum(d) / 2, 12.706204736174707 * abs(d[0] - d[1]) / math.sqrt(2) / math.sqrt(2)
    assert rep["modes"]["coat"]["gap_to_bf16"]["ci95_pct"] == pytest.approx([mean - half, mean + half])
    agreement = rep["gradient_agreement"][0]
    coat = agreement["modes"]["coat"]
    assert 0.9 < coat["block_min_cosine"] <= 1.0 + 1e-6 and coat["per_tensor"]
    moments = agreement["moments"]
    for variant in ("e4m3", "e5m2", "e4m3_expand", "e5m2_expand"):
        assert 0 < moments[variant]["m_rel_mse"] < 1 and 0 < moments[variant]["v_rel_mse"] < 1
    for fmt in ("e4m3", "e5m2"):
        for x in ("m", "v"):
            assert moments["expansion_lowers_error"][fmt][x] == (
                moments[f"{fmt}_expand"][f"{x}_rel_mse"] < moments[fmt][f"{x}_rel_mse"])

    # Runs of other data cannot be merged: one error line, no traceback.
    runs["data"]["data_id"] = "another"
    other = str(tmp_path / "other.json")
    with open(other, "w") as f:
        json.dump(runs, f)
    proc = run_script(SCRIPT, "report", runs_json, other, "--out", str(tmp_path / "x.json"))
    assert proc.returncode == 1 and proc.stderr.startswith("error:") and "data_id" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_data_is_one_error_line(tmp_path):
    proc = run_script(SCRIPT, "run", "--preset", "tiny", "--data", str(tmp_path / "nothing"), "--out",
                str(tmp_path / "x.json"))
    assert proc.returncode == 1 and proc.stderr.startswith("error: --data") and "Traceback" not in proc.stderr


def test_cuda_graph_plan_and_its_merge_rule():
    """--cuda-graph adds the trainer's --enable-cuda-graph (which compiles) and is part of the plan; a plan written
    before the option merges with one that ran without it, never with one that ran with it."""
    fid = load_benchmark("fidelity")
    manifest = {"vocab_size": 64, "data_prefix": "p", "split": "9,1,0", "tokenizer_model": "t",
                "valid": {"tokens": 10 * 8 * 32 + 1}}
    plain_flags, plain = fid.run_plan("tiny", manifest, True, False)
    graph_flags, graph = fid.run_plan("tiny", manifest, True, False, cuda_graph=True)
    assert "--enable-cuda-graph" not in plain_flags and graph_flags[-1] == "--enable-cuda-graph"
    assert graph["cuda_graph"] and graph["compile"] and not plain["cuda_graph"]
    older = {k: v for k, v in plain.items() if k != "cuda_graph"}
    assert fid.same_schedule(older, plain) and not fid.same_schedule(older, graph)


def test_cuda_graph_without_a_gpu_is_one_error_line(tiny_data, tmp_path):
    proc = run_script(SCRIPT, "run", "--preset", "tiny", "--cuda-graph", "--data", tiny_data, "--out",
                      str(tmp_path / "x.json"))
    assert proc.returncode == 1 and proc.stderr.startswith("error: --cuda-graph") and "Traceback" not in proc.stderr


def test_every_mode_is_a_valid_trainer_command():
    """A mode's flags are parsed by pretrain_gpt.py's parser before any device time is spent on them."""
    from megacoat.arguments import parse_config

    fidelity = load_benchmark("fidelity")
    for mode, flags in fidelity.MODES.items():
        assert parse_config(list(flags)).fp8 is not None, mode
