"""Delayed scaling: an FP8 cast scaled by the amaxes its earlier calls recorded, recording its own in the same pass.

`DelayedScale` holds one cast site's amax history [L] (float32, most recent first; the scale is its maximum,
TransformerEngine's "max" rule), a buffer saved in checkpoints. The first call with gradients has nothing recorded
and scales by its own amax; a forward without gradients (evaluation) scales just in time and leaves the history
alone. A value beyond the recorded amaxes saturates at the format's largest value.
One entry is one micro-batch's call: its forward at an activation site, its backward at a gradient site, each scaled
from the entries of the calls before it. Which call bootstraps is fixed in its forward (for a gradient site, on its
autograd context), so several forwards may run before the first backward, as a pipeline stage's 1F1B warm-up does:
a stage runs its forwards in micro-batch order and its backwards too, so its histories are the one-stage run's.
Sites per coat block: SwiGLU's and the [q|k|v] output's gradients (grad_scaling), the two norms' and SwiGLU's FP8
outputs and wo's input (activation_scaling). `AmaxHistorySync` keeps the data-parallel replicas' histories equal.
"""
from __future__ import annotations

import torch
from torch import nn

HISTORY_KEY = "amax_history"


class DelayedScale(nn.Module):
    """One cast site's amax history (see the module's docstring)."""

    def __init__(self, history_len: int):
        super().__init__()
        if history_len < 1:
            raise ValueError(f"--fp8-amax-history-len must be at least 1, got {history_len}")
        self.register_buffer(HISTORY_KEY, torch.zeros(history_len, dtype=torch.float32))
        self.ready = False  # an amax is (or will be, by the pending call) in the history
        self._register_load_state_dict_pre_hook(self._fit_loaded_history)
        self.register_load_state_dict_post_hook(self._ready_from_history)

    def _apply(self, fn, recurse=True):
        """Module.to / .cuda / .bfloat16 move the history but keep it float32: the kernels read it as float32,
        and an amax rounded to bf16 would move the scale by up to 2^-9 for nothing."""
        history = self._buffers[HISTORY_KEY]
        self._buffers[HISTORY_KEY] = history.to(device=fn(history).device, dtype=torch.float32)
        return self

    def bootstrap(self) -> bool:
        """For a forward with gradients: whether the call it makes (the forward's own cast, or its backward's)
        must scale by its own amax (nothing recorded yet)."""
        if self.ready:
            return False
        self.ready = True
        return True

    def _fit_loaded_history(self, state_dict, prefix, *_):
        """A checkpoint saved without delayed scaling starts from an empty history (the first call scales by its
        own amax again); one with another --fp8-amax-history-len keeps its most recent entries."""
        key = prefix + HISTORY_KEY
        mine = getattr(self, HISTORY_KEY)
        saved = state_dict.get(key)
        fitted = torch.zeros_like(mine)
        if saved is not None:
            n = min(len(saved), len(fitted))
            fitted[:n] = saved[:n]
        state_dict[key] = fitted

    @staticmethod
    def _ready_from_history(module, _incompatible) -> None:
        module.ready = bool(getattr(module, HISTORY_KEY).amax() > 0)  # one host read, at load time only


def history_for_call(site: DelayedScale | None, grad: bool) -> tuple[torch.Tensor | None, bool]:
    """(history, bootstrap) that a site's kernels take for one forward: (None, False), current scaling, without
    the site or for a forward without gradients (evaluation leaves the history alone)."""
    if site is None or not grad:
        return None, False
    return getattr(site, HISTORY_KEY), site.bootstrap()


def drop_saved_history(module: nn.Module, attr: str):
    """A load_state_dict pre-hook for a module without delayed scaling: forget the history a checkpoint saved
    with it (current scaling resumes a delayed run), instead of failing on an unexpected key."""
    def hook(state_dict, prefix, *_):
        state_dict.pop(f"{prefix}{attr}.{HISTORY_KEY}", None)
    module._register_load_state_dict_pre_hook(hook)


class AmaxHistorySync:
    """Keeps every data-parallel replica's amax histories the same: after each optimizer step, each history
    becomes the element-wise maximum over the data-parallel group (TransformerEngine reduces its amaxes the same
    way). Replicas see different micro-batches, so their own histories differ; unreduced, their FP8 scales would
    drift apart, and a checkpoint (which saves data-parallel rank 0's model state) would resume the other ranks
    with histories they never had. Entry i is the i-th most recent call on every replica (they run the same number
    of calls), so the maximum is the history of the group's amaxes. One all-reduce of all histories a step
    (24 layers x 6 sites x 16 float32 = 9 KiB for the 1.3 B model); nothing with one replica."""

    def __init__(self, module: nn.Module, group=None, size: int = 1):
        self.sites = [m for m in module.modules() if isinstance(m, DelayedScale)]
        self.group = group
        self.active = size > 1 and bool(self.sites)

    def __call__(self) -> None:
        if not self.active:
            return
        import torch.distributed as dist

        histories = [getattr(m, HISTORY_KEY) for m in self.sites]  # read now: Module.to replaces the buffer
        flat = torch.cat(histories)
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=self.group)
        torch._foreach_copy_(histories, flat.split([h.numel() for h in histories]))  # in place
