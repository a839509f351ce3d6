"""FP8 cast with a per-tensor scale that writes the row-major copy and its transpose in one pass.

torch._scaled_mm multiplies a row-major A by a column-major B, so a linear layer needs each FP8 operand in
two layouts: x for the forward GEMM and x^T for the weight gradient, g for dgrad and g^T for wgrad. Writing
both from one read of the high-precision tensor costs one extra byte per element instead of a second pass.

`scale` is the dequantization scale: value = stored * scale, scale = max(amax, AMAX_FLOOR) / fmax and
stored = fp8(clamp(x * (1 / scale), +-fmax)), the reciprocal taken once per tensor (float32, IEEE) so kernel and
reference do the same float32 operations (megacoat.ops.numerics: the floor, and the power-of-two rescaling that
keeps the reciprocal finite for a scale from the floor, e.g. an all-zero tensor).

`quantize_transpose(x)` is the hot path of every FP8 linear: two launches and no host sync -- one reduction
for amax (torch.linalg.vector_norm(inf): |x| and max in one kernel, NaN propagates) and one cast kernel that
turns the amax into the scale itself and writes it for _scaled_mm. (A composite of torch ops (aminmax, abs,
maximum, clamp, div) costs eight launches per operand.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megacoat.ops.numerics import (AMAX_FLOOR, cast_with_scale, dispatch, fp8_operator, launcher, pick,
                                   scale_from_amax, traced_body)
from megacoat.ops.tensor_scale import (amax_workspace, cast_scale, delayed_scale, history_scale, record_amax,
                                       record_program_amax, roll_history, scaled_codes)


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """max|x| as a 1-element tensor in x's dtype (exact: the max of stored values), one reduction kernel."""
    if x.numel() == 0:
        raise ValueError("FP8 per-tensor quantization of an empty tensor: it has no amax")
    return torch.linalg.vector_norm(x.detach(), float("inf")).reshape(1)


def amax_scale(x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Per-tensor dequantization scale of x for out_dtype as a 1-element fp32 tensor (no host sync)."""
    return scale_from_amax(tensor_amax(x), out_dtype).reshape(1)


def _check2d(x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"cast_transpose expects a 2-D tensor, got shape {tuple(x.shape)}")


def cast_transpose_ref(x: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
                       rowwise: bool = True, transpose: bool = True):
    """Reference: fp8(clamp(x * (1 / scale))); returns (q or None, q^T contiguous or None)."""
    _check2d(x)
    q = cast_with_scale(x, scale, out_dtype)
    return (q if rowwise else None), (q.t().contiguous() if transpose else None)


@triton.jit
def _cast_transpose_kernel(x_ptr, amax_ptr, scale_ptr, out_ptr, outt_ptr, hist_ptr, M, N, ldt, fmax, amax_floor,
                           hist_len, FROM_AMAX: tl.constexpr, ROWWISE: tl.constexpr, TRANSPOSE: tl.constexpr,
                           HIST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    # out is [M, N] row-major; outt [N, M] with row stride ldt (M, or more when it is a column block of a wider
    # transpose: refresh writes each part of a joined weight straight into its place). HIST > 0 (delayed scaling):
    # the scale from the amax history's maximum, written by the first program, and max|x| folded into amax_ptr.
    # A 1-D grid, column tiles fastest: the programs in flight read whole rows of a few row blocks.
    tiles_n = tl.cdiv(N, BN)
    pid_m, pid_n = tl.program_id(0) // tiles_n, tl.program_id(0) % tiles_n
    if HIST > 0:
        scale = history_scale(scale_ptr, hist_ptr, hist_len, fmax, amax_floor, HIST)
    else:
        scale = cast_scale(scale_ptr, amax_ptr, fmax, amax_floor, FROM_AMAX)
    rm = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    x = tl.load(x_ptr + rm[:, None] * N + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    if HIST > 0:  # masked lanes are 0, and |x| >= 0
        record_program_amax(tl.max(tl.max(tl.abs(x), axis=1), axis=0), amax_ptr)
    q = scaled_codes(x, scale, fmax)  # the reciprocal once per program, the element loop multiplies
    if ROWWISE:
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], q.to(out_ptr.dtype.element_ty), mask=mask)
    if TRANSPOSE:
        tl.store(outt_ptr + rn[:, None] * ldt + rm[None, :], tl.trans(q).to(outt_ptr.dtype.element_ty),
                 mask=tl.trans(mask))


_BM, _BN, _WARPS = 64, 64, 4  # the cast's tile


def _launch(x, amax, scale, out_dtype, rowwise, transpose, out=None, outt=None, history=None):
    """Cast x into out [M, N] and/or outt [N, M] (allocated when not given; a given outt may be a column block of
    a wider row-major tensor). history (delayed scaling): the scale from its maximum, written to scale, and max|x|
    folded into amax (a zeroed float32 [1])."""
    _check2d(x)
    x = x.contiguous()
    if transpose and x.dtype == torch.float32 and x.is_cuda:
        # Triton 3.6 on sm_90 writes wrong codes (some NaN) into the transposed store of a tile loaded as float32,
        # however the transpose is spelled (tests/ops/test_cast_transpose.py, GPU); the row-major store is exact.
        # float32 activations are the --fp32 and test path, not the bf16 hot path: transpose the FP8 bytes in torch.
        q, _ = _launch(x, amax, scale, out_dtype, True, False, out, history=history)
        if outt is None:
            return (q if rowwise else None), q.t().contiguous()
        outt.copy_(q.t())
        return (q if rowwise else None), outt
    m, n = x.shape
    if rowwise and out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if transpose and outt is None:
        outt = torch.empty((n, m), dtype=out_dtype, device=x.device)
    dummy = out if rowwise else outt
    bm, bn = _BM, _BN
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    hist_len = 0 if history is None else history.numel()
    launcher(_cast_transpose_kernel)[grid](x, amax if amax is not None else scale, scale, out if rowwise else dummy,
                                 outt if transpose else dummy, scale if history is None else history, m, n,
                                 outt.stride(0) if transpose else m, torch.finfo(out_dtype).max, AMAX_FLOOR,
                                 hist_len, FROM_AMAX=amax is not None and history is None, ROWWISE=rowwise,
                                 TRANSPOSE=transpose, HIST=triton.next_power_of_2(hist_len) if hist_len else 0,
                                 BM=bm, BN=bn, num_warps=_WARPS)
    return (out if rowwise else None), (outt if transpose else None)


@triton.jit
def _transpose_bytes_kernel(q_ptr, qt_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr):
    rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    rn = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    q = tl.load(q_ptr + rm[:, None] * N + rn[None, :], mask=mask)
    tl.store(qt_ptr + rn[:, None] * M + rm[None, :], tl.trans(q), mask=tl.trans(mask))


# The byte transpose's own tile: its elements are 1 byte, so the cast's 64 x 64 tile would move 64-byte segments
# each way; 128 x 256 moves 128 and 256.
_TRANSPOSE_BM, _TRANSPOSE_BN, _TRANSPOSE_WARPS = 128, 256, 8
_TILES = {"cast": ("_BM", "_BN", "_WARPS"), "transpose": ("_TRANSPOSE_BM", "_TRANSPOSE_BN", "_TRANSPOSE_WARPS")}


def tiles() -> dict[str, tuple[int, ...]]:
    """Each kernel's launch tile (block sizes, then warps), read at every launch: {"cast": .., "transpose": ..}."""
    return {kernel: tuple(globals()[name] for name in names) for kernel, names in _TILES.items()}


def set_tile(kernel: str, tile: tuple[int, ...]) -> None:
    """Launch `kernel` with another tile from now on (the benchmarks' tile sweeps); tiles() before it gives the
    library's."""
    globals().update(dict(zip(_TILES[kernel], tile, strict=True)))  # all or nothing


def transpose_fp8_ref(q: torch.Tensor) -> torch.Tensor:
    _check2d(q)
    return q.t().contiguous()


def transpose_fp8_triton(q: torch.Tensor) -> torch.Tensor:
    """q^T [N, M] contiguous of an FP8 q [M, N], its bytes moved as they are (uint8: no conversion), with the cast's
    tile: an FP8 operand written row-major by a kernel that cannot transpose (one token per program) gets its
    wgrad layout for 2 bytes per element, against a cast pass's 4 from a BF16 copy."""
    _check2d(q)
    q = q.contiguous()
    m, n = q.shape
    qt = torch.empty((n, m), dtype=q.dtype, device=q.device)
    bm, bn = _TRANSPOSE_BM, _TRANSPOSE_BN
    launcher(_transpose_bytes_kernel)[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        q.view(torch.uint8), qt.view(torch.uint8), m, n, BM=bm, BN=bn, num_warps=_TRANSPOSE_WARPS)
    return qt


def op_layouts(x: torch.Tensor, out_dtype: torch.dtype, q: torch.Tensor | None, qt: torch.Tensor | None):
    """An operator returns tensors: a layout not asked for (None) goes out as an empty tensor of out_dtype."""
    return tuple(x.new_empty(0, dtype=out_dtype) if t is None else t for t in (q, qt))


def asked_layouts(q: torch.Tensor, qt: torch.Tensor, rowwise: bool, transpose: bool):
    """The layouts asked for, the other None (an operator returned it empty)."""
    return (q if rowwise else None), (qt if transpose else None)


def transpose_fp8(q: torch.Tensor) -> torch.Tensor:
    """q^T [N, M] contiguous of an FP8 q [M, N]: the byte transpose on CUDA (also compiled: an operator, so the
    graph runs this kernel rather than a copy of Inductor's), q.t().contiguous() elsewhere."""
    return dispatch(_transpose_fp8_op, q, transpose_fp8_triton, transpose_fp8_ref, q)


@fp8_operator("megacoat::transpose_fp8")
def _transpose_fp8_op(q: torch.Tensor) -> torch.Tensor:
    return traced_body(q, transpose_fp8_triton, transpose_fp8_ref, q)


def cast_transpose_triton(x: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
                          rowwise: bool = True, transpose: bool = True):
    """Cast with a given scale (fp32, 1 element)."""
    return _launch(x, None, scale, out_dtype, rowwise, transpose)


def cast_transpose(x: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
                   rowwise: bool = True, transpose: bool = True, after: torch.Tensor | None = None):
    """(q, q^T) with q = fp8(x / scale); either may be skipped (None). Triton on CUDA, the reference on CPU (the
    CPU tests run the Triton versions under the interpreter by calling them by name). Given the scale an earlier
    cast used, its codes are that cast's: a layout can be made again later from x instead of being kept.

    after: a tensor the cast must follow, read by nothing. A backward that casts forward values again passes one
    of its own (the output gradient's scale): to torch.compile's partitioner an op of forward values only belongs
    to the forward, which would cast there and save the FP8 copy that casting in backward is meant not to keep."""
    if torch.compiler.is_compiling():
        q, qt = _cast_transpose_op(x, scale, out_dtype, rowwise, transpose, after)
    else:
        q, qt = pick(x, cast_transpose_triton, cast_transpose_ref)(x, scale, out_dtype, rowwise, transpose)
    return asked_layouts(q, qt, rowwise, transpose)


@fp8_operator("megacoat::cast_transpose")
def _cast_transpose_op(x: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype, rowwise: bool,
                       transpose: bool, after: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    q, qt = traced_body(x, cast_transpose_triton, cast_transpose_ref, x, scale, out_dtype, rowwise, transpose)
    return op_layouts(x, out_dtype, q, qt)


def quantize_transpose_ref(x: torch.Tensor, out_dtype: torch.dtype, rowwise: bool = True,
                           transpose: bool = True):
    """Reference: (q or None, q^T or None, scale) with the scale from x's own amax."""
    _check2d(x)
    scale = amax_scale(x, out_dtype)
    return (*cast_transpose_ref(x, scale, out_dtype, rowwise, transpose), scale)


def quantize_transpose_triton(x: torch.Tensor, out_dtype: torch.dtype, rowwise: bool = True,
                              transpose: bool = True):
    _check2d(x)
    scale = torch.empty(1, dtype=torch.float32, device=x.device)  # written by the cast kernel
    return (*_launch(x, tensor_amax(x), scale, out_dtype, rowwise, transpose), scale)


def quantize_transpose(x: torch.Tensor, out_dtype: torch.dtype, rowwise: bool = True, transpose: bool = True):
    """Per-tensor FP8 quantization of a 2-D tensor into the layouts _scaled_mm needs: (q, q^T, scale), a layout
    not asked for is None. Two launches on CUDA (amax, cast), nothing read back to the host.

    Under torch.compile the amax is a plain torch reduction in the graph, outside the cast operator, so Inductor
    can fuse it into a kernel of its own that produces x (a residual add, the transposed copy of attention's
    output, the joined Q|K|V gradient) instead of reading x once more for it; an opaque operator would hide it.
    The cast operator takes the amax and turns it into the scale itself."""
    if not torch.compiler.is_compiling():
        return pick(x, quantize_transpose_triton, quantize_transpose_ref)(x, out_dtype, rowwise, transpose)
    _check2d(x)
    amax = torch.linalg.vector_norm(x.detach(), float("inf")).reshape(1)  # tensor_amax, visible to Inductor
    return cast_from_amax(x, amax, out_dtype, rowwise, transpose)


def cast_from_amax(x: torch.Tensor, amax: torch.Tensor, out_dtype: torch.dtype, rowwise: bool = True,
                   transpose: bool = True):
    """quantize_transpose given x's amax (float32 [1], or x's dtype), folded into the kernel that wrote x: one
    launch, no pass over x for its amax. Its bytes are quantize_transpose's whenever amax is max|x|."""
    q, qt, scale = dispatch(_cast_transpose_from_amax_op, x, cast_from_amax_triton, cast_from_amax_ref, x, amax,
                            out_dtype, rowwise, transpose)
    return (*asked_layouts(q, qt, rowwise, transpose), scale)


def cast_from_amax_ref(x, amax, out_dtype, rowwise, transpose):
    """(q, q^T, scale) of x given its amax (float32 [1], computed elsewhere: a torch reduction, or folded into the
    kernel that produced x); a layout not asked for is None."""
    scale = scale_from_amax(amax, out_dtype).reshape(1)
    return (*cast_transpose_ref(x, scale, out_dtype, rowwise, transpose), scale)


def cast_from_amax_triton(x, amax, out_dtype, rowwise, transpose):
    _check2d(x)
    scale = torch.empty(1, dtype=torch.float32, device=x.device)  # written by the cast kernel
    return (*_launch(x, amax, scale, out_dtype, rowwise, transpose), scale)


@fp8_operator("megacoat::cast_transpose_from_amax")
def _cast_transpose_from_amax_op(x: torch.Tensor, amax: torch.Tensor, out_dtype: torch.dtype, rowwise: bool,
                                 transpose: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The cast of quantize_transpose as an operator, given x's amax (an operator returns tensors: a layout not
    asked for is empty)."""
    q, qt, scale = traced_body(x, cast_from_amax_triton, cast_from_amax_ref, x, amax, out_dtype, rowwise,
                               transpose)
    return (*op_layouts(x, out_dtype, q, qt), scale)


def cast_transpose_delayed_ref(x: torch.Tensor, history: torch.Tensor, out_dtype: torch.dtype, rowwise: bool = True,
                               transpose: bool = True, bootstrap: bool = False):
    """Reference of delayed scaling (megacoat.coat.delayed_scaling): (q or None, q^T or None, scale) with the scale
    from max(history), the amaxes of earlier calls (bootstrap: from x's own amax, as quantize_transpose); values
    beyond it saturate. history [L] (float32, most recent first) is rolled in place, x's amax in front."""
    _check2d(x)
    amax = tensor_amax(x).float()
    scale = delayed_scale(amax, history, out_dtype, bootstrap)
    q, qt = cast_transpose_ref(x, scale, out_dtype, rowwise, transpose)
    record_amax(history, amax)
    return q, qt, scale


def cast_transpose_delayed_triton(x: torch.Tensor, history: torch.Tensor, out_dtype: torch.dtype,
                                  rowwise: bool = True, transpose: bool = True, bootstrap: bool = False):
    """One cast launch that also folds x's amax (no pass over x for it), then the one-program roll of the history.
    bootstrap: quantize_transpose's two launches (x's own amax), then the roll."""
    if bootstrap:
        amax = tensor_amax(x).float()
        q, qt, scale = cast_from_amax_triton(x, amax, out_dtype, rowwise, transpose)
    else:
        _check2d(x)
        amax = amax_workspace(x.device)
        scale = torch.empty(1, dtype=torch.float32, device=x.device)  # written by the cast kernel
        q, qt = _launch(x, amax, scale, out_dtype, rowwise, transpose, history=history)
    roll_history(history, amax)
    return q, qt, scale


def cast_transpose_delayed(x: torch.Tensor, history: torch.Tensor, out_dtype: torch.dtype, rowwise: bool = True,
                           transpose: bool = True, bootstrap: bool = False):
    """quantize_transpose with delayed scaling (cast_transpose_delayed_ref): one launch reads x, where current
    scaling needs a reduction over x first; `history` rolled in place."""
    q, qt, scale = dispatch(_cast_transpose_delayed_op, x, cast_transpose_delayed_triton, cast_transpose_delayed_ref,
                            x, history, out_dtype, rowwise, transpose, bootstrap)
    return (*asked_layouts(q, qt, rowwise, transpose), scale)


@fp8_operator("megacoat::cast_transpose_delayed", mutates_args=("history",))
def _cast_transpose_delayed_op(x: torch.Tensor, history: torch.Tensor, out_dtype: torch.dtype, rowwise: bool,
                               transpose: bool, bootstrap: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, qt, scale = traced_body(x, cast_transpose_delayed_triton, cast_transpose_delayed_ref, x, history, out_dtype,
                               rowwise, transpose, bootstrap)
    return (*op_layouts(x, out_dtype, q, qt), scale)


def _check_into(parts, q: torch.Tensor, qt: torch.Tensor | None, scale: torch.Tensor) -> None:
    rows, k = sum(p.shape[0] for p in parts), parts[0].shape[1]
    if any(p.dim() != 2 or p.shape[1] != k for p in parts):
        raise ValueError(f"quantize_transpose_into joins 2-D parts of one width, got {[tuple(p.shape) for p in parts]}")
    if q.shape != (rows, k) or not q.is_contiguous() or (qt is not None and (qt.shape != (k, rows)
                                                                               or not qt.is_contiguous())):
        raise ValueError(f"quantize_transpose_into: outputs {tuple(q.shape)} / "
                         f"{None if qt is None else tuple(qt.shape)} do not hold parts joined to {(rows, k)}")
    if scale.shape != (1,) or scale.dtype != torch.float32:
        raise ValueError(f"quantize_transpose_into: scale must be float32 [1], got {scale.dtype} {tuple(scale.shape)}")


def joined_amax_ref(parts) -> torch.Tensor:
    """max|x| over the parts as one tensor would give it, exactly (a max in any order), NaN if any part has one."""
    if len(parts) == 1:
        return tensor_amax(parts[0])
    return torch.stack(torch._foreach_norm([p.detach() for p in parts], float("inf"))).amax().reshape(1)


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, n, BLOCK: tl.constexpr):
    """Fold max|x| over one block of a flat tensor into amax (float32 [1], from zero); NaN if the block holds one.
    The hardware max drops NaN, so it is looked for. The fold is an integer atomic max on the float's bits:
    for numbers >= 0 the orders agree, and a positive NaN's bits lie above +inf's, so NaN wins in any order
    (what Triton's float atomic max does for a value whose sign bit is clear, without its second, sign-split
    atomic)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.abs(tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32))
    nan = tl.sum((x != x).to(tl.int32), axis=0) > 0
    bits = tl.where(nan, float("nan"), tl.max(x, axis=0)).to(tl.int32, bitcast=True)
    tl.atomic_max(amax_ptr.to(tl.pointer_type(tl.int32)), bits, sem="relaxed")


AMAX_BLOCK = 8192  # elements per program: 32 a thread at 8 warps, 16 KiB of bf16


def joined_amax_triton(parts) -> torch.Tensor:
    """joined_amax_ref's max as float32 [1]: one launch per part, each program one block (one pass over the
    weights, where torch's multi-tensor inf-norm and its reduction take two)."""
    amax = torch.zeros(1, dtype=torch.float32, device=parts[0].device)
    for p in parts:
        p = p.detach().contiguous()
        n = p.numel()
        launcher(_amax_kernel)[(triton.cdiv(n, AMAX_BLOCK),)](p, amax, n, BLOCK=AMAX_BLOCK, num_warps=8)
    return amax


def quantize_transpose_into_ref(parts, q: torch.Tensor, qt: torch.Tensor | None, scale: torch.Tensor) -> None:
    """Reference: quantize_transpose of the parts joined along dim 0, copied into q, qt and scale."""
    _check_into(parts, q, qt, scale)
    joined = parts[0] if len(parts) == 1 else torch.cat(list(parts))
    rq, rqt, rscale = quantize_transpose_ref(joined, q.dtype, transpose=qt is not None)
    q.copy_(rq)
    if qt is not None:
        qt.copy_(rqt)
    scale.copy_(rscale)


def quantize_transpose_into_triton(parts, q: torch.Tensor, qt: torch.Tensor | None, scale: torch.Tensor) -> None:
    """One amax over all parts (one launch per part into one amax), then one cast per part straight into its rows
    of q and its columns of qt: no joined copy of the parts, no copy of the results."""
    _check_into(parts, q, qt, scale)
    amax = joined_amax_triton(parts)
    row = 0
    for p in parts:
        n = p.shape[0]
        _launch(p, amax, scale, q.dtype, True, qt is not None, q[row:row + n],
                None if qt is None else qt[:, row:row + n])
        row += n


def quantize_transpose_into(parts, q: torch.Tensor, qt: torch.Tensor | None, scale: torch.Tensor) -> None:
    """quantize_transpose(cat(parts)) written into existing tensors, bit for bit: q [N, K] and qt [K, N] (None:
    not written) in q's FP8 dtype, scale float32 [1]. For the FP8 weight copies, which a CUDA graph reads at fixed
    addresses: the refresh writes them in place without a joined copy of the weights or a copy of the results."""
    return pick(parts[0], quantize_transpose_into_triton, quantize_transpose_into_ref)(parts, q, qt, scale)
