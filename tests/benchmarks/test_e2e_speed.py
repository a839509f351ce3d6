"""benchmarks/e2e/speed.py's method (recipes and their commands, the timed window, a point's median and spread)
and its two peers: the plain Llama loop (refuses what it does not do) and torchao's conversion (which linears become
float8). The GPU figures themselves come from `python -m benchmarks.run`."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from benchmarks.e2e.speed import cpu_check_flags, mode_command, summarize, timed_window
from benchmarks.suite import MODELS, RECIPES


def _records(rates, every=5, mfu_per_rate=None):
    return [{"iteration": every * (i + 1), "tokens_per_s": r, "mfu": None if mfu_per_rate is None else r * mfu_per_rate}
            for i, r in enumerate(rates)]


def test_recipes_are_each_modes_best_configuration():
    assert mode_command("bf16") == ("pretrain_gpt.py", ["--compile"])
    # the default: the trainer's own FP8 settings, compiled and replayed as CUDA graphs
    assert mode_command("coat") == ("pretrain_gpt.py", ["--coat-fp8", "--compile", "--enable-cuda-graph"])
    assert mode_command("coat", cuda_graphs=False)[1] == ["--coat-fp8", "--compile"]
    assert "--fp8-grad-scaling" in mode_command("coat-current")[1]
    assert mode_command("torchao-float8") == ("benchmarks.e2e.torchao_pretrain", ["--compile"])
    assert cpu_check_flags(mode_command("coat")[1]) == ["--coat-fp8"]


def test_timed_window_is_tokens_over_time_of_its_intervals_only():
    # warm-up interval (iterations 1-5) at 10 tok/s is left out; the window (5, 15] has two intervals of equal
    # length at 100 and 300 tok/s: 10 iterations of T tokens take T/20 + T/60 s, i.e. 150 tok/s (not 200).
    w = timed_window(_records([10, 100, 300, 1]), first=5, last=15)
    assert w["tokens_per_s"] == pytest.approx(150) and w["intervals_tokens_per_s"] == [100, 300]
    assert w["iterations"] == 10 and w["mfu"] is None
    w = timed_window(_records([10, 100, 300], mfu_per_rate=0.001), first=5, last=15)
    assert w["mfu"] == pytest.approx(0.15)
    assert timed_window(_records([10, 100]), first=5, last=15) is None  # the log stops before the window ends


def test_a_point_is_the_median_of_all_intervals_with_the_spread_of_its_repeats():
    runs = [{"ok": True, "max_memory_gib": 10.0, "max_memory_reserved_gib": 12.5,
             "window": timed_window(_records([1, 90, 110]), 5, 15)},
            {"ok": True, "max_memory_gib": 11.0, "max_memory_reserved_gib": None,  # a repeat that recorded none
             "window": timed_window(_records([1, 100, 120]), 5, 15)},
            {"ok": False, "error": "timeout after 200s"}]
    p = summarize(runs, num_layers=2)
    assert p["ok"] and p["repeats"] == 2 and p["tokens_per_s"] == pytest.approx(105)  # median of 90,100,110,120
    a, b = 2 / (1 / 90 + 1 / 110), 2 / (1 / 100 + 1 / 120)
    assert p["spread_repeats"] == pytest.approx((b - a) / ((a + b) / 2))
    assert p["spread_intervals"] == pytest.approx(30 / 105) and p["max_memory_gib"] == 11.0
    assert p["max_memory_reserved_gib"] == 12.5  # the largest recorded; a CPU point has none
    assert summarize(runs[1:2], num_layers=2)["max_memory_reserved_gib"] is None
    assert len(p["runs"]) == 3  # the failed repeat is kept in the JSON
    failed = summarize([{"ok": False, "skipped": "torchao is not installed"}], num_layers=2)
    assert not failed["ok"] and failed["skipped"] == "torchao is not installed"


def test_plain_loop_names_the_flag_it_does_not_support():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.e2e.plain_llama", "--coat-fp8", "--eval-iters", "0"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and proc.stderr.strip().splitlines()[-1].startswith("error: --fp8-activations")
    assert "Traceback" not in proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed (extra 'bench')")
def test_torchao_converts_the_block_linears_and_keeps_the_head():
    from torchao.float8.float8_linear import Float8Linear
    from benchmarks.e2e.torchao_pretrain import float8_linears

    from megacoat.model import GPT
    from megacoat.model.config import ModelConfig

    cfg = ModelConfig(num_layers=2, vocab_size=256, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                      seq_length=32)
    model = float8_linears(GPT(cfg))
    converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert converted == linears - {"output"} and len(converted) == 2 * 7
    tokens = torch.randint(0, 256, (2, 32))
    model(tokens, tokens).backward()  # trains (torchao emulates the FP8 GEMMs without CUDA)
    assert model.layers[0].attention.wq.weight.grad is not None


@pytest.mark.slow
def test_speed_on_a_tiny_model_writes_each_point_with_its_profile(tmp_path):
    out = tmp_path / "speed.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.e2e.speed", "--model", "tiny",
                           "--micro-batch-size", "2", "--modes", "bf16", "plain-llama", "--baseline", "bf16",
                           "--warmup", "2", "--iters", "4", "--log-interval", "2", "--repeats", "2", "--profile",
                           "--timeout", "500", "--out", str(out)],
                          capture_output=True, text=True, timeout=1500, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["method"]["timed_iterations"] == 4 and result["environment"]["command"]
    for mode in ("bf16", "plain-llama"):
        point = result["points"]["2"][mode]
        assert point["ok"] and point["repeats"] == 2 and len(point["runs"]) == 2, point
        assert point["tokens_per_s"] > 0 and point["speedup_vs_baseline"] > 0
        assert point["profile"]["device"]["steps"] == 3 and point["profile"]["device"]["wall_us"] > 0
    assert result["points"]["2"]["bf16"]["speedup_vs_baseline"] == 1


def test_every_trainer_recipe_parses():
    """The recipes run by pretrain_gpt.py parse with the benchmark's model flags; only bf16 is without FP8."""
    from megacoat.arguments import parse_config

    for mode, (script, flags) in RECIPES.items():
        if script == "pretrain_gpt.py":
            cfg = parse_config(MODELS["tiny"] + cpu_check_flags(flags))
            assert (cfg.fp8.mode == "bf16") == (mode == "bf16"), mode


def _bench(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "benchmarks.e2e.speed", *args],
                          capture_output=True, text=True, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.mark.parametrize("args, message", [
    (["--at-largest", "bf16@x"], "expected MODE@MICRO_BATCH"),
    (["--at-largest", "bf16"], "expected MODE@MICRO_BATCH"),
    (["--at-largest", "nope@4"], "expected MODE@MICRO_BATCH"),
    (["--at-largest", "coat@2", "fp8-linear@4"], "needs the baseline (bf16) among its modes"),
    (["--at-largest", "bf16@2", "bf16@4"], "names a mode twice"),
    (["--at-largest", "bf16@2", "--search", "2,4"], "pass one"),
    (["--iters", "7"], "multiple of --log-interval"),
])
def test_at_largest_refuses_what_it_cannot_measure(args, message):
    proc = _bench("--model", "tiny", *args)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_at_largest_runs_each_mode_at_its_own_micro_batch(tmp_path):
    """The throughput each mode reaches at its own largest micro-batch, repeats interleaved, against the baseline's:
    what issue 18's last target compares (compiled bf16 at 16 against coat at 24 or 32 on the H100)."""
    out = tmp_path / "largest.json"
    proc = _bench("--model", "tiny", "--at-largest", "bf16@2", "fp8-linear@4", "--baseline", "bf16", "--warmup", "2",
                  "--iters", "2", "--log-interval", "2", "--repeats", "2", "--timeout", "500", "--out", str(out),
                  timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["points"] == {}  # no --micro-batch-size: only the sized runs
    for mode, size in (("bf16", 2), ("fp8-linear", 4)):
        res = result["largest_micro_batch"][mode]
        assert res["ok"] and res["repeats"] == 2 and res["micro_batch_size"] == size, res
        for run in res["runs"]:
            argv = run["argv"]
            assert argv[argv.index("--micro-batch-size") + 1] == str(size)
    assert result["largest_micro_batch"]["bf16"]["speedup_vs_baseline_at_its_largest"] == 1
    assert result["largest_micro_batch"]["fp8-linear"]["speedup_vs_baseline_at_its_largest"] > 0
