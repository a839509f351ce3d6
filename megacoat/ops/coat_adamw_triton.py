"""Triton kernel of the fused CoatAdamW step: one launch for a whole list of parameters.

Each program takes one chunk (a few groups of G elements) of one tensor, found through the chunk table; the tensors'
addresses come from the pointer table (see `megacoat.ops.coat_adamw_tables`). Same formulas and signature as
`coat_adamw_step_ref`.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from megacoat.fp8.formats import get_format
from megacoat.ops import expand_math
from megacoat.ops.coat_adamw_ref import K_MAX, K_MIN, adam_scalars
from megacoat.ops.coat_adamw_tables import build_tables, check_lists

_TL_DTYPES = {
    torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
    torch.float8_e4m3fn: tl.float8e4nv, torch.float8_e5m2: tl.float8e5,
}


@triton.jit
def _round_to_bf16(x):
    """Round-to-nearest-even fp32 -> bf16 by bit arithmetic (the interpreter's cast truncates); x finite."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def _round_to_fp8_grid(v, MBITS: tl.constexpr, MIN_NORMAL, SUB_MAGIC):
    """Round finite fp32 |v| <= F.max to the nearest FP8 value (ties to even) in fp32 arithmetic, so the cast that
    follows is exact whatever its own rounding (the interpreter's FP8 cast truncates and loses mantissa carries)."""
    drop: tl.constexpr = 23 - MBITS
    bits = v.to(tl.uint32, bitcast=True)
    bits = ((bits + ((1 << (drop - 1)) - 1) + ((bits >> drop) & 1)) >> drop) << drop
    normal = bits.to(tl.float32, bitcast=True)
    # Below the smallest normal the grid is uniform (min_subnormal): adding and removing 1.5 * 2^23 * min_subnormal
    # rounds to it, ties to even.
    sub = (v + SUB_MAGIC) - SUB_MAGIC
    return tl.where(tl.abs(v) < MIN_NORMAL, sub, normal)


@triton.jit
def _fast_log2(x, HW: tl.constexpr):
    """log2 per element: the hardware's lg2.approx.ftz (one MUFU op, ~2 ulp, as the CUDA kernel) where tl.log2
    compiles to a ~20-instruction polynomial; tl.log2 under the interpreter, which runs no PTX."""
    if HW:
        return expand_math.approx_log2(x)
    else:
        return tl.log2(x)


@triton.jit
def _fast_exp2(x, HW: tl.constexpr):
    """exp2 per element: ex2.approx.ftz (one MUFU op, no subnormal fix-up around it), tl.exp2 in the interpreter."""
    if HW:
        return expand_math.approx_exp2(x)
    else:
        return tl.exp2(x)


@triton.jit
def _copysign(mag, x):
    """|mag| with x's sign bit: one bit operation where a compare and a select are two."""
    bits = mag.to(tl.uint32, bitcast=True) | (x.to(tl.uint32, bitcast=True) & 0x80000000)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _dequantize(q, scale, k, beta, FMAX, INV_FMAX, HW: tl.constexpr):
    """beta * the moment; scale and k are [groups, 1]. Not HW: the float32 operations of dequantize_moment_ref in its
    order, then the multiply by beta of the Adam update. HW: as the CUDA kernel v4, scale * F.max * beta moves into
    the exponent (one FMA per element: log2(rq) / k + log2(scale * F.max * beta), rounded once) and the sign is
    copied; the result differs by ~|log2 of the moment| * 2^-24 relatively."""
    inv_k = tl.div_rn(tl.full(k.shape, 1.0, tl.float32), k)
    rq = tl.abs(q) * INV_FMAX
    if HW:
        mult = scale * FMAX * beta
        x = tl.where(k == 1.0, rq * mult, _fast_exp2(tl.fma(_fast_log2(rq, HW), inv_k, tl.log2(mult)), HW))
        return _copysign(x, q)
    else:
        e = tl.where(k == 1.0, rq, _fast_exp2(_fast_log2(rq, HW) * inv_k, HW))
        x = e * (scale * FMAX)
        return beta * tl.where(q < 0, -x, x)


@triton.jit
def _quantize(x, FMAX, LOG2_FMAX, LOG2_RANGE, MIN_NORMAL, SUB_MAGIC, MBITS: tl.constexpr, EXPAND: tl.constexpr,
              K_LO: tl.constexpr, K_HI: tl.constexpr, HW: tl.constexpr):
    """x [groups, G] fp32 (padding = 0) -> q (fp32, rounded to the FP8 grid unless HW: the GPU's cast rounds to
    nearest even itself), scale, k (bf16), bad (per group). k keeps the accurate tl.log2: once per group."""
    a = tl.where(x != x, float("inf"), tl.abs(x))  # NaN counts as non-finite
    amax = tl.max(a, axis=1)
    amax = tl.where(amax < 1.1754943508222875e-38, 0.0, amax)  # below 2^-126: a zero group (the reference's rule)
    finite = amax < float("inf")
    amin = tl.min(tl.where(a > 0, a, float("inf")), axis=1)
    one = tl.full(amax.shape, 1.0, tl.float32)
    if EXPAND:
        k = tl.div_rn(tl.full(amax.shape, LOG2_RANGE, tl.float32), tl.log2(tl.div_rn(amax, amin)))
        k = tl.minimum(tl.maximum(k, K_LO), K_HI)
        k = tl.where(finite & (amax > amin), k, 1.0)
    else:
        k = one
    k_bf16 = _round_to_bf16(k)
    kf = k_bf16.to(tl.float32)[:, None]
    inv_amax = tl.where(finite & (amax > 0), tl.div_rn(one, amax), 0.0)
    r = a * inv_amax[:, None]
    if HW:  # F.max in the exponent (one FMA), the clamp to F.max left to the saturating cast, the sign copied
        mag = tl.where(kf == 1.0, r * FMAX, _fast_exp2(tl.fma(kf, _fast_log2(r, HW), LOG2_FMAX), HW))
        q = tl.where(finite[:, None], _copysign(mag, x), 0.0)
    else:
        f = tl.where(kf == 1.0, r, _fast_exp2(kf * _fast_log2(r, HW), HW))
        mag = tl.minimum(f * FMAX, FMAX)
        q = tl.where(x < 0, -mag, mag)
        q = _round_to_fp8_grid(tl.where(finite[:, None], q, 0.0), MBITS, MIN_NORMAL, SUB_MAGIC)
    scale = tl.where(finite, tl.div_rn(amax, tl.full(amax.shape, FMAX, tl.float32)), float("nan"))
    bad = tl.where(finite, 0, 1)
    return q, scale, k_bf16, bad


@triton.jit
def _st(ptrs, values, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptrs, values, mask=mask)
    else:
        tl.store(ptrs, values)


@triton.jit
def _chunk_step(p_ptr, g_ptr, mq_ptr, ms_ptr, mk_ptr, vq_ptr, vs_ptr, vk_ptr, n, c, nonfinite_ptr, lr_wd, step_size,
                beta1, beta2, inv_bc2_sqrt, eps, M_MAX, V_MAX, INV_M_MAX, INV_V_MAX, LOG2_M_MAX, LOG2_V_MAX,
                LOG2_RANGE_M, LOG2_RANGE_V, M_MIN_NORMAL, V_MIN_NORMAL, M_SUB_MAGIC, V_SUB_MAGIC,
                M_MBITS: tl.constexpr, V_MBITS: tl.constexpr,
                P_DT: tl.constexpr, M_DT: tl.constexpr, V_DT: tl.constexpr, G: tl.constexpr, GPC: tl.constexpr,
                EXPAND: tl.constexpr, COUNT: tl.constexpr, K_LO: tl.constexpr, K_HI: tl.constexpr,
                MASKED: tl.constexpr, HW: tl.constexpr):
    """One chunk of GPC groups. MASKED=False (every chunk but a tensor's last) leaves the loads unmasked so they
    compile to 16-byte vectors."""
    grp = c * GPC + tl.arange(0, GPC)
    offs = grp[:, None] * G + tl.arange(0, G)[None, :]
    mask = offs < n
    gmask = grp * G < n
    if MASKED:
        p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        mq = tl.load(mq_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        vq = tl.load(vq_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        ms = tl.load(ms_ptr + grp, mask=gmask, other=0.0)
        vs = tl.load(vs_ptr + grp, mask=gmask, other=0.0)
        mk = tl.load(mk_ptr + grp, mask=gmask, other=1.0).to(tl.float32)
        vk = tl.load(vk_ptr + grp, mask=gmask, other=1.0).to(tl.float32)
    else:
        p = tl.load(p_ptr + offs).to(tl.float32)
        g = tl.load(g_ptr + offs).to(tl.float32)
        mq = tl.load(mq_ptr + offs).to(tl.float32)
        vq = tl.load(vq_ptr + offs).to(tl.float32)
        ms = tl.load(ms_ptr + grp)
        vs = tl.load(vs_ptr + grp)
        mk = tl.load(mk_ptr + grp).to(tl.float32)
        vk = tl.load(vk_ptr + grp).to(tl.float32)

    m = _dequantize(mq, ms[:, None], mk[:, None], beta1, M_MAX, INV_M_MAX, HW) + (1.0 - beta1) * g
    v = _dequantize(vq, vs[:, None], vk[:, None], beta2, V_MAX, INV_V_MAX, HW) + (1.0 - beta2) * (g * g)
    denom = tl.sqrt(v) * inv_bc2_sqrt + eps  # a multiply, where "/ bc2_sqrt" is a division per element
    p = p * (1.0 - lr_wd) - step_size * (m / denom)
    _st(p_ptr + offs, p.to(P_DT), mask, MASKED)

    q, s, k, bad_m = _quantize(m, M_MAX, LOG2_M_MAX, LOG2_RANGE_M, M_MIN_NORMAL, M_SUB_MAGIC, M_MBITS, EXPAND, K_LO,
                               K_HI, HW)
    _st(mq_ptr + offs, q.to(M_DT), mask, MASKED)
    _st(ms_ptr + grp, s, gmask, MASKED)
    _st(mk_ptr + grp, k, gmask, MASKED)
    q, s, k, bad_v = _quantize(v, V_MAX, LOG2_V_MAX, LOG2_RANGE_V, V_MIN_NORMAL, V_SUB_MAGIC, V_MBITS, EXPAND, K_LO,
                               K_HI, HW)
    _st(vq_ptr + offs, q.to(V_DT), mask, MASKED)
    _st(vs_ptr + grp, s, gmask, MASKED)
    _st(vk_ptr + grp, k, gmask, MASKED)
    if COUNT:
        bad = bad_m + bad_v
        if MASKED:
            bad = tl.where(gmask, bad, 0)
        nbad = tl.sum(bad)
        if nbad > 0:
            tl.atomic_add(nonfinite_ptr, nbad)


@triton.jit
def _coat_adamw_kernel(ptr_table, chunk_table, nonfinite_ptr, lr_wd, step_size, beta1, beta2, inv_bc2_sqrt, eps,
                       M_MAX, V_MAX, INV_M_MAX, INV_V_MAX, LOG2_M_MAX, LOG2_V_MAX, LOG2_RANGE_M, LOG2_RANGE_V,
                       M_MIN_NORMAL, V_MIN_NORMAL, M_SUB_MAGIC, V_SUB_MAGIC, M_MBITS: tl.constexpr,
                       V_MBITS: tl.constexpr,
                       P_DT: tl.constexpr, G_DT: tl.constexpr, M_DT: tl.constexpr, V_DT: tl.constexpr,
                       G: tl.constexpr, GPC: tl.constexpr, EXPAND: tl.constexpr, COUNT: tl.constexpr,
                       K_LO: tl.constexpr, K_HI: tl.constexpr, ALIGNED: tl.constexpr, HW: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(chunk_table + 2 * pid).to(tl.int64)
    c = tl.load(chunk_table + 2 * pid + 1).to(tl.int64)
    row = ptr_table + 9 * t
    p_ptr = tl.load(row + 0).to(tl.pointer_type(P_DT))
    g_ptr = tl.load(row + 1).to(tl.pointer_type(G_DT))
    mq_ptr = tl.load(row + 2).to(tl.pointer_type(M_DT))
    ms_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
    mk_ptr = tl.load(row + 4).to(tl.pointer_type(tl.bfloat16))
    vq_ptr = tl.load(row + 5).to(tl.pointer_type(V_DT))
    vs_ptr = tl.load(row + 6).to(tl.pointer_type(tl.float32))
    vk_ptr = tl.load(row + 7).to(tl.pointer_type(tl.bfloat16))
    n = tl.load(row + 8)
    if ALIGNED:  # addresses read from a table carry no alignment: promise what the host checked
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        mq_ptr = tl.multiple_of(mq_ptr, 16)
        vq_ptr = tl.multiple_of(vq_ptr, 16)
    if (c + 1) * (GPC * G) <= n:
        _chunk_step(p_ptr, g_ptr, mq_ptr, ms_ptr, mk_ptr, vq_ptr, vs_ptr, vk_ptr, n, c, nonfinite_ptr, lr_wd,
                    step_size, beta1, beta2, inv_bc2_sqrt, eps, M_MAX, V_MAX, INV_M_MAX, INV_V_MAX, LOG2_M_MAX,
                    LOG2_V_MAX, LOG2_RANGE_M, LOG2_RANGE_V, M_MIN_NORMAL, V_MIN_NORMAL, M_SUB_MAGIC, V_SUB_MAGIC,
                    M_MBITS, V_MBITS, P_DT, M_DT, V_DT, G, GPC, EXPAND, COUNT, K_LO, K_HI, False, HW)
    else:
        _chunk_step(p_ptr, g_ptr, mq_ptr, ms_ptr, mk_ptr, vq_ptr, vs_ptr, vk_ptr, n, c, nonfinite_ptr, lr_wd,
                    step_size, beta1, beta2, inv_bc2_sqrt, eps, M_MAX, V_MAX, INV_M_MAX, INV_V_MAX, LOG2_M_MAX,
                    LOG2_V_MAX, LOG2_RANGE_M, LOG2_RANGE_V, M_MIN_NORMAL, V_MIN_NORMAL, M_SUB_MAGIC, V_SUB_MAGIC,
                    M_MBITS, V_MBITS, P_DT, M_DT, V_DT, G, GPC, EXPAND, COUNT, K_LO, K_HI, True, HW)


# Variants, all compiled on demand, so one benchmark run times them side by side (benchmarks/bench_optimizer.py):
# "libm" (default): session 2's kernel (11.96 ms for 1 B parameters on an H200; now "* 1/sqrt(bc2)" where it
#   divided): tl.log2 (a ~20-instruction polynomial) and tl.exp2 per element, FP8 rounding in fp32 bit arithmetic
#   as under the interpreter, 8 warps;
# "hw": the hardware's lg2/ex2 per element (as the CUDA kernel) and the GPU's own round-to-nearest-even FP8 cast:
#   static SASS 509 -> 230 instructions per element (Triton 3.6), 8 warps (16 elements a thread, ~250 registers,
#   one program resident per SM);
# "hw-w16": "hw" with 16 warps (8 elements a thread, ~113 registers, 16 warps per SM, ~19% more instructions).
# The "hw" paths cannot run on the CPU (inline PTX): "hw" becomes the default once the GPU tests
# (tests/ops/test_coat_adamw.py, gpu) pass for it and the benchmark shows it faster.
TRITON_VARIANTS = ("libm", "hw", "hw-w16")
DEFAULT_TRITON_VARIANT = "libm"
TRITON_VARIANT_ENV = "MEGACOAT_COAT_ADAMW_TRITON_VARIANT"


def triton_variant(name: str | None = None) -> tuple[int, bool]:
    """(num_warps, hardware transcendentals) of `name`, else $MEGACOAT_COAT_ADAMW_TRITON_VARIANT, else the default."""
    name = name or os.environ.get(TRITON_VARIANT_ENV) or DEFAULT_TRITON_VARIANT
    if name not in TRITON_VARIANTS:
        raise ValueError(f"CoatAdamW Triton kernel variant must be one of {TRITON_VARIANTS}, got {name!r}")
    return (16 if name.endswith("w16") else 8), name.startswith("hw")


def _interpreted() -> bool:
    """TRITON_INTERPRET=1: the kernel runs in numpy (CPU tests), where inline PTX cannot."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def coat_adamw_step_triton(params, grads, m_q, m_scale, m_k, v_q, v_scale, v_k, *, lr: float, beta1: float,
                           beta2: float, eps: float, weight_decay: float, step: int, group_size: int, expand: bool,
                           nonfinite: torch.Tensor | None = None, variant: str | None = None) -> None:
    """Same contract as `coat_adamw_step_ref`; all tensors must share one dtype per role and one device.
    `variant`: one of TRITON_VARIANTS (default: `triton_variant()`)."""
    warps, hw = triton_variant(variant)
    if not params:
        return
    check_lists(params, grads, m_q, m_scale, m_k, v_q, v_scale, v_k, group_size)
    ptr_table, chunk_table, groups_per_chunk = build_tables(params, grads, m_q, m_scale, m_k, v_q, v_scale, v_k,
                                                            group_size)
    step_size, bc2_sqrt = adam_scalars(lr, beta1, beta2, step)
    fm, fv = get_format(m_q[0].dtype), get_format(v_q[0].dtype)
    count = nonfinite is not None
    nb = nonfinite if count else ptr_table  # any pointer; unused when COUNT is False
    n_chunks = chunk_table.shape[0]
    aligned = all(t.data_ptr() % 16 == 0 for ts in (params, grads, m_q, v_q) for t in ts)
    _coat_adamw_kernel[(n_chunks,)](
        ptr_table, chunk_table, nb, lr * weight_decay, step_size, beta1, beta2, 1.0 / bc2_sqrt, eps,
        fm.max, fv.max, 1.0 / fm.max, 1.0 / fv.max, math.log2(fm.max), math.log2(fv.max),
        math.log2(fm.dynamic_range), math.log2(fv.dynamic_range),
        fm.smallest_normal, fv.smallest_normal, 1.5 * 2 ** 23 * fm.min_subnormal, 1.5 * 2 ** 23 * fv.min_subnormal,
        M_MBITS=fm.mantissa_bits, V_MBITS=fv.mantissa_bits,
        P_DT=_TL_DTYPES[params[0].dtype], G_DT=_TL_DTYPES[grads[0].dtype], M_DT=_TL_DTYPES[m_q[0].dtype],
        V_DT=_TL_DTYPES[v_q[0].dtype], G=group_size, GPC=groups_per_chunk, EXPAND=bool(expand), COUNT=count,
        K_LO=K_MIN, K_HI=K_MAX, ALIGNED=aligned, HW=hw and not _interpreted(), num_warps=warps)
