"""benchmarks/fidelity/head_grad_error.py: the tiny random case runs as a script and its numbers hang together; its stochastic
E5M2 rounding is E5M2 and unbiased."""
import importlib
import json

import torch

from tests.benchmarks.conftest import run_module

SCRIPT = "benchmarks.fidelity.head_grad_error"


def test_tiny_case_runs_and_agrees_with_the_library(tmp_path):
    out = str(tmp_path / "head_grad_error.json")
    proc = run_module(SCRIPT, "--tiny", "--accumulate", "2", "--out", out)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    with open(out) as f:
        res = json.load(f)
    assert res["kind"] == "head_grad_error" and res["environment"]["torch"] == torch.__version__
    head = res["snapshots"][0]["head"]["schemes"]
    # the emulation of scheme B (dequantized codes plus the label residual, float64 GEMMs) is the library's own
    # fp8_head_loss on the CPU, which adds the residual back (at this random initialization the E4M3 operands'
    # rounding dominates every FP8 scheme, so A and B are alike here; the trained model tells them apart)
    for key in ("dx_rel_err", "dW_rel_err"):
        assert abs(head["lib"][key] - head["B-bf16z"][key]) < 0.1 * head["B-bf16z"][key]
    # the zero-sum projection has no row-sum error; B's exact label entries leave less of it than A's
    assert head["A-zs"]["rowsum_err"] < 1e-12 and head["B|g"]["rowsum_err"] < head["A|g"]["rowsum_err"]
    # the BF16 head is far more exact than any FP8 scheme with E4M3 operands
    assert head["E"]["dx_rel_err"] < 0.25 * head["A"]["dx_rel_err"]
    assert set(res["snapshots"][0]["mid"]) == {"layers.0.feed_forward.w2", "layers.1.feed_forward.w2"}
    assert res["accumulation"]["micro_batches"] == 2 and set(res["accumulation"]["by_k"]) == {"1", "2"}
    assert "accumulated wgrad" in proc.stdout


def test_stochastic_e5m2_rounding_is_on_the_grid_and_unbiased():
    sr_e5m2 = importlib.import_module("benchmarks.fidelity.head_grad_error").sr_e5m2
    g = torch.tensor([[0.3, -0.7, 1.1, 2.0, -1e-6, 0.0]])
    g = g.repeat(4000, 1)
    q = sr_e5m2(g, seed=0)
    scale = float(g.abs().max()) / torch.finfo(torch.float8_e5m2).max  # the library's, up to float32 rounding
    codes = (q / scale).float()
    assert torch.allclose(codes.to(torch.float8_e5m2).float(), codes, rtol=1e-6)  # E5M2 codes times the scale
    assert len(torch.unique(q[:, 0])) == 2  # 0.3 between two codes: both drawn
    assert torch.allclose(q.mean(0), g[0].double(), rtol=0.02, atol=1e-8)
    assert q[:, 3].eq(q[0, 3]).all() and abs(float(q[0, 3]) - 2.0) < 1e-6 and q[:, 5].eq(0).all()  # codes stay
