"""CoatAdamW: AdamW whose two moments are stored in FP8 with per-group dynamic range expansion (COAT).

State per parameter of n elements, per moment: n FP8 codes, ceil(n/G) fp32 scales and ceil(n/G) bf16 exponents,
i.e. 1 + 6/G bytes per element (G = 128: 2.09 bytes per parameter for both moments; fp32 AdamW: 8). One fused
step per launch over all parameters of a group (`megacoat.ops.coat_adamw_step`); under DeepSpeed ZeRO-1/2 a
"parameter" is one flat fp32 partition of any length.

With `param_remainders=True` the parameters are bf16 and there is no separate fp32 master copy: each parameter's
state holds `remainder` (int16, the low 16 bits of its fp32 master, `megacoat.ops.param_remainder`), and the fused
step reads and writes parameter + remainder as one exact fp32 value. Same update, bit for bit, as CoatAdamW on that
fp32 master; 2 bytes per parameter instead of 4 (under DeepSpeed: `--main-params-dtype bf16-remainder`).

Edge groups: a group holding a NaN/Inf is stored with a NaN scale and counted (`nonfinite_groups`); a group whose
largest moment is below float32's smallest normal is scaled as if its amax were 2^-126 and not expanded (the one
amax floor of megacoat.ops.numerics).

Refused steps: set `found_inf` (a float32 tensor of one element, 0-dim or [1], on the parameters' device: torch's
GradScaler protocol, as for fused AdamW) and a step whose flag is non-zero writes nothing, decided on the device.
Unlike fused AdamW, the step count still advances (it lives on the host); it only shifts the bias correction,
1 - beta^t, which is within beta2^t of 1 after a few hundred steps.

Gradient clipping inside the step: set `grad_scale` (float32, one element, on the device; GradScaler's name, as
fused AdamW takes it) and every gradient is divided by it as the kernel reads it, instead of a separate in-place
pass over the gradients before the step (see `coat_adamw_step_ref` for the rounding).
"""
from __future__ import annotations

from collections import defaultdict

import torch

from megacoat.coat.group_scaling import check_group_size, num_groups
from megacoat.ops.coat_adamw import BACKENDS, coat_adamw_step
from megacoat.ops.formats import get_format

# Settings that define the stored state's meaning: a checkpoint only loads into an optimizer that agrees on them.
STATE_CONFIG_KEYS = ("m_dtype", "v_dtype", "group_size", "expand", "param_remainders")
# A checkpoint written before a setting existed stores none: it was saved with this value.
STATE_CONFIG_DEFAULTS = {"param_remainders": False}
STATE_KEYS = ("exp_avg", "exp_avg_scale", "exp_avg_k", "exp_avg_sq", "exp_avg_sq_scale", "exp_avg_sq_k")


class CoatAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction; torch.optim.AdamW's update) with FP8 moments.

    m_dtype / v_dtype: "e4m3" or "e5m2"; group_size: elements per quantization group; expand: dynamic range
    expansion (False: plain per-group scaling, k = 1); backend: "auto" (the CUDA kernel for CUDA parameters,
    the reference for CPU ones), "cuda" or "torch" (megacoat.ops.coat_adamw);
    param_remainders: bf16 parameters carry the low half of their fp32 master in the state (module docstring).
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, m_dtype: str = "e4m3", v_dtype: str = "e4m3", group_size: int = 128,
                 expand: bool = True, backend: str = "auto", param_remainders: bool = False):
        if not lr >= 0.0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if not eps >= 0.0 or not weight_decay >= 0.0:
            raise ValueError(f"eps and weight_decay must be >= 0, got {eps}, {weight_decay}")
        m_dtype, v_dtype = get_format(m_dtype).name, get_format(v_dtype).name  # clear error on a bad name
        check_group_size(group_size)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, m_dtype=m_dtype,
                        v_dtype=v_dtype, group_size=group_size, expand=bool(expand),
                        param_remainders=bool(param_remainders))
        super().__init__(params, defaults)
        self.backend = backend
        self._nonfinite: dict[torch.device, torch.Tensor] = {}

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        if p.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"CoatAdamW updates float32 or bfloat16 parameters, got {p.dtype}")
        if not p.is_contiguous():
            raise ValueError("CoatAdamW needs contiguous parameters (its state is grouped along the flat tensor)")
        if group["param_remainders"] and p.dtype != torch.bfloat16:
            raise TypeError(f"CoatAdamW(param_remainders=True) keeps remainders of bfloat16 parameters, got {p.dtype}")
        n, ng = p.numel(), num_groups(p.numel(), group["group_size"])
        state = self.state[p]
        state["step"] = torch.tensor(0.0)  # on the CPU: the bias correction needs no device sync
        for prefix, fmt in (("exp_avg", group["m_dtype"]), ("exp_avg_sq", group["v_dtype"])):
            state[prefix] = torch.zeros(n, dtype=get_format(fmt).dtype, device=p.device)
            state[prefix + "_scale"] = torch.zeros(ng, dtype=torch.float32, device=p.device)
            state[prefix + "_k"] = torch.ones(ng, dtype=torch.bfloat16, device=p.device)
        if group["param_remainders"]:
            # The master starts as the bf16 value itself (remainder 0), as an fp32 copy of it would.
            state["remainder"] = torch.zeros(n, dtype=torch.int16, device=p.device)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            # One launch per (device, dtypes, step): normally one for the whole group.
            launches: dict = defaultdict(lambda: [[] for _ in range(9)])
            remainders = group["param_remainders"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("CoatAdamW does not support sparse gradients")
                state = self.state[p] or self._init_state(p, group)
                state["step"] += 1
                grad = p.grad if p.grad.is_contiguous() else p.grad.contiguous()
                key = (p.device, p.dtype, grad.dtype, int(state["step"].item()))
                extra = (state["remainder"],) if remainders else ()
                for lst, t in zip(launches[key], (p, grad) + tuple(state[k] for k in STATE_KEYS) + extra):
                    lst.append(t)
            for (device, _, _, step), lists in launches.items():
                p, g, mq, ms, mk, vq, vs, vk, rem = lists
                coat_adamw_step(p, g, mq, ms, mk, vq, vs, vk, lr=group["lr"], beta1=beta1, beta2=beta2,
                                eps=group["eps"], weight_decay=group["weight_decay"], step=step,
                                group_size=group["group_size"], expand=group["expand"],
                                nonfinite=self._counter(device), backend=self.backend,
                                remainders=rem if remainders else None, skip=getattr(self, "found_inf", None),
                                grad_scale=getattr(self, "grad_scale", None))
        return loss

    def _counter(self, device: torch.device) -> torch.Tensor:
        if device not in self._nonfinite:
            self._nonfinite[device] = torch.zeros(1, dtype=torch.int32, device=device)
        return self._nonfinite[device]

    def nonfinite_groups(self, reset: bool = True) -> int:
        """Moment groups that became NaN/Inf since the last call (stored with a NaN scale). Syncs the device."""
        total = sum(int(c.item()) for c in self._nonfinite.values())
        if reset:
            for c in self._nonfinite.values():
                c.zero_()
        return total

    def state_bytes(self) -> int:
        """Bytes of optimizer state on the devices (FP8 codes, scales, exponents; remainders when kept)."""
        return sum(t.numel() * t.element_size() for s in self.state.values() for k, t in s.items()
                   if k in STATE_KEYS or k == "remainder")

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, with two changes: the settings that give the FP8 state its meaning must match (else a clear
        error), and the state keeps its own dtypes (torch would cast every floating tensor to the parameter's)."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"checkpoint has {len(saved_groups)} parameter groups, this optimizer "
                             f"{len(self.param_groups)}")
        for i, (saved, cur) in enumerate(zip(saved_groups, self.param_groups)):
            saved = {**STATE_CONFIG_DEFAULTS, **saved}
            missing = [k for k in STATE_CONFIG_KEYS if k not in saved]
            if missing:
                raise ValueError(f"checkpoint's optimizer state is not CoatAdamW's (param group {i} lacks "
                                 f"{missing}); it cannot resume a CoatAdamW run")
            if saved["param_remainders"] != cur["param_remainders"]:
                master = {True: "bf16-remainder", False: "fp32"}
                raise ValueError(f"checkpoint was saved with --main-params-dtype {master[saved['param_remainders']]} "
                                 f"(CoatAdamW param_remainders={saved['param_remainders']}) but this run has "
                                 f"--main-params-dtype {master[cur['param_remainders']]}; resume with the same "
                                 "--main-params-dtype")
            for k in STATE_CONFIG_KEYS:
                if saved[k] != cur[k]:
                    raise ValueError(f"checkpoint was saved with CoatAdamW {k}={saved[k]!r} but this optimizer has "
                                     f"{k}={cur[k]!r}; resume with the same --fp8-m-dtype/--fp8-v-dtype/"
                                     "--fp8-group-size/--fp8-no-expansion")
        params = [p for g in self.param_groups for p in g["params"]]
        ids = [i for g in saved_groups for i in g["params"]]
        saved_state = state_dict["state"]
        for pid, p, group in zip(ids, params, (g for g in self.param_groups for _ in g["params"])):
            if pid in saved_state:
                self._check_saved_state(saved_state[pid], p, group, pid)
        super().load_state_dict(state_dict)
        for g in self.param_groups:
            for k, v in STATE_CONFIG_DEFAULTS.items():
                g.setdefault(k, v)
        for pid, p in zip(ids, params):
            if pid in saved_state:
                for k, v in saved_state[pid].items():
                    self.state[p][k] = v.detach().to("cpu" if k == "step" else p.device, copy=True)

    @staticmethod
    def _check_saved_state(st: dict, p: torch.Tensor, group: dict, pid) -> None:
        n, ng = p.numel(), num_groups(p.numel(), group["group_size"])
        want = {"exp_avg": (get_format(group["m_dtype"]).dtype, n), "exp_avg_sq": (get_format(group["v_dtype"]).dtype, n),
                "exp_avg_scale": (torch.float32, ng), "exp_avg_sq_scale": (torch.float32, ng),
                "exp_avg_k": (torch.bfloat16, ng), "exp_avg_sq_k": (torch.bfloat16, ng)}
        if group["param_remainders"]:
            want["remainder"] = (torch.int16, n)
        for k, (dtype, numel) in want.items():
            t = st.get(k)
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.numel() != numel:
                got = None if not isinstance(t, torch.Tensor) else f"{t.dtype} x {t.numel()}"
                raise ValueError(f"checkpoint state of parameter {pid} has {k} = {got}, expected {dtype} x {numel}")
