"""One optimizer parameter's Adam state in layout-free form, and back.

The layout-free form is a dict of flat fp32 tensors, one element per element of the parameter (Adam's
`exp_avg` and `exp_avg_sq`): torch.optim.AdamW's own moments, or CoatAdamW's FP8 codes dequantized with their
group scales and expansion exponents (megacoat.ops.coat_adamw_ref, the optimizer's storage contract). Going back,
CoatAdamW's moments are quantized again with the target optimizer's settings, over the target's groups.

Exactness: dequantize -> quantize -> dequantize returns the same fp32 moments bit for bit when the groups are the
same (the largest code of a group maps back to its amax, so scale and k are recomputed identically; only the sign
of a zero code may flip). Over other group boundaries (another ZeRO partition or TP shard) or settings the moments
carry one FP8 quantization error: relative u = F.eps / 2 for values in the normal range ((1 + u)^(1/k) - 1 with
expansion exponent k), absolute half a subnormal step of the group's scale below it (the quantizer contract of megacoat.ops.coat_adamw_ref).

Per-element state keys this module does not know (a tensor with one entry per parameter element) are carried as
fp32 under their own name and handed back to an optimizer of the same kind.
"""
from __future__ import annotations

import torch

from megacoat.coat.adamw import STATE_CONFIG_KEYS, STATE_KEYS
from megacoat.coat.expansion import dequantize_moment, quantize_moment
from megacoat.ops.formats import get_format
from megacoat.ops.numerics import num_groups

MOMENTS = ("exp_avg", "exp_avg_sq")
MOMENT_FORMAT_KEY = {"exp_avg": "m_dtype", "exp_avg_sq": "v_dtype"}
_SLICE = 1 << 22  # elements converted at a time (a multiple of every group size): bounded fp32 temporaries


def optimizer_kind(group: dict) -> str:
    """'coat' for a CoatAdamW parameter group, else 'adamw' (torch.optim.AdamW)."""
    return "coat" if all(k in group for k in STATE_CONFIG_KEYS) else "adamw"


def optimizer_settings(group: dict) -> dict:
    """What gives the stored state its meaning: the kind and, for CoatAdamW, formats, group size, expansion."""
    kind = optimizer_kind(group)
    return {"kind": kind, **({k: group[k] for k in STATE_CONFIG_KEYS} if kind == "coat" else {})}


def state_step(state: dict) -> int:
    step = state.get("step", 0)
    return int(step.item() if isinstance(step, torch.Tensor) else step)


def state_to_fp32(state: dict, group: dict) -> dict[str, torch.Tensor]:
    """Flat fp32 tensors (moments and any other per-element state) of one parameter's state; {} before its
    first step."""
    if "exp_avg" not in state:
        return {}
    n = state["exp_avg"].numel()
    out = {}
    coat = optimizer_kind(group) == "coat"
    if coat:
        gs = group["group_size"]
        for key in MOMENTS:
            q, scale, k = state[key].reshape(-1), state[key + "_scale"], state[key + "_k"]
            pieces = []
            for s in range(0, n, _SLICE):
                e = min(s + _SLICE, n)
                g = slice(s // gs, num_groups(e, gs))
                pieces.append(dequantize_moment(q[s:e], scale[g], k[g], gs))
            out[key] = torch.cat(pieces) if pieces else q.float()
    for key, value in state.items():
        if key in out or (coat and key in STATE_KEYS) or key == "step" or not isinstance(value, torch.Tensor):
            continue
        if value.numel() == n:
            out[key] = value.detach().float().reshape(-1)
    return out


def state_from_fp32(fp32: dict[str, torch.Tensor], step: int, group: dict, param: torch.Tensor,
                    like: dict | None = None, source_kind: str | None = None) -> dict:
    """The state the optimizer of `group` keeps for `param` with these flat fp32 moments and step count.
    `like`: the parameter's current state (its step tensor's dtype and device are kept). Per-element keys other
    than the moments are kept only when `source_kind` (the optimizer that wrote them) is the target's kind."""
    n = param.numel()
    for key, value in fp32.items():
        if value.numel() != n:
            raise ValueError(f"{key}: {value.numel()} elements for a parameter of {n}")
    if any(key not in fp32 for key in MOMENTS):
        raise ValueError(f"state lacks {[k for k in MOMENTS if k not in fp32]}")
    like = like or {}
    if isinstance(like.get("step"), torch.Tensor):
        step_t = torch.full_like(like["step"], float(step))
    else:
        on_device = group.get("fused") or group.get("capturable")
        step_t = torch.tensor(float(step), dtype=torch.float32, device=param.device if on_device else "cpu")
    state = {"step": step_t}
    kind = optimizer_kind(group)
    plain = dict(fp32) if source_kind in (None, kind) else {k: fp32[k] for k in MOMENTS}
    if kind == "coat":
        gs = group["group_size"]
        for key in MOMENTS:
            flat = plain.pop(key).reshape(-1).to(param.device, torch.float32)
            fmt = get_format(group[MOMENT_FORMAT_KEY[key]]).dtype
            pieces = [quantize_moment(flat[s:s + _SLICE], fmt, gs, group["expand"])
                      for s in range(0, max(n, 1), _SLICE)]
            state[key] = torch.cat([p[0] for p in pieces])
            state[key + "_scale"] = torch.cat([p[1] for p in pieces])
            state[key + "_k"] = torch.cat([p[2] for p in pieces])
    for key, value in plain.items():  # AdamW's moments (parameter-shaped), other per-element state
        dtype = like[key].dtype if isinstance(like.get(key), torch.Tensor) else param.dtype
        state[key] = value.reshape(param.shape).to(param.device, dtype).clone()
    return state
