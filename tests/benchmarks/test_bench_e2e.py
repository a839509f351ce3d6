"""benchmarks/bench_e2e.py's method (mode labels, the timed window, a point's median and spread) and its two
launchers: the plain Llama loop (refuses what it does not do) and torchao's conversion (which linears become
float8). The GPU figures themselves come from benchmarks/device_run.sh."""
import argparse
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
sys.path.insert(0, BENCH)

from bench_e2e import (COAT, COAT_FP8_HEAD, FP32_STATE, MODEL_TINY, MODES, mode_command, mode_spec,  # noqa: E402
                       summarize, timed_window)


def _records(rates, every=5, mfu_per_rate=None):
    return [{"iteration": every * (i + 1), "tokens_per_s": r, "mfu": None if mfu_per_rate is None else r * mfu_per_rate}
            for i, r in enumerate(rates)]


def test_mode_labels_and_their_commands():
    assert mode_spec("coat+compile") == "coat+compile"
    assert mode_spec("plain-llama+compile") == "plain-llama"  # always compiled: one label for it
    for bad in ("bogus", "coat+eager", "bf16+", "plain-llama+cudagraph"):
        with pytest.raises(argparse.ArgumentTypeError, match="MODE, MODE\\+compile or MODE\\+cudagraph"):
            mode_spec(bad)
    # "coat" pins COAT's just-in-time scaling and the BF16 head: its name means what it measured before delayed
    # scaling became the default, and whatever the head's default becomes
    assert COAT == ["--coat-fp8", "--fp8-grad-scaling", "current", "--fp8-activation-scaling", "current",
                    "--fp8-output-layer", "off"]
    assert mode_command("coat") == ("pretrain_gpt.py", COAT)
    assert mode_command("coat+cudagraph") == ("pretrain_gpt.py", [*COAT, "--compile", "--enable-cuda-graph"])
    assert mode_command("coat-lean")[1][:len(COAT)] == COAT
    assert mode_command("bf16+compile") == ("pretrain_gpt.py", ["--compile"])
    # the FP8 head pinned on; its fp32-state reference adds COAT's optimizer-side state to it alone
    assert mode_command("coat-fp8-head") == ("pretrain_gpt.py", COAT_FP8_HEAD)
    assert COAT_FP8_HEAD[-2:] == ["--fp8-output-layer", "on"]
    assert mode_command("coat-fp8-head-fp32-state")[1] == [*COAT_FP8_HEAD, *FP32_STATE]
    assert mode_command("torchao-float8") == ("benchmarks/torchao_pretrain.py", ["--compile"])


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
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "plain_llama.py"), "--coat-fp8", "--eval-iters", "0"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and proc.stderr.strip().splitlines()[-1].startswith("error: --fp8-activations")
    assert "Traceback" not in proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed (extra 'bench')")
def test_torchao_converts_the_block_linears_and_keeps_the_head():
    from torchao.float8.float8_linear import Float8Linear
    from torchao_pretrain import float8_linears

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
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "bench_e2e.py"), "speed", "--tiny",
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


def test_every_trainer_mode_parses():
    """bench_e2e's megacoat modes (pretrain_gpt.py with extra flags) parse, with the benchmark's model flags."""
    from megacoat.arguments import parse_config

    for mode, (script, flags) in MODES.items():
        if script == "pretrain_gpt.py":
            cfg = parse_config(MODEL_TINY + list(flags))
            # every coat name pins its head: the FP8 one in the coat-fp8-head names alone
            assert "--fp8-output-layer" in flags or cfg.fp8.mode != "coat", mode
            assert cfg.fp8.output_layer == mode.startswith("coat-fp8-head"), mode


def _bench(*args, timeout=60):
    return subprocess.run([sys.executable, os.path.join(BENCH, "bench_e2e.py"), "speed", *args],
                          capture_output=True, text=True, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.mark.parametrize("args, message", [
    (["--at-largest", "bf16@x"], "expected MODE@MICRO_BATCH"),
    (["--at-largest", "bf16"], "expected MODE@MICRO_BATCH"),
    (["--at-largest", "nope@4"], "expected MODE, MODE+compile or MODE+cudagraph"),
    (["--at-largest", "bf16@2", "coat@4"], "needs the baseline (bf16+compile) among its modes"),
    (["--at-largest", "bf16+compile@2", "bf16+compile@4"], "names a mode twice"),
    (["--at-largest", "bf16+compile@2", "--search", "2,4"], "pass one"),
])
def test_at_largest_refuses_what_it_cannot_measure(args, message):
    proc = _bench("--tiny", *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_at_largest_runs_each_mode_at_its_own_micro_batch(tmp_path):
    """The throughput each mode reaches at its own largest micro-batch, repeats interleaved, against the baseline's:
    what issue 18's last target compares (compiled bf16 at 16 against coat at 24 or 32 on the H100)."""
    out = tmp_path / "largest.json"
    proc = _bench("--tiny", "--at-largest", "bf16@2", "fp8-linear@4", "--baseline", "bf16", "--warmup", "2",
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
