"""Plain-torch reference of the fused CoatAdamW step: the contract the CUDA kernel is tested against.

Each moment of a parameter with n elements is stored flat: `q` (n FP8 values), `scale` (ceil(n/G) float32:
max(amax, AMAX_FLOOR) / F.max) and `k` (ceil(n/G) bfloat16 expansion exponents), over groups of G consecutive
elements of the flattened tensor (the last one may be shorter).

Dynamic range expansion (COAT), per group:
  amax = max|x|, amin = min|x| over the group's non-zero entries;
  k = log2(R_F) / log2(amax / amin), R_F = F.max / F.min_subnormal, clamped to [K_MIN, K_MAX], rounded to bf16
  once; the stored k serves both directions. k = 1 (no expansion) for an all-zero group, one with a single
  magnitude, a non-finite one, or one whose amax is below AMAX_FLOOR (megacoat.ops.numerics: the one floor and
  sub-normal rule of every FP8 quantizer in megacoat);
  quantize:   q = fp8(sign(x) * F.max * exp2(k * log2(|x| * (1 / max(amax, AMAX_FLOOR)))))
  dequantize: x = sign(q) * (F.max * scale) * exp2(log2(|q| * fp32(1/F.max)) * (1/k))
This is COAT's f(x) = sign(x)|x|^k scaled by max|f| / F.max, written so nothing overflows for large k.
Rounding f to a normal FP8 value has relative error <= u = F.eps / 2 and x = f^(1/k), so the moment's relative
error is <= (1+u)^(1/k) - 1 (~u / k) plus a few float32 ulps; an f in FP8's sub-normal range has absolute error
<= F.min_subnormal / 2 in f-space.
Float32 sub-normals of |x| / amax and (|q| / F.max)^(1/k) flush to zero, as the kernel's ex2/lg2 (.ftz) do.

Kernel and reference share one signature: lists of tensors (one launch for all of them in the kernel), updated in
place. With `remainders` (one int16 tensor per bf16 parameter) the parameter and its remainder together are the
fp32 master weight (`megacoat.ops.param_remainder`): the step reads that fp32 value exactly, updates it with the same
float32 operations as an fp32 parameter, and writes both halves back, so the master is bit for bit the fp32 run's.
"""
from __future__ import annotations

import math

import torch

from megacoat.ops.coat_adamw_tables import check_lists
from megacoat.ops.numerics import AMAX_FLOOR, K_MAX, K_MIN, fp8_max, log2_dynamic_range, num_groups
from megacoat.ops.param_remainder import join_fp32, split_fp32

_SLICE = 1 << 20  # elements per slice of the reference step (a multiple of every group size)


def _grouped(x: torch.Tensor, group_size: int, fill: float = 0.0) -> torch.Tensor:
    """Flat x padded with `fill` to whole groups, viewed as [groups, G]."""
    n = x.numel()
    ng = num_groups(n, group_size)
    out = x.new_full((ng * group_size,), fill)
    out[:n] = x.reshape(-1)
    return out.view(ng, group_size)


def dequantize_moment_ref(q: torch.Tensor, scale: torch.Tensor, k: torch.Tensor, group_size: int) -> torch.Tensor:
    """x = sign(q) * (F.max * scale) * (|q| / F.max)^(1/k), in fp32, flat, length q.numel().

    The float32 operations and their order are the CUDA kernel's (|q| * fp32(1/F.max), 1/k once per group, IEEE
    tensor/tensor divisions).
    """
    fmax = fp8_max(q.dtype)
    qf = _grouped(q.reshape(-1).float(), group_size)
    kf = k.float()[:, None]
    inv_k = torch.ones_like(kf) / kf
    mult = scale.float()[:, None] * fmax
    rq = qf.abs() * (1.0 / fmax)
    # k == 1 is plain per-group quantization: skip exp2/log2 so that path is exact.
    e = torch.where(kf == 1.0, rq, torch.exp2(torch.log2(rq) * inv_k))
    e = torch.where(e < AMAX_FLOOR, torch.zeros_like(e), e)  # flushed, as the kernel's ex2.approx.ftz
    x = e * mult
    x = torch.where(qf < 0, -x, x)
    return x.reshape(-1)[: q.numel()]


def quantize_moment_ref(x: torch.Tensor, fp8_dtype: torch.dtype, group_size: int, expand: bool):
    """Flat fp32 x -> (q FP8, scale fp32, k bf16, number of non-finite groups), by the contract above."""
    fmax = fp8_max(fp8_dtype)
    xg = _grouped(x.reshape(-1).float(), group_size)
    a = torch.where(torch.isnan(xg), torch.full_like(xg, math.inf), xg.abs())  # NaN counts as non-finite
    amax = a.amax(dim=1)
    finite = torch.isfinite(amax)
    amax_s = amax.clamp(min=AMAX_FLOOR)  # the one floor: 1 / amax_s <= 2^126
    amin = torch.where(a > 0, a, torch.full_like(a, math.inf)).amin(dim=1)
    if expand:
        k = torch.full_like(amax, log2_dynamic_range(fp8_dtype)) / torch.log2(amax / amin)
        k = k.clamp(K_MIN, K_MAX)  # a ratio overflowing to inf gives k = 0 -> K_MIN
        spread = finite & (amax > amin) & (amax >= AMAX_FLOOR)  # false: all-zero, one magnitude, tiny, non-finite
        k = torch.where(spread, k, torch.ones_like(k))
    else:
        k = torch.ones_like(amax)
    k_bf16 = k.to(torch.bfloat16)
    kf = k_bf16.float()[:, None]
    inv_amax = torch.where(finite, torch.ones_like(amax) / amax_s, torch.zeros_like(amax))
    r = a * inv_amax[:, None]
    r = torch.where(r < AMAX_FLOOR, torch.zeros_like(r), r)  # flushed, as the kernel's lg2.approx.ftz
    f = torch.where(kf == 1.0, r, torch.exp2(kf * torch.log2(r)))  # r = 0: log2 = -inf, exp2 -> 0
    mag = (f * fmax).clamp(max=fmax)
    q = torch.where(xg < 0, -mag, mag)
    q = torch.where(finite[:, None], q, torch.zeros_like(q)).to(fp8_dtype)
    # A non-finite group keeps a NaN scale so it dequantizes to NaN: visible, never silently repaired.
    scale = torch.where(finite, amax_s / torch.full_like(amax, fmax), torch.full_like(amax, math.nan))
    nonfinite = int((~finite).sum())
    return q.reshape(-1)[: x.numel()], scale, k_bf16, nonfinite


def adam_scalars(lr: float, beta1: float, beta2: float, step: int) -> tuple[float, float]:
    """Bias corrections folded into two scalars (computed once in float64): step size and sqrt(1 - beta2^t)."""
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    return lr / (1.0 - beta1 ** step), math.sqrt(1.0 - beta2 ** step)


def coat_adamw_step_ref(params, grads, m_q, m_scale, m_k, v_q, v_scale, v_k, *, lr: float, beta1: float,
                        beta2: float, eps: float, weight_decay: float, step: int, group_size: int, expand: bool,
                        nonfinite: torch.Tensor | None = None, remainders=None,
                        skip: torch.Tensor | None = None, grad_scale: torch.Tensor | None = None) -> None:
    """One AdamW step (decoupled weight decay, bias correction, torch.optim.AdamW's formula) with FP8 moments.

    Per parameter: dequantize m and v, update them and the parameter in fp32, re-quantize. In place.
    `nonfinite` (int32 [1]), if given, is incremented by the number of non-finite moment groups (m and v counted
    separately); those groups are stored with a NaN scale. `remainders`: see the module docstring.
    `skip` (float32 [1] or [], on the parameters' device), if given and non-zero, refuses the whole step: nothing is
    written (fused AdamW's `found_inf`; the kernel reads it on the device, this reference on the host).
    `grad_scale` (float32, one element, on the parameters' device), if given, divides every gradient (fused AdamW's
    argument of that name): the gradient is multiplied by the reciprocal 1 / grad_scale and rounded to its own
    dtype, exactly what DeepSpeed's in-place clip `grad.mul_(1.0 / grad_scale)` would leave in it; the gradients
    themselves are not written.
    """
    if not params or (skip is not None and bool(skip.reshape(-1)[0] != 0)):
        return
    check_lists(params, grads, m_q, m_scale, m_k, v_q, v_scale, v_k, group_size, remainders)
    step_size, bc2_sqrt = adam_scalars(lr, beta1, beta2, step)
    inv_grad_scale = None if grad_scale is None else 1.0 / grad_scale.reshape(())
    gs = group_size
    bad = 0
    for i, p in enumerate(params):
        n = p.numel()
        flat = [t.view(-1) for t in (p, grads[i], m_q[i], v_q[i])]
        # Slices of whole groups bound the fp32 temporaries: no full-precision m or v of a whole tensor.
        for s in range(0, n, _SLICE):
            e = min(s + _SLICE, n)
            gsl = slice(s // gs, num_groups(e, gs))
            pv, gv, mqv, vqv = (t[s:e] for t in flat)
            rv = None if remainders is None else remainders[i].view(-1)[s:e]
            moments = ((mqv, m_scale[i][gsl], m_k[i][gsl]), (vqv, v_scale[i][gsl], v_k[i][gsl]))
            m, v = (dequantize_moment_ref(q, sc, k, gs) for q, sc, k in moments)
            g = gv.float() if inv_grad_scale is None else (gv * inv_grad_scale).float()
            m = beta1 * m + (1.0 - beta1) * g
            v = beta2 * v + (1.0 - beta2) * (g * g)
            denom = torch.sqrt(v) / bc2_sqrt + eps
            master = pv.float() if rv is None else join_fp32(pv, rv)
            master = master * (1.0 - lr * weight_decay) - step_size * (m / denom)
            if rv is None:
                pv.copy_(master)
            else:
                hi, lo = split_fp32(master)
                pv.copy_(hi)
                rv.copy_(lo)
            for x, (q, sc, k) in zip((m, v), moments):
                nq, ns, nk, nbad = quantize_moment_ref(x, q.dtype, gs, expand)
                q.copy_(nq)
                sc.copy_(ns)
                k.copy_(nk)
                bad += nbad
    if nonfinite is not None and bad:
        nonfinite += bad
