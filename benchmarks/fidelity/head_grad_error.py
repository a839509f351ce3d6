"""Why the FP8 output layer's backward costs loss: the error of its dgrad and wgrad on a real batch, scheme by scheme.

--fp8-output-layer (before its label correction) ended +0.30% above bf16 at 350 M, and the cost is its backward
(head_precision_eval: evaluating with an FP8 forward costs 0.03%; a BF16-forward variant was no better). The backward
casts the logits' gradient g = c (softmax(z) - onehot(y)) to E5M2 with one per-tensor scale and runs dx = g8 @ W8
and dW = g8^T @ x8 (W, x in E4M3). Each row of g sums to zero and its largest entry is the label's c (p_y - 1).
Two explanations are tested: the rounded row's leftover sum along the embeddings' common (mean) direction w_bar
(scheme A-zs removes it: not the cause, head_grad_error.json), and the label entry's own rounding (scheme B adds it
back: it halves the gradient's part of the error and removes its bias; per-tensor E5M2 reads every p_y < 1/14 as 0).
The other linears' output gradients (scheme F) have neither structure.

What it does (CPU, float64 references):
1. a small GPT (4 layers, hidden 256, 5.5 M parameters) trained by the repo's own trainer (pretrain_gpt.py, fp32 on
   the CPU, 2048 tokens a step) on the stdlib corpus with an 8192-token sentencepiece vocabulary
   (megacoat.data.prepare_default_corpus), checkpoints every --save-interval;
   or --checkpoint-dir of such a run; plus the model at initialization (GPT(cfg) under --seed);
2. for each snapshot, one held-out batch (the trainer's validation range, file order): x (the final norm's
   output), W (the tied head), the labels, and the real output gradient and input of every block's MLP down
   projection w2 (scheme F);
3. the exact dx, dW of the mean cross-entropy in float64 and, per scheme, the relative error, cosine, the part of
   the dx error along w_bar, what survives the final RMSNorm's backward (dh), the "common row" part of the dW
   error, the row-sum error of the quantized gradient and the dW error on frequent / rare / unlabelled rows.

Schemes (logits: float32 from the float64 GEMM, so the backward's rounding alone, unless the name says bf16):
  A      the uncorrected FP8 head: g by cross_entropy_grad_fp8_ref (E5M2, per-tensor current scaling), W and x E4M3
         per tensor (quantize_transpose / quantize_x), GEMMs dequantized in float64 (= fp32 accumulation)
  A-g    A's g8 with exact W and x (the gradient's rounding alone);  A-wx: exact g with A's W8 and x8
  B      A plus the label entry's exact correction r_i = g_iy - dq(g8_iy): dx_i += r_i W_y (bf16), dW_y += r_i x_i
         (what the library's FP8 head does, with x_i as wgrad's E4M3 copy)
  C      g in E4M3 per tensor;  C+B: C with B's correction
  D-e5m2 / D-e4m3: split, p = c softmax quantized, dx = Q(p) W8 - c W_y, dW = Q(p)^T x8 - scatter_add(c x, y)
  E      the BF16 head: g, W, x in bf16, fp32 (here float64) accumulation
  E-bf16z, A-bf16z, B-bf16z: E, A and B from bf16 logits (what the heads see on the GPU)
  lib    the library's own fp8_head_loss on the CPU (torch._scaled_mm, its forward in FP8): scheme B on FP8 logits,
         since the head adds the label residual back (head_grad_error.json predates that: its lib-bf16fwd and
         lib-fp8fwd rows are scheme A's, the forward in BF16 / FP8)
  F      layers.i.feed_forward.w2 with its real output gradient E5M2 per tensor, input and weight E4M3 (the accepted
         error level of the other linears); F-bf16: the same linear in bf16

The measurement also sums the wgrad of K micro-batches (--accumulate, on the last snapshot): an unbiased rounding
error averages down against the summed gradient, a biased one does not.

benchmarks/results/head_grad_error.json is (2 CPU cores: training 843 s, val loss 4.52 at 900; measuring 174 s)
    python -m benchmarks.fidelity.head_grad_error --work /tmp/headgrad_long --train-iters 900 --save-interval 150 \
        --iterations 150 450 900 --accumulate 8 --out benchmarks/results/head_grad_error.json
Other uses:
    python -m benchmarks.fidelity.head_grad_error --checkpoint-dir DIR/ckpt --data-prefix SHARD --iterations 300
    python -m benchmarks.fidelity.head_grad_error --tiny --out /tmp/t.json          # random tiny model, seconds (the test)
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import re
import subprocess
import sys
import time

import torch

from benchmarks.common import ROOT, load_tool  # noqa: E402

from megacoat.ops.formats import E4M3, E5M2  # noqa: E402
from megacoat.coat.linear import quantize_x  # noqa: E402
from megacoat.model.config import ModelConfig  # noqa: E402
from megacoat.model.gpt import GPT, IGNORE_INDEX  # noqa: E402
from megacoat.ops.cast_transpose import quantize_transpose  # noqa: E402
from megacoat.ops.cross_entropy_fp8 import cross_entropy_grad_fp8_ref, cross_entropy_stats_ref  # noqa: E402

MODEL = dict(num_layers=4, hidden_size=256, ffn_hidden_size=768, num_attention_heads=4, seq_length=128)
TINY = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, seq_length=32, vocab_size=512)
FMT = {"e4m3": E4M3.dtype, "e5m2": E5M2.dtype}
D = torch.float64


# --- 1. the model: trained by pretrain_gpt.py ------------------------------------------------------------------
def train(work: str, vocab_size: int, iters: int, save_interval: int, seed: int) -> dict:
    """Build the stdlib corpus with a `vocab_size` tokenizer under work/cache and train MODEL on it with the repo's
    trainer into work/ckpt (skipped when work/ckpt already holds the last iteration). Returns what it ran."""
    from megacoat.data import prepare_default_corpus

    corpus = prepare_default_corpus(cache_dir=os.path.join(work, "cache"), vocab_size=vocab_size, progress=False)
    save = os.path.join(work, "ckpt")
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"),
           *[a for k, v in MODEL.items() for a in (f"--{k.replace('_', '-')}", str(v))],
           "--vocab-size", str(vocab_size), "--micro-batch-size", "8", "--global-batch-size", "16",
           "--train-iters", str(iters), "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "20",
           "--log-interval", "10", "--eval-interval", "100", "--eval-iters", "4", "--seed", str(seed),
           "--data-path", corpus.data_prefix, "--tokenizer-model", corpus.tokenizer_model,
           "--data-cache-dir", os.path.join(work, "cache"), "--save", save, "--save-interval", str(save_interval),
           "--log-json", os.path.join(work, "train_log.jsonl")]
    done = os.path.isdir(os.path.join(save, f"iter_{iters:07d}"))
    if not done:
        t0 = time.time()
        print("training:", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=work)
        print(f"trained in {time.time() - t0:.0f} s", flush=True)
    return {"command": " ".join(cmd), "reused": done, "data_prefix": corpus.data_prefix,
            "tokenizer_model": corpus.tokenizer_model, "checkpoint_dir": save}


def train_log(work: str) -> list[dict]:
    path = os.path.join(work, "train_log.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def held_out_batch(data_prefix: str, seq: int, samples: int, split: str = "969,30,1"):
    """The first `samples` sequences of the trainer's validation range (--split), in file order."""
    from benchmarks.fidelity.grads import fixed_batch
    return fixed_batch({"data_prefix": data_prefix, "split": split}, seq, samples)


# --- 2. what the head and the mid-network linears see ----------------------------------------------------------
def rmsnorm64(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight


def capture(cfg: ModelConfig, state: dict | None, tokens, labels, seed: int) -> dict:
    """One fp32 forward and backward of the model (the trainer's CPU precision): the final norm's input h [T, H],
    the head's weight W [V, H], and every w2's input and real output gradient, all as float64."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    if state is not None:
        model.load_state_dict(state)
    model.float()
    seen: dict = {}

    def keep_h(module, inputs, output):
        seen["h"] = inputs[0].detach()

    hooks = [model.norm.register_forward_hook(keep_h)]
    for i, layer in enumerate(model.layers):
        def keep(module, inputs, output, i=i):
            seen[f"w2_in.{i}"] = inputs[0].detach()
            output.register_hook(lambda g, i=i: seen.__setitem__(f"w2_grad.{i}", g.detach()))
        hooks.append(layer.feed_forward.w2.register_forward_hook(keep))
    loss = model(tokens, labels)
    loss.backward()
    for hk in hooks:
        hk.remove()
    flat = lambda t: t.reshape(-1, t.shape[-1]).to(D)  # noqa: E731
    mids = {f"layers.{i}.feed_forward.w2": (flat(seen[f"w2_in.{i}"]), layer.feed_forward.w2.weight.detach().to(D),
                                            flat(seen[f"w2_grad.{i}"])) for i, layer in enumerate(model.layers)}
    return {"h": flat(seen["h"]), "norm_weight": model.norm.weight.detach().to(D), "norm_eps": cfg.norm_eps,
            "W": model.output.weight.detach().to(D), "labels": labels.reshape(-1),
            "loss_fp32": float(loss.detach()),
            "mids": mids}


# --- quantization helpers --------------------------------------------------------------------------------------
def dq(t: torch.Tensor, fmt: str) -> torch.Tensor:
    """t (2-D) cast to FP8 with one per-tensor scale from its amax (the library's quantize_transpose), as float64."""
    q, _, s = quantize_transpose(t.contiguous(), FMT[fmt], rowwise=True, transpose=False)
    return q.to(D) * s.to(D)


def bf(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(D)


def lib_grad(z32: torch.Tensor, labels: torch.Tensor, coef: float, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(dequantized g8, the float32 g the kernel rounds) of the library's fused loss backward (reference path)."""
    _, lse, amax = cross_entropy_stats_ref(z32, labels, IGNORE_INDEX)
    c = torch.tensor([coef], dtype=torch.float32)
    g8, _, scale, _ = cross_entropy_grad_fp8_ref(z32, labels, lse, amax, c, FMT[fmt], IGNORE_INDEX,
                                                 transpose=False)
    p = torch.exp(z32.float() - lse[:, None])
    onehot = torch.zeros_like(p).scatter_(1, labels[:, None], 1.0)
    g32 = (p - onehot) * c
    return g8.to(D) * scale.to(D), g32.to(D)


def library_head(x: torch.Tensor, W: torch.Tensor, labels: torch.Tensor):
    """dx, dW of the library's own fp8_head_loss (an Fp8Linear on bf16 weights, CPU torch._scaled_mm)."""
    from megacoat.coat.head import fp8_head_loss
    from megacoat.coat.linear import Fp8Linear

    lin = torch.nn.Linear(W.shape[1], W.shape[0], bias=False).bfloat16()
    with torch.no_grad():
        lin.weight.copy_(W.to(torch.bfloat16))
    head = Fp8Linear(lin)
    xb = x.to(torch.bfloat16).requires_grad_()
    fp8_head_loss(head, xb, labels, IGNORE_INDEX).backward()
    return xb.grad.to(D), head.weight.grad.to(D)


# --- 3. metrics ------------------------------------------------------------------------------------------------
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a * b).sum() / (a.norm() * b.norm()))


class Reference:
    """The exact gradients of one linear (dx = g W, dW = g^T x, float64) and what the metrics need of them."""

    def __init__(self, g, W, x, labels=None, norm_vjp=None, p_y=None):
        self.g, self.W, self.x, self.labels = g, W, x, labels
        self.dx, self.dW = g @ W, g.t() @ x
        wbar, xbar = W.mean(0), x.mean(0)
        self.u_w, self.u_x = wbar / wbar.norm(), xbar / xbar.norm()
        self.norm_vjp = norm_vjp
        self.dh = norm_vjp(self.dx) if norm_vjp else None
        self.g_l1 = float(g.abs().sum(1).mean())
        self.groups = None
        if labels is not None:  # dW rows by how often the row's token is a label in this batch
            counts = torch.bincount(labels, minlength=W.shape[0])
            order = counts.argsort(descending=True)
            covered = counts[order].cumsum(0) <= 0.5 * labels.numel()
            frequent = torch.zeros_like(counts, dtype=torch.bool)
            frequent[order[:int(covered.sum()) + 1]] = True
            self.groups = {"frequent (top tokens, half the labels)": frequent,
                           "rare (label 1-2 times)": (counts >= 1) & (counts <= 2) & ~frequent,
                           "unlabelled": counts == 0}
        self.py_bins = None
        if p_y is not None:  # tokens by the probability of their label: E5M2 stores p_y < 1/14 as 0
            self.py_bins = {"p_y<1/14": p_y < 1 / 14, "1/14<=p_y<0.5": (p_y >= 1 / 14) & (p_y < 0.5),
                            "p_y>=0.5": p_y >= 0.5}

    def structure(self) -> dict:
        """How large the common directions are: |w_bar| against the rms row norm of W, and dx's own energy along it."""
        wbar = self.W.mean(0)
        xbar = self.x.mean(0)
        return {"wbar_norm_over_rms_row": float(wbar.norm() / self.W.pow(2).sum(1).mean().sqrt()),
                "xbar_norm_over_rms_row": float(xbar.norm() / self.x.pow(2).sum(1).mean().sqrt()),
                "dx_energy_frac_along_wbar": float((self.dx @ self.u_w).pow(2).sum() / self.dx.pow(2).sum()),
                "random_direction_frac": 1.0 / self.W.shape[1],
                # cancellation: the label's term c (p_y - 1) W_y against dx = c (E_p[W] - W_y); a relative error
                # of that one term is amplified by this ratio in dx
                **({"label_term_over_dx": float(
                    (self.g.gather(1, self.labels[:, None]) * self.W[self.labels]).norm() / self.dx.norm())}
                   if self.labels is not None else {}),
                **({f"tokens {k}": int(m.sum()) for k, m in self.py_bins.items()} if self.py_bins else {})}

    def metrics(self, dx, dW, g_hat=None) -> dict:
        e, E = dx - self.dx, dW - self.dW
        out = {"dx_rel_err": _rel(dx, self.dx), "dx_cos": _cos(dx, self.dx),
               "dx_err_along_wbar_rel": float((e @ self.u_w).norm() / self.dx.norm()),
               "dx_err_frac_along_wbar": float((e @ self.u_w).pow(2).sum() / e.pow(2).sum()),
               "dW_rel_err": _rel(dW, self.dW), "dW_cos": _cos(dW, self.dW),
               # the part of the dW error that moves every row alike (the mean row), which the exact head
               # gradient never does: its energy fraction (a random error: 1/V)
               "dW_err_frac_common_row": float(E.sum(0).pow(2).sum() / E.shape[0] / E.pow(2).sum()),
               "dW_err_along_xbar_rel": float((E @ self.u_x).norm() / self.dW.norm())}
        if self.norm_vjp is not None:  # what reaches the residual stream: through the final RMSNorm's backward
            dh = self.norm_vjp(dx)
            out["dh_rel_err"] = _rel(dh, self.dh)
            out["dh_cos"] = _cos(dh, self.dh)
        # the error's part along the exact gradient itself (a gain: > 0 overshoots); unbiased noise has ~0
        out["dx_gain"] = float((e * self.dx).sum() / self.dx.pow(2).sum())
        out["dW_gain"] = float((E * self.dW).sum() / self.dW.pow(2).sum())
        if g_hat is not None:
            s = (g_hat - self.g).sum(1)
            out["rowsum_err"] = float(s.abs().mean()) / self.g_l1
            out["rowsum_bias"] = float(s.mean()) / self.g_l1
            out["g_rel_err"] = _rel(g_hat, self.g)
            # the dx error that the row sums alone make: (g_hat - g) = its zero-sum part + s_i / V on every entry,
            # and the latter times W is s_i w_bar
            out["dx_rowsum_term_rel"] = float(s.norm() * self.W.mean(0).norm() / self.dx.norm())
        if self.py_bins is not None:
            out["dx_rel_err_by_p_y"] = {k: (_rel(dx[m], self.dx[m]) if m.any() else None)
                                        for k, m in self.py_bins.items()}
        if self.groups is not None:
            out["dW_rel_err_by_rows"] = {k: (_rel(dW[m], self.dW[m]) if m.any() else None)
                                         for k, m in self.groups.items()}
        return out


def sr_e5m2(g: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """g (float32, 2-D) in E5M2 with one per-tensor scale (the library's), stochastically rounded, dequantized:
    E5M2 is float16 with its low 8 mantissa bits dropped, so adding a uniform 8-bit integer to the float16 bits
    of |g| / scale and truncating rounds up with probability the distance to the lower code (unbiased)."""
    _, _, scale = quantize_transpose(g.contiguous(), E5M2.dtype, rowwise=True, transpose=False)
    y = (g.float() / scale).clamp(-E5M2.max, E5M2.max).to(torch.float16)
    bits = y.view(torch.int16).to(torch.int32)
    sign, mag = bits & 0x8000, bits & 0x7FFF
    noise = torch.randint(0, 256, mag.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int32)
    mag = torch.clamp((mag + noise) & ~0xFF, max=0x7B00)  # 0x7B00: 57344, E5M2's largest finite
    q = (sign | mag).to(torch.int16).view(torch.float16)
    return q.to(D) * scale.to(D)


def scheme_defs(z: torch.Tensor, y: torch.Tensor, c: float, seed: int = 0) -> tuple[dict, torch.Tensor]:
    """{name: (gq, r, ops)} of the head's schemes from exact logits z [T, V] (float64) and labels y, and the float32
    g the library's kernel forms. gq multiplies the E4M3 operands (W8, x8; ops 'bf16': the bf16 W and x); r [T] (or
    None) corrects each token's label entry against the bf16 W_y and x_i exactly (dx_i += r_i W_y, dW_y += r_i x_i)."""
    T, V = z.shape
    z32 = z.float()
    gA, g32 = lib_grad(z32, y, c, "e5m2")
    gC, _ = lib_grad(z32, y, c, "e4m3")
    rows = torch.arange(T)
    p32 = (torch.softmax(z32, dim=-1) * c).float()
    defs = {"A": (gA, None, "fp8"),
            "B": (gA, g32[rows, y] - gA[rows, y], "fp8"),
            # A's row sums spread back over each row (its zero-sum projection): the mean-direction term alone fixed
            "A-zs": (gA - gA.sum(1, keepdim=True) / V, None, "fp8"),
            "A-SR": (sr_e5m2(g32, seed), None, "fp8"),
            "C": (gC, None, "fp8"),
            "C+B": (gC, g32[rows, y] - gC[rows, y], "fp8"),
            **{f"D-{fmt}": (dq(p32, fmt), torch.full((T,), -c, dtype=D), "fp8") for fmt in ("e5m2", "e4m3")},
            "E": (bf(g32), None, "bf16")}
    return defs, g32


def apply_scheme(gq, r, ops, y, W8, x8, Wb, xb, need_dx: bool = True):
    """(dx or None, dW, the effective gradient gq + r at the labels)."""
    Wo, xo = (W8, x8) if ops == "fp8" else (Wb, xb)
    dx = gq @ Wo if need_dx else None
    dW = gq.t() @ xo
    g_hat = gq
    if r is not None:
        rows = torch.arange(gq.shape[0])
        if need_dx:
            dx = dx + r[:, None] * Wb[y]
        dW = dW.index_add(0, y, r[:, None] * xb)
        g_hat = gq.index_put((rows, y), r, accumulate=True)
    return dx, dW, g_hat


def head_operands(cap: dict):
    """(x, W8, x8, Wb, xb): the head's input in float64 from the final norm, and the operands as the GPU has them."""
    x = rmsnorm64(cap["h"], cap["norm_weight"], cap["norm_eps"])
    W = cap["W"]
    W8 = dq(W.to(torch.bfloat16), "e4m3")  # the weight cache's cast of the bf16 weight
    x8q, _, x_scale = quantize_x(x.to(torch.bfloat16), transpose=False)  # the head's input, bf16 on the GPU
    return x, W8, x8q.to(D) * x_scale.to(D), bf(W), bf(x)


def head_schemes(cap: dict, with_library: bool = True, seed: int = 0) -> dict:
    """Every head scheme's metrics on one snapshot's batch (see the module docstring and scheme_defs). Each scheme's
    '|g' row: its effective gradient against the exact W and x (the gradient's rounding alone)."""
    h, W, y = cap["h"], cap["W"], cap["labels"]
    nw, eps = cap["norm_weight"], cap["norm_eps"]
    x, W8, x8, Wb, xb = head_operands(cap)
    T = x.shape[0]
    c = 1.0 / T
    z = x @ W.t()
    p64 = torch.softmax(z, dim=-1)
    onehot = torch.zeros_like(p64).scatter_(1, y[:, None], 1.0)
    g = c * (p64 - onehot)

    def norm_vjp(v):
        hh = h.clone().requires_grad_()
        return torch.autograd.grad(rmsnorm64(hh, nw, eps), hh, v)[0]

    ref = Reference(g, W, x, y, norm_vjp, p_y=p64.gather(1, y[:, None])[:, 0])
    # the exact gradients agree with autograd's of F.cross_entropy
    xx, WW = x.clone().requires_grad_(), W.clone().requires_grad_()
    torch.nn.functional.cross_entropy(xx @ WW.t(), y).backward()
    check = max(_rel(xx.grad, ref.dx), _rel(WW.grad, ref.dW))
    assert check < 1e-10, f"exact gradients disagree with autograd: {check}"

    res = {}
    defs, g32 = scheme_defs(z, y, c, seed)
    for name, (gq, r, ops) in defs.items():
        dx, dW, g_hat = apply_scheme(gq, r, ops, y, W8, x8, Wb, xb)
        res[name] = ref.metrics(dx, dW, g_hat)
        res[name + "|g"] = ref.metrics(g_hat @ W, g_hat.t() @ x, g_hat)
        if name == "A":  # exact g, E4M3 operands: the operands' rounding alone
            res["A-wx"] = ref.metrics(g @ W8, g.t() @ x8, g)
    del defs
    zb = bf(z).float()  # the logits a bf16 GEMM hands the loss (here: exact ones rounded to bf16)
    gEz = bf(c * (torch.softmax(zb.to(D), dim=-1) - onehot))
    res["E-bf16z"] = ref.metrics(gEz @ Wb, gEz.t() @ xb, gEz)
    gAz, g32z = lib_grad(zb, y, c, "e5m2")
    res["A-bf16z"] = ref.metrics(gAz @ W8, gAz.t() @ x8, gAz)
    rows = torch.arange(len(y))
    res["B-bf16z"] = ref.metrics(*apply_scheme(gAz, g32z[rows, y] - gAz[rows, y], "fp8", y, W8, x8, Wb, xb))
    if with_library:
        res["lib"] = ref.metrics(*library_head(x, W, y))
    return {"reference": ref.structure(), "schemes": res, "batch": _batch_stats(p64, y, c)}


def accumulation(cfg: ModelConfig, state, tokens, labels, micro: int, seed: int) -> dict:
    """The wgrad error of a gradient accumulated over K micro-batches (K = 1, 2, 4, ...: len(tokens) / micro),
    each micro-batch cast with its own per-tensor scales and c = 1 / its tokens, as gradient accumulation does.
    A rounding error that is unbiased averages down against the summed gradient; a biased one does not."""
    K = tokens.shape[0] // micro
    sums: dict = {}
    exact: dict = {}
    out = {"micro_batches": K, "samples_per_micro_batch": micro, "by_k": {}}
    t0 = time.time()
    for b in range(K):
        cap = capture(cfg, state, tokens[b * micro:(b + 1) * micro], labels[b * micro:(b + 1) * micro], seed)
        x, W8, x8, Wb, xb = head_operands(cap)
        y, W = cap["labels"], cap["W"]
        c = 1.0 / x.shape[0]
        z = x @ W.t()
        g = c * (torch.softmax(z, dim=-1) - torch.zeros_like(z).scatter_(1, y[:, None], 1.0))
        grads = {"head exact": g.t() @ x}
        defs, _ = scheme_defs(z, y, c, seed + b)
        for name, (gq, r, ops) in defs.items():
            grads[f"head {name}"] = apply_scheme(gq, r, ops, y, W8, x8, Wb, xb, need_dx=False)[1]
        del defs
        for lname, (xin, Wm, gm) in cap["mids"].items():
            short = lname.replace("layers.", "L").replace(".feed_forward.w2", ".w2")
            grads[f"{short} exact"] = gm.t() @ xin
            g8 = dq(gm.float(), "e5m2")
            grads[f"{short} F"] = g8.t() @ dq(xin.to(torch.bfloat16), "e4m3")
            grads[f"{short} F-bf16"] = bf(gm).t() @ bf(xin)
        for k, v in grads.items():
            (exact if k.endswith(" exact") else sums)[k] = (exact if k.endswith(" exact") else sums).get(k, 0) + v
        n = b + 1
        if n & (n - 1) == 0 or n == K:  # 1, 2, 4, 8, ... and the last
            row = {}
            for k, v in sums.items():
                ref = exact[k.rsplit(" ", 1)[0] + " exact"]
                err = v - ref
                row[k] = {"dW_rel_err": float(err.norm() / ref.norm()),
                          "dW_gain": float((err * ref).sum() / ref.pow(2).sum())}
            out["by_k"][n] = row
    out["seconds"] = round(time.time() - t0, 1)
    return out


def _batch_stats(p: torch.Tensor, y: torch.Tensor, c: float) -> dict:
    py = p.gather(1, y[:, None])[:, 0]
    return {"tokens": int(y.numel()), "loss": float(-py.log().mean()), "p_y_mean": float(py.mean()),
            "p_y_quartiles": [float(q) for q in torch.quantile(py, torch.tensor([0.25, 0.5, 0.75], dtype=D))],
            "p_y_above_half": float((py > 0.5).to(D).mean()),
            # with the batch's amax near c (some token has p_y ~ 0), E5M2's two top codes are c and 6/7 c: a label
            # entry c (p_y - 1) with p_y < 1/14 is stored as -c, as if p_y were 0
            "p_y_below_1_14": float((py < 1 / 14).to(D).mean()),
            "max_p_nonlabel_mean": float(p.scatter(1, y[:, None], 0.0).amax(1).mean())}


def mid_schemes(cap: dict) -> dict:
    """F (E5M2 output gradient, E4M3 input and weight, per tensor) and F-bf16 for every block's w2."""
    out = {}
    for name, (xin, W, g) in cap["mids"].items():
        ref = Reference(g, W, xin)
        g8 = dq(g.float(), "e5m2")
        W8 = dq(W.to(torch.bfloat16), "e4m3")
        x8 = dq(xin.to(torch.bfloat16), "e4m3")
        out[name] = {"F": ref.metrics(g8 @ W8, g8.t() @ x8, g8), "F|g": ref.metrics(g8 @ W, g8.t() @ xin, g8),
                     "F-bf16": ref.metrics(bf(g) @ bf(W), bf(g).t() @ bf(xin), bf(g)),
                     "reference": ref.structure()}
    return out


# --- driver ----------------------------------------------------------------------------------------------------
def snapshot_dirs(ckpt_dir: str, iterations: list[int] | None) -> list[tuple[int, str]]:
    found = []
    for d in glob.glob(os.path.join(ckpt_dir, "iter_*")):
        m = re.fullmatch(r"iter_(\d+)", os.path.basename(d))
        if m and (iterations is None or int(m.group(1)) in iterations):
            found.append((int(m.group(1)), d))
    return sorted(found)


def measure_snapshot(label: str, cfg: ModelConfig, state, tokens, labels, seed: int, with_library: bool) -> dict:
    t0 = time.time()
    cap = capture(cfg, state, tokens, labels, seed)
    out = {"snapshot": label, "loss_fp32_model": cap["loss_fp32"], "head": head_schemes(cap, with_library),
           "mid": mid_schemes(cap)}
    out["seconds"] = round(time.time() - t0, 1)
    return out


COLS = [("dx_rel_err", "dx err"), ("dx_err_along_wbar_rel", "dx∥w̄"), ("dx_err_frac_along_wbar", "frac∥w̄"),
        ("dx_rowsum_term_rel", "dx rs"), ("dx_gain", "dx gain"), ("dh_rel_err", "dh err"), ("dW_rel_err", "dW err"),
        ("dW_gain", "dW gain"), ("dW_err_frac_common_row", "dW comm"), ("rowsum_err", "rowsum"),
        ("rowsum_bias", "rs bias"), ("g_rel_err", "g err")]


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and 0.999 < v <= 1.0:
        return f"{v:.6f}"
    return f"{v:.2e}" if isinstance(v, float) and (abs(v) < 1e-3 or abs(v) >= 1e3) and v != 0 else f"{v:.4f}"


def print_snapshot(s: dict) -> None:
    b, r = s["head"]["batch"], s["head"]["reference"]
    print(f"\n== {s['snapshot']}: batch {b['tokens']} tokens, loss {b['loss']:.3f}, mean p_y {b['p_y_mean']:.3f}, "
          f"|w̄|/rms|W_j| {r['wbar_norm_over_rms_row']:.3f}, |x̄|/rms|x_i| {r['xbar_norm_over_rms_row']:.3f}, "
          f"dx energy ∥w̄ {r['dx_energy_frac_along_wbar']:.4f} (random {r['random_direction_frac']:.4f})")
    print(f"{'scheme':28s}" + "".join(f"{h:>10s}" for _, h in COLS) + "   dW err freq/rare/unlab")
    rows = list(s["head"]["schemes"].items())
    for name, m in s["mid"].items():
        short = name.replace("layers.", "L").replace(".feed_forward.w2", ".w2")
        rows += [(f"{k} {short}", v) for k, v in m.items() if k != "reference"]
    for name, m in rows:
        grp = m.get("dW_rel_err_by_rows")
        tail = "   " + "/".join(_fmt(v) for v in grp.values()) if grp else ""
        print(f"{name:28s}" + "".join(f"{_fmt(m.get(k)):>10s}" for k, _ in COLS) + tail)
    bins = [k for k in r if k.startswith("tokens ")]
    print(f"dx error by the label's probability ({', '.join(f'{k[7:]}: {r[k]}' for k in bins)} tokens); "
          f"label term / dx {r.get('label_term_over_dx', float('nan')):.2f}")
    for name, m in s["head"]["schemes"].items():
        if "dx_rel_err_by_p_y" in m and not name.endswith("bf16z"):
            print(f"  {name:26s}" + "".join(f"{_fmt(v):>10s}" for v in m["dx_rel_err_by_p_y"].values()))


def print_accumulation(a: dict) -> None:
    ks = list(a["by_k"])
    print(f"\n== accumulated wgrad over K micro-batches of {a['samples_per_micro_batch']} sequences "
          "(relative error of the sum; gain at the largest K)")
    print(f"{'':24s}" + "".join(f"{'K=' + str(k):>10s}" for k in ks) + f"{'gain':>10s}")
    for name in a["by_k"][ks[-1]]:
        vals = [a["by_k"][k][name]["dW_rel_err"] for k in ks]
        gain = a["by_k"][ks[-1]][name]["dW_gain"]
        print(f"{name:24s}" + "".join(f"{_fmt(v):>10s}" for v in vals) + f"{_fmt(gain):>10s}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/headgrad", help="corpus cache, checkpoints and training log")
    p.add_argument("--checkpoint-dir", help="an existing --save folder of this model (skips training)")
    p.add_argument("--data-prefix", help="with --checkpoint-dir: its token shard prefix (default: the work's corpus)")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--train-iters", type=int, default=900)
    p.add_argument("--save-interval", type=int, default=150)
    p.add_argument("--iterations", type=int, nargs="*", help="snapshots to measure (default: all saved)")
    p.add_argument("--samples", type=int, default=16, help="held-out sequences in the batch")
    p.add_argument("--accumulate", type=int, default=8,
                   help="micro-batches (of --samples) for the accumulated-wgrad test on the last snapshot (<2: skip)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--no-library", action="store_true", help="skip the library's own fp8_head_loss rows")
    p.add_argument("--train-only", action="store_true", help="train (or find) the checkpoints and stop")
    p.add_argument("--tiny", action="store_true", help="a random tiny model and random tokens (the test)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks/results/head_grad_error.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
           "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": "cpu"}
    result = {"kind": "head_grad_error", "environment": env, "settings": vars(args), "snapshots": []}
    t0 = time.time()
    if args.tiny:
        cfg = ModelConfig(**TINY)
        g = torch.Generator().manual_seed(args.seed)
        tokens = torch.randint(0, cfg.vocab_size, (4, cfg.seq_length + 1), generator=g)
        tokens, labels = tokens[:, :-1], tokens[:, 1:]
        result["model"] = TINY
        result["snapshots"].append(measure_snapshot("init (tiny, random tokens)", cfg, None, tokens, labels,
                                                    args.seed, not args.no_library))
        if args.accumulate > 1:
            result["accumulation"] = accumulation(cfg, None, tokens, labels, 4 // min(args.accumulate, 4), args.seed)
    else:
        hf = load_tool('convert_to_hf')
        if args.checkpoint_dir:
            ckpt, data_prefix = args.checkpoint_dir, args.data_prefix
            result["training"] = {"checkpoint_dir": ckpt, "reused": True}
        else:
            result["training"] = train(args.work, args.vocab_size, args.train_iters, args.save_interval, args.seed)
            ckpt, data_prefix = result["training"]["checkpoint_dir"], result["training"]["data_prefix"]
            if args.train_only:
                return 0
        snaps = snapshot_dirs(ckpt, args.iterations)
        if not snaps:
            raise SystemExit(f"error: no iter_* checkpoints in {ckpt}")
        cfg, _, meta = hf.load_megacoat_checkpoint(snaps[-1][1])
        if data_prefix is None:
            raise SystemExit("error: --checkpoint-dir needs --data-prefix")
        k = max(args.accumulate, 1)
        all_tokens, all_labels = held_out_batch(data_prefix, cfg.seq_length, args.samples * k)
        tokens, labels = all_tokens[:args.samples], all_labels[:args.samples]
        result["model"] = {k: getattr(cfg, k) for k in ("num_layers", "hidden_size", "ffn_hidden_size",
                                                        "num_attention_heads", "seq_length", "vocab_size",
                                                        "tie_embeddings")}
        result["batch"] = {"samples": args.samples, "source": "held-out range of --split 969,30,1, file order"}
        log = train_log(args.work) if not args.checkpoint_dir else []
        result["train_log_tail"] = [r for r in log if "val_loss" in r][-3:] + log[-1:]
        todo = [("init (GPT(cfg), seed %d)" % args.seed, None)]
        todo += [(f"iter {it}", d) for it, d in snaps]
        for label, d in todo:
            state = hf.load_megacoat_checkpoint(d)[1] if d else None
            s = measure_snapshot(label, cfg, state, tokens, labels, args.seed, not args.no_library)
            result["snapshots"].append(s)
            print_snapshot(s)
            sys.stdout.flush()
        if args.accumulate > 1:
            a = accumulation(cfg, state, all_tokens, all_labels, args.samples, args.seed)
            result["accumulation"] = dict(a, snapshot=todo[-1][0])
    if args.tiny:
        print_snapshot(result["snapshots"][0])
    if "accumulation" in result:
        print_accumulation(result["accumulation"])
    result["seconds"] = round(time.time() - t0, 1)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {args.out} ({result['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
