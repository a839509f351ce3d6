"""benchmarks/fidelity/loss.py: the whole benchmark (data, runs, gradients, report) end to end on the CPU in a tiny
configuration, and bad input."""
import importlib
import json
import math
import os

import pytest

from tests.benchmarks.conftest import run_module

SCRIPT = "benchmarks.fidelity.loss"


@pytest.mark.slow
def test_end_to_end_tiny(tiny_data, tmp_path):
    runs_json, grads_json, report_json = (str(tmp_path / n) for n in ("runs.json", "grads.json", "report.json"))
    # two at a time: the second seed's pair waits in the queue for a free slot
    proc = run_module(SCRIPT, "run", "--preset", "tiny", "--modes", "bf16", "coat", "--seeds", "1", "2",
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
        assert [it for it, _ in r["grad_norm"]] == [it for it, _ in r["train_loss"]]
        assert all(math.isfinite(g) and g > 0 for _, g in r["grad_norm"]) and r["skipped_steps"] == 0
    # Same seed, same data order and initial weights: the first logged losses of bf16 and coat are close (FP8
    # rounding only), different seeds are not the same run.
    first = {(r["mode"], r["seed"]): r["train_loss"][0][1] for r in runs["runs"]}
    assert first[("bf16", 1)] != first[("bf16", 2)]
    assert abs(first[("coat", 1)] - first[("bf16", 1)]) < 0.05 * first[("bf16", 1)]

    checkpoint = next(r["checkpoint"] for r in runs["runs"] if r.get("checkpoint"))
    proc = run_module(SCRIPT, "grads", "--checkpoint", checkpoint, "--data", tiny_data, "--modes", "coat",
                "--batch-size", "2", "--out", grads_json)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_module(SCRIPT, "report", runs_json, grads_json, "--out", report_json)
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
    proc = run_module(SCRIPT, "report", runs_json, other, "--out", str(tmp_path / "x.json"))
    assert proc.returncode == 1 and proc.stderr.startswith("error:") and "data_id" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_data_is_one_error_line(tmp_path):
    proc = run_module(SCRIPT, "run", "--preset", "tiny", "--data", str(tmp_path / "nothing"), "--out",
                str(tmp_path / "x.json"))
    assert proc.returncode == 1 and proc.stderr.startswith("error: --data") and "Traceback" not in proc.stderr


def test_cuda_graph_plan_and_its_merge_rule():
    """--cuda-graph adds the trainer's --enable-cuda-graph (which compiles) and is part of the plan; a plan written
    before the option merges with one that ran without it, never with one that ran with it."""
    fid = importlib.import_module("benchmarks.fidelity.loss")
    manifest = {"vocab_size": 64, "data_prefix": "p", "split": "9,1,0", "tokenizer_model": "t",
                "valid": {"tokens": 10 * 8 * 32 + 1}}
    plain_flags, plain = fid.run_plan("tiny", manifest, True, False)
    graph_flags, graph = fid.run_plan("tiny", manifest, True, False, cuda_graph=True)
    assert "--enable-cuda-graph" not in plain_flags and graph_flags[-1] == "--enable-cuda-graph"
    assert graph["cuda_graph"] and graph["compile"] and not plain["cuda_graph"]
    older = {k: v for k, v in plain.items() if k != "cuda_graph"}
    assert fid.same_schedule(older, plain) and not fid.same_schedule(older, graph)


def test_cuda_graph_without_a_gpu_is_one_error_line(tiny_data, tmp_path):
    proc = run_module(SCRIPT, "run", "--preset", "tiny", "--cuda-graph", "--data", tiny_data, "--out",
                      str(tmp_path / "x.json"))
    assert proc.returncode == 1 and proc.stderr.startswith("error: --cuda-graph") and "Traceback" not in proc.stderr


def test_every_mode_is_a_valid_trainer_command():
    """A mode's flags are parsed by pretrain_gpt.py's parser before any device time is spent on them."""
    from megacoat.arguments import parse_config

    fidelity = importlib.import_module("benchmarks.fidelity.loss")
    for mode, flags in fidelity.MODES.items():
        fp8 = parse_config(list(flags)).fp8
        assert (fp8.mode == "bf16") == (mode in ("bf16", "fp8-optimizer")), mode
        # the BF16 head wherever the name says so; everywhere else the recipe's own choice
        if fp8.mode == "coat":
            assert (fp8.output_layer is False) == (mode in ("coat-current", "coat-bf16-head")), mode
    assert fidelity.MODES["coat"] == ["--coat-fp8"]  # the default recipe, nothing pinned


def _runs_doc(path, runs, data_id="d1", device="cpu"):
    plan = {"preset": "tiny", "gbs": 8, "seq": 32, "eval_tokens": 2560, "tokens_per_run": 2560}  # what plot reads
    doc = {"kind": "fidelity_runs", "environment": {"device": device}, "plan": plan,
           "data": {"data_id": data_id}, "common_flags": [],
           "runs": [{"mode": m, "seed": s, "status": "ok", "final_val_loss": v, "train_loss": [[1, v]],
                     "val_loss": [[1, v]]} for m, s, v in runs]}
    with open(path, "w") as f:
        json.dump(doc, f)
    return str(path)


def test_repeats_reports_what_report_refuses(tmp_path):
    """The same (mode, seed) on one card in two files: report stops with one error line (a seed counts once in a
    paired interval); repeats lists every run, its group's mean, spread and gap to bf16's mean at that seed."""
    a = _runs_doc(tmp_path / "a.json", [("bf16", 6, 2.0), ("coat", 6, 2.2)])
    b = _runs_doc(tmp_path / "b.json", [("bf16", 6, 2.1), ("coat", 6, 2.0), ("fp8-linear", 6, 2.05)])
    proc = run_module(SCRIPT, "report", a, b, "--out", str(tmp_path / "r.json"))
    assert proc.returncode == 1 and proc.stderr.startswith("error:")
    assert "finished on cpu in both" in proc.stderr and "Traceback" not in proc.stderr
    out = str(tmp_path / "rep.json")
    proc = run_module(SCRIPT, "repeats", a, b, "--out", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(out) as f:
        rep = json.load(f)
    groups = {(g["mode"], g["seed"]): g for g in rep["groups"]}
    assert groups[("bf16", 6)]["final_val_loss"] == [2.0, 2.1] and groups[("coat", 6)]["final_val_loss"] == [2.2, 2.0]
    assert groups[("coat", 6)]["range_pct"] == pytest.approx(100 * 0.2 / 2.1)
    assert groups[("coat", 6)]["mean_gap_to_bf16_mean_pct"] == pytest.approx(100 * (2.1 / 2.05 - 1))
    assert "range_pct" not in groups[("fp8-linear", 6)]
    assert groups[("fp8-linear", 6)]["mean_gap_to_bf16_mean_pct"] == pytest.approx(100 * (2.05 / 2.05 - 1))
    # pooled: deviations from each group's mean over (runs - groups) degrees of freedom
    devs = [(2.0 - 2.05) / 2.05, (2.1 - 2.05) / 2.05, (2.2 - 2.1) / 2.1, (2.0 - 2.1) / 2.1]
    assert rep["repeated_groups"] == 2
    assert rep["pooled_run_to_run_std_pct"] == pytest.approx(100 * math.sqrt(sum(d * d for d in devs) / 2))
    # other data: refused as report refuses it
    c = _runs_doc(tmp_path / "c.json", [("bf16", 6, 2.0)], data_id="d2")
    proc = run_module(SCRIPT, "repeats", a, c, "--out", out)
    assert proc.returncode == 1 and proc.stderr.startswith("error:") and "data_id" in proc.stderr


def test_report_pairs_a_seed_only_on_the_same_card(tmp_path):
    """A seed on another card is another run (other kernels, other rounding): report pairs (seed, device) with
    (seed, device), lists the runs without a same-card bf16 run, and takes one seed once on each card."""
    h200 = _runs_doc(tmp_path / "h200.json", [("bf16", 1, 2.00), ("bf16", 2, 2.00), ("bf16", 3, 2.00),
                                              ("coat", 1, 2.02), ("coat", 2, 2.04)], device="H200")
    h100 = _runs_doc(tmp_path / "h100.json", [("bf16", 3, 2.10), ("coat", 3, 2.00), ("coat", 4, 2.00)],
                     device="H100")
    out = str(tmp_path / "r.json")
    proc = run_module(SCRIPT, "report", h200, h100, "--out", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(out) as f:
        rep = json.load(f)
    coat = rep["modes"]["coat"]
    gap = coat["gap_to_bf16"]
    assert gap["seeds"] == [[1, "H200"], [2, "H200"], [3, "H100"]]
    assert gap["relative_gap_pct"] == pytest.approx([1.0, 2.0, 100 * (2.00 / 2.10 - 1)])
    assert coat["unpaired"] == ["seed 4 on H100: no bf16 run"]
    assert rep["modes"]["bf16"]["seeds"] == [1, 2, 3] and len(rep["modes"]["bf16"]["final_val_loss"]) == 4
    assert rep["modes"]["bf16"]["mean"] == pytest.approx((2.0 * 3 + 2.1) / 4)
    assert "3 same-card seed pairs" in proc.stdout and "seed 4 on H100" in proc.stdout
    # bf16 at seed 3 on the H200 only: coat's H100 run at seed 3 pairs with nothing, and says where bf16 ran
    h100_coat = _runs_doc(tmp_path / "h100c.json", [("coat", 3, 2.00)], device="H100")
    proc = run_module(SCRIPT, "report", h200, h100_coat, "--out", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(out) as f:
        rep = json.load(f)
    assert rep["modes"]["coat"]["gap_to_bf16"]["seeds"] == [[1, "H200"], [2, "H200"]]
    assert rep["modes"]["coat"]["unpaired"] == ["seed 3 on H100: bf16 ran it on H200"]
    # the same seed twice on one card is a repeat, still refused
    again = _runs_doc(tmp_path / "again.json", [("coat", 4, 2.01)], device="H100")
    proc = run_module(SCRIPT, "report", h100, again, "--out", out)
    assert proc.returncode == 1 and "coat seed 4 finished on H100 in both" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_mode_since_removed_from_the_table_is_still_reported(tmp_path):
    """A variant measured once and then dropped (its flags kept in its runs' JSON) stays in report and repeats,
    after the table's modes, with its paired gap."""
    fid = importlib.import_module("benchmarks.fidelity.loss")
    assert "gone-variant" not in fid.MODES
    a = _runs_doc(tmp_path / "a.json", [("gone-variant", s, 2.0 + 0.01 * s) for s in (1, 2)]
                  + [("bf16", s, 2.0) for s in (1, 2)] + [("coat", s, 2.0) for s in (1, 2)])
    out = str(tmp_path / "r.json")
    proc = run_module(SCRIPT, "report", a, "--out", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(out) as f:
        rep = json.load(f)
    assert list(rep["modes"]) == ["bf16", "coat", "gone-variant"]
    assert rep["modes"]["gone-variant"]["gap_to_bf16"]["mean_pct"] == pytest.approx(0.75)
    proc = run_module(SCRIPT, "repeats", a, "--out", out)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.slow
def test_a_run_split_over_invocations_is_the_uninterrupted_run(tiny_data, tmp_path):
    """--resume --stop-every 2: the first invocation stops each run at iteration 2 with a checkpoint (reported as
    incomplete), the second continues it to the end; curve and final loss equal an uninterrupted run's (exact
    resume, bitwise on the CPU), and a third invocation launches nothing."""
    common = ["--preset", "tiny", "--data", tiny_data, "--time-budget", "300", "--port-base", "29870"]

    def invoke(name, *extra):
        out = str(tmp_path / f"{name}.json")
        proc = run_module(SCRIPT, "run", *common, "--runs", "coat:1", "--out", out, *extra)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        with open(out) as f:
            return json.load(f)["runs"][0], proc.stdout

    whole, _ = invoke("whole", "--workdir", str(tmp_path / "w1"))
    split = ["--workdir", str(tmp_path / "w2"), "--resume", "--stop-every", "2"]
    first, _ = invoke("first", *split)
    assert whole["train_loss"][-1][0] == 4 and first["status"] == "incomplete" and first["train_loss"][-1][0] == 2
    second, _ = invoke("second", *split)
    assert second["status"] == "ok" and second["resumed_from_iteration"] == 2
    assert second["final_val_loss"] == whole["final_val_loss"]
    assert second["train_loss"] == whole["train_loss"] and second["grad_norm"] == whole["grad_norm"]
    third, stdout = invoke("third", *split)
    assert third["status"] == "ok" and "note" in third and "start coat" not in stdout
    assert third["final_val_loss"] == whole["final_val_loss"]


def test_stop_every_without_resume_is_one_error_line(tiny_data, tmp_path):
    proc = run_module(SCRIPT, "run", "--preset", "tiny", "--data", tiny_data, "--stop-every", "2",
                      "--out", str(tmp_path / "x.json"))
    assert proc.returncode == 1 and proc.stderr.startswith("error:") and "--stop-every" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_runs_spread_over_the_visible_gpus():
    fidelity = importlib.import_module("benchmarks.fidelity.loss")
    assert fidelity.visible_gpus(4, {}) == ["0", "1", "2", "3"]
    assert fidelity.visible_gpus(2, {"CUDA_VISIBLE_DEVICES": "3, 5"}) == ["3", "5"]  # the caller's own choice

    class Running:
        def __init__(self, gpu):
            self.gpu = gpu

    gpus = ["0", "1", "2", "3"]
    running, placed = [], []
    for _ in range(8):  # 4 pairs on 4 GPUs: two runs a GPU, each new run on the emptiest
        gpu = fidelity.least_loaded_gpu(gpus, running)
        running.append(Running(gpu))
        placed.append(gpu)
    assert placed == ["0", "1", "2", "3"] * 2
    running.pop(1)  # a run on GPU 1 ends: the next run goes there, not to GPU 0
    assert fidelity.least_loaded_gpu(gpus, running) == "1"
    assert fidelity.least_loaded_gpu([], running) is None  # one GPU or the CPU: runs see what the process sees
