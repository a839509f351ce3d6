"""DeepSpeed's ZeRO-1/2 step without a host read: the non-finite check moves to the device.

DeepSpeed 0.19.8's ZeRO-1/2 optimizer decides on the host whether a step may be applied. `has_overflow` runs an
inf/NaN test per gradient tensor and reads the sum (`.item()`); `unscale_and_clip_grads` reads the clip norm again
(`is_invalid_grad_norm`). The first read drains the GPU's queue, and every launch of the step after it (one norm per
gradient tensor, the flat copy, the optimizer, the write-back) then runs on an idle GPU. On the H100 (1.3 B,
micro-batch 2, `benchmarks/results/bench_e2e_notes.md`) removing the reads took compiled bf16 from about 39 k to
49 k tokens/s.

`install_device_skip(engine)` changes three things on the engine's ZeRO optimizer (this instance only):
- DeepSpeed's own switch `check_grad_overflow` is off, so neither host check runs;
- the global gradient norm is one multi-tensor launch (`torch._foreach_norm`), or one reduction where the gradients
  lie flat in one buffer, instead of one per tensor, over the same parameters as DeepSpeed's `get_grad_norm_direct`
  (TP shards, pipeline-replicated ones counted once) and with its reductions;
- clipping reads that norm on the device, and a non-finite norm sets `found_inf`, which the client optimizer
  honours by writing nothing for the step (torch's GradScaler protocol: fused AdamW, and CoatAdamW's kernel);
- the clipping factor itself goes to the client optimizer as its `grad_scale` (the same protocol), which divides
  the gradients as it reads them, instead of DeepSpeed's separate in-place pass over the flat gradients (a read and
  a write of every gradient byte: ~5 ms a step for 1.3 B bf16 gradients on an H100). CoatAdamW's rounding is that
  pass's, bit for bit; fused AdamW divides where the pass multiplied by the reciprocal (within an ulp).

What differs from DeepSpeed's host skip: over a refused step the LR schedule and the optimizer's step count move on
(the host does not know of the refusal), and the trainer learns of refusals when it next reads the counters, at its
log interval or before a save (`SkipCounter`, `StabilityGuard.flush`). Where the client optimizer does not honour
`found_inf` (the CPU's for-each AdamW), the engine's optimizer is not DeepSpeedZeroOptimizer (DeepSpeed's
BF16_Optimizer, which it runs for ZeRO-0 and for ZeRO-1 with --main-grads-dtype fp32; the pipeline engine), or the
run is not bf16 (DeepSpeed checks an fp32 run's norm on the host whatever its switch says), nothing is installed
and DeepSpeed's host check stays.
"""
from __future__ import annotations

import types

import torch
import torch.distributed as dist

from megacoat.optim.coat_adamw import CoatAdamW
from megacoat.training.zero_flat_grads import flat_view

DEVICE_SKIP_LINE = ("non-finite steps: refused on the device, without a host read (the LR schedule moves on over "
                    "them; --host-overflow-check for DeepSpeed's host check)")
_ATTRS = ("check_grad_overflow", "compute_grad_norm", "get_grad_norm_direct", "unscale_and_clip_grads",
          "model_parallel_rank", "dp_process_group", "_model_parallel_all_reduce", "clip_grad", "loss_scale")


def honours_found_inf(optimizer) -> bool:
    """Whether `optimizer.step()` skips itself on a device flag: CoatAdamW, or torch AdamW/Adam with fused=True."""
    if isinstance(optimizer, CoatAdamW):
        return True
    if isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam)):
        return all(g.get("fused") for g in optimizer.param_groups)
    return False


class SkipCounter:
    """Device-side counts of refused steps since the last `read`: how many, and the longest run in a row."""

    def __init__(self, device: torch.device):
        # This step's flag, set in the step; 0-dim, as fused AdamW's step counts are (it subtracts it from them).
        self.found_inf = torch.zeros((), dtype=torch.float32, device=device)
        self._counts = torch.zeros(3, dtype=torch.int64, device=device)  # refused, current run, longest run

    def record(self) -> None:
        """After each optimizer step: fold its flag into the counts (device ops only)."""
        hit = self.found_inf.reshape(()).to(torch.int64)
        refused, run, longest = self._counts.unbind()
        new_run = (run + 1) * hit
        self._counts.copy_(torch.stack([refused + hit, new_run, torch.maximum(longest, new_run)]))

    def read(self) -> tuple[int, int, int]:
        """(refused, run at the end, longest run) since the last read; one host read. The longest run restarts
        from the current one, so a run that spans two reads is still counted whole."""
        refused, run, longest = (int(x) for x in self._counts.tolist())
        self._counts[0] = 0
        self._counts[2] = run
        return refused, run, longest


def install_device_skip(engine) -> SkipCounter | None:
    """Move the engine's ZeRO-1/2 step checks to the device (module docstring); None where that does not apply."""
    zero = engine.optimizer
    client = getattr(zero, "optimizer", None)
    if type(zero).__name__ != "DeepSpeedZeroOptimizer" or any(not hasattr(zero, a) for a in _ATTRS):
        return None
    if client is None or not honours_found_inf(client) or not zero.compute_grad_norm:
        return None
    if getattr(zero, "cpu_offload", False) or getattr(zero, "dtype", None) != torch.bfloat16:
        return None
    device = next(p.device for g in client.param_groups for p in g["params"])
    counter = SkipCounter(device)
    client.found_inf = counter.found_inf
    zero.check_grad_overflow = False
    zero.get_grad_norm_direct = types.MethodType(_grad_norm_one_launch, zero)
    zero.unscale_and_clip_grads = types.MethodType(_make_clip_on_device(counter.found_inf, client), zero)
    return counter


def _grad_norm_one_launch(self, gradients, params, norm_type=2):
    """DeepSpeed's `get_grad_norm_direct` for the L2 norm, with one `_foreach_norm` launch for all tensors, or one
    plain reduction where the counted gradients are one run of memory (ZeRO-1 with one data-parallel rank and
    gradients laid flat: zero_single_rank.py, own_graph_gradients). `_foreach_norm` splits its work into launches
    of a few hundred blocks each (~135 launches and ~2.8 ms a step for 1.3 B bf16 gradients on an H100,
    bench_e2e_kernels_mb4.json); the plain reduction is one. Both sum squares in fp32, in different orders."""
    from deepspeed.runtime.zero.stage_1_and_2 import PIPE_REPLICATED, is_model_parallel_parameter

    if float(norm_type) != 2.0:
        return type(self).get_grad_norm_direct(self, gradients, params, norm_type)
    grads = (g for g in gradients if not getattr(g, "_zero_padding", False))
    counted = [g.detach() for g, p in zip(grads, params)
               if not (hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated)
               and (is_model_parallel_parameter(p) or self.model_parallel_rank == 0)]
    flat = flat_view(counted, sum(g.numel() for g in counted))
    if flat is not None:  # every gradient counted and lying in one buffer: one reduction at full bandwidth
        total = torch.linalg.vector_norm(flat, 2, dtype=torch.float32).square()
    elif counted:
        total = torch.stack(torch._foreach_norm(counted, 2, dtype=torch.float32)).square().sum()
    else:
        total = torch.zeros((), dtype=torch.float32, device=self.device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.dp_process_group)
    self._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
    total = total.sqrt()
    # DeepSpeed's -1 sentinel for a non-finite norm. Not its mask_nan_or_inf_with_val_inplace: that builds the -1
    # on the host (an H2D copy) and fills with a tensor value (a read back), two waits for the GPU per group.
    return total.masked_fill_(~torch.isfinite(total), -1.0)


def _make_clip_on_device(found_inf: torch.Tensor, client):
    def unscale_and_clip_grads(self, grad_groups_flat, total_norm):
        """DeepSpeed's clip with the norm kept on the device; a non-finite (or sentinel) norm sets `found_inf`. The
        factor is handed to the client optimizer as `grad_scale` (module docstring), not applied here."""
        invalid = ~torch.isfinite(total_norm) | (total_norm < 0)
        found_inf.copy_(invalid)
        client.grad_scale = None
        if self.clip_grad <= 0.0 and self.loss_scale == 1.0:
            return
        combined_scale = self.loss_scale
        if self.clip_grad > 0.0:
            clip_norm = torch.where(invalid, torch.full_like(total_norm, float("inf")), total_norm)
            clip = ((clip_norm / self.loss_scale) + 1e-6) / self.clip_grad
            combined_scale = torch.clamp(clip, min=1.0) * self.loss_scale
        if not torch.is_tensor(combined_scale):  # a fill, not a tensor built on the host (an H2D copy waits)
            combined_scale = torch.full((), combined_scale, dtype=torch.float32, device=found_inf.device)
        client.grad_scale = combined_scale.to(torch.float32).reshape(())
    return unscale_and_clip_grads
