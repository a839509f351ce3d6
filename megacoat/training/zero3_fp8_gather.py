"""ZeRO-3's all-gather of the COAT blocks' weights in FP8: one byte a parameter on the wire instead of bf16's two.

After each optimizer step (`refresh`) every rank quantizes its own shard of each block weight to E4M3, once, with
the per-tensor scale of the whole weight, or of the joined weights of one GEMM (wq|wk|wv, w1|w3): one all-reduce
(max) of the shards' amaxes over the data-parallel group gives every rank the same amax, and a weight's codes
depend on its element and that amax alone (megacoat.ops.cast_transpose.cast_from_amax), so each shard holds the
codes the whole weight would get. When DeepSpeed gathers such a weight for a block's forward or backward, the
shards' codes are all-gathered (as uint8: gloo has no FP8 types) instead of the bf16 shards, and the weight
carries the whole FP8 copy and its scale as `fp8_gathered`, which the FP8 weight cache reads
(megacoat.coat.linear.gathered_fp8) instead of quantizing the weight. The parameter's data is then a placeholder
of the weight's shape holding NaN: autograd needs only its shape (to accumulate the weight's gradient), and any
read of its values shows. The copy goes when DeepSpeed releases the weight. Training is bit for bit the bf16
gather's, whose weight cache quantizes the gathered weight with the same amax.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from megacoat.coat.flow import CoatTransformerBlock
from megacoat.ops.cast_transpose import cast_from_amax
from megacoat.ops.formats import E4M3
from megacoat.training.deepspeed_patches import TESTED_DEEPSPEED, deepspeed_version_problem


def fp8_gemm_weights(model: nn.Module) -> list[tuple[nn.Parameter, ...]]:
    """The weights of the COAT blocks' FP8 GEMMs, one tuple per GEMM (the weights that share its scale)."""
    groups = []
    for block in model.modules():
        if isinstance(block, CoatTransformerBlock):
            for module in block.modules():
                if hasattr(module, "fp8_weight_caches"):
                    groups += [tuple(weights) for _, weights in module.fp8_weight_caches()]
    return groups


class Fp8WeightGather:
    """Installed on a DeepSpeed ZeRO-3 engine's model (module docstring); `refresh()` after each optimizer step
    and checkpoint load, before the next forward."""

    def __init__(self, model: nn.Module):
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        self._status = ZeroParamStatus
        self.groups = fp8_gemm_weights(model)
        self.members = {id(w) for group in self.groups for w in group}
        for p in model.parameters():
            p.all_gather_coalesced = functools.partial(self._gather, own=p.all_gather_coalesced)
            if id(p) in self.members:
                p.partition = functools.partial(_drop_copy_and_release, p, p.partition)

    @torch.no_grad()
    def refresh(self) -> None:
        """Quantize every shard with its GEMM's amax, agreed over the data-parallel group (one all-reduce)."""
        if not self.groups:
            return
        amax = torch.stack([torch.stack([w.ds_tensor.detach().abs().amax().float() for w in group]).amax()
                            for group in self.groups])
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.groups[0][0].ds_process_group)
        for group, group_amax in zip(self.groups, amax):
            for w in group:
                codes, _, scale = cast_from_amax(w.ds_tensor.detach().view(1, -1), group_amax.reshape(1),
                                                 E4M3.dtype, rowwise=True, transpose=False)
                w.fp8_shard, w.fp8_scale = codes.view(-1).view(torch.uint8), scale

    def _gather(self, params, safe_mode: bool = False, quantize: bool = False, *, own):
        """DeepSpeed's all_gather_coalesced for `params`: the refreshed block weights in FP8, the rest by `own`."""
        params = list(params)
        fp8 = sorted((p for p in params if id(p) in self.members and hasattr(p, "fp8_shard")
                      and p.ds_status == self._status.NOT_AVAILABLE), key=lambda p: p.ds_id)
        rest = [p for p in params if all(p is not q for q in fp8)]
        handles = [own(rest, safe_mode=safe_mode, quantize=quantize)] if rest else []
        for p in fp8:
            p.ds_status = self._status.INFLIGHT
            group = p.ds_process_group
            whole = torch.empty(p.fp8_shard.numel() * dist.get_world_size(group), dtype=torch.uint8,
                                device=p.fp8_shard.device)
            work = dist.all_gather_into_tensor(whole, p.fp8_shard, group=group, async_op=True)
            p.data = torch.full((1,), float("nan"), dtype=p.ds_tensor.dtype, device=p.ds_tensor.device).expand(
                p.ds_shape)
            handles.append(_Fp8Handle(p, whole, work, self._status.AVAILABLE))
        return _Handles(handles)


def _drop_copy_and_release(param, release, *args, **kwargs):
    param.__dict__.pop("fp8_gathered", None)
    return release(*args, **kwargs)


def install_fp8_weight_gather(engine, zero_stage: int, weight_gather: str, log=print,
                              version: str | None = None) -> Fp8WeightGather | None:
    """The FP8 gather on a ZeRO-3 engine's COAT blocks when --zero3-weight-gather is fp8; None elsewhere. It
    replaces DeepSpeed's per-parameter gather, so on a DeepSpeed other than TESTED_DEEPSPEED it is not installed
    and one warning line says the weights are gathered in bf16."""
    if zero_stage != 3 or weight_gather != "fp8":
        return None
    if deepspeed_version_problem(version) is not None:
        import deepspeed

        log(f"warning: deepspeed {version or deepspeed.__version__} is not the version megacoat's ZeRO-3 FP8 weight "
            f"gather was written for ({', '.join(TESTED_DEEPSPEED)}): the weights are gathered in bf16")
        return None
    gather = Fp8WeightGather(engine.module)
    return gather if gather.groups else None


class _Fp8Handle:
    def __init__(self, param, whole, work, available):
        self.param, self.whole, self.work, self.available = param, whole, work, available

    def wait(self, handle_dependency: bool = True) -> None:
        if self.work is None:
            return
        self.work.wait()
        self.work = None
        p = self.param
        p.fp8_gathered = (self.whole[:p.ds_numel].view(E4M3.dtype).view(p.ds_shape), p.fp8_scale)
        p.ds_status = self.available


class _Handles:
    def __init__(self, handles):
        self.handles = handles

    def wait(self, handle_dependency: bool = True) -> None:
        for handle in self.handles:
            handle.wait(handle_dependency=handle_dependency)
