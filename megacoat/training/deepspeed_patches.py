"""Every change megacoat makes to DeepSpeed's ZeRO-1/2 optimizer, installed by one call: `patch_zero_optimizer`.

The patches replace methods of one `DeepSpeedZeroOptimizer` instance (never the class) and read its private
attributes by name, as DeepSpeed TESTED_DEEPSPEED lays them out. Each is exact or documented where it is not:
- `share_master_partitions` (--main-params-dtype bf16-remainder): the bf16 "master" partition is the model's slice;
- `install_flat_grad_partition`: the step reads its gradient partition in place instead of flattening a copy;
- `skip_single_rank_reduction`: ZeRO-1 with one data-parallel rank skips the identity reduction and its buckets;
- `install_overlapped_reduction` (DeepSpeed's overlap_comm, --overlap-grad-reduce): ZeRO-1's reduced gradients
  laid in parameter order, and the end of backward waiting for the reduction stream on the device instead of a
  device-wide synchronize from the host;
- `install_device_skip` (bf16): the non-finite check and the clip run on the device without a host read. Unlike
  DeepSpeed's host check, the LR schedule and step count move on over a refused step; the trainer reads the
  refusals from the returned `SkipCounter` at its log interval and before a save.
Each patch checks the attributes it uses and leaves DeepSpeed's own path where one is missing. ZeRO-3's optimizer
(DeepSpeedZeroOptimizer_Stage3) gets none of them: it runs as DeepSpeed ships it.

On a DeepSpeed other than TESTED_DEEPSPEED nothing is patched and one warning line says so: DeepSpeed's own step
is correct (slower, and larger by the shared master), while a patch over changed internals could be silently
wrong. Refusing to run would protect nothing more.
"""
from __future__ import annotations

import types
from typing import Callable

import torch
import torch.distributed as dist

from megacoat.coat.adamw import CoatAdamW

TESTED_DEEPSPEED = ("0.19.8",)
DEVICE_SKIP_LINE = ("non-finite steps: refused on the device, without a host read (the LR schedule moves on over "
                    "them; --host-overflow-check for DeepSpeed's host check)")


def deepspeed_version_problem(version: str | None = None) -> str | None:
    """The one warning line for a DeepSpeed the patches were not written for; None for a tested one."""
    if version is None:
        import deepspeed

        version = deepspeed.__version__
    if version in TESTED_DEEPSPEED:
        return None
    return (f"warning: deepspeed {version} is not the version megacoat's ZeRO patches were written for "
            f"({', '.join(TESTED_DEEPSPEED)}): running DeepSpeed's own ZeRO step (correct, slower, more memory)")


def patch_zero_optimizer(engine, *, share_master: bool, device_skip: bool,
                         log: Callable[[str], None] = print, version: str | None = None) -> SkipCounter | None:
    """Install every patch that applies to `engine.optimizer` (module docstring). share_master: the optimizer
    runs --main-params-dtype bf16-remainder; device_skip: move the non-finite check to the device where it
    applies. Returns the device path's SkipCounter, or None where DeepSpeed's host check stays."""
    problem = deepspeed_version_problem(version)
    if problem is not None:
        log(problem)
        return None
    if share_master:
        share_master_partitions(engine.optimizer)
    install_flat_grad_partition(engine.optimizer)
    skip_single_rank_reduction(engine.optimizer)
    install_overlapped_reduction(engine.optimizer)
    counter = install_device_skip(engine) if device_skip else None
    if counter is not None:
        log(DEVICE_SKIP_LINE)
    return counter


# --- the bf16 master partition shared with the model (--main-params-dtype bf16-remainder) -----------------------
_MASTER_ATTRS = ("single_partition_of_fp32_groups", "parallel_partitioned_bit16_groups", "real_dp_process_group",
                 "_link_all_hp_params")


def share_master_partitions(zero_optimizer) -> int:
    """Point each bf16 master partition at the model's own slice of the flat bf16 buffer (the same tensor object,
    so optimizer state keyed by it stays valid), re-link DeepSpeed's per-parameter views and let the clone go.
    With CoatAdamW's remainders the clone equals that slice at every step boundary, so DeepSpeed's copy back
    becomes a copy onto itself. Returns the bytes of clones released; raises on a layout it does not know."""
    missing = [a for a in _MASTER_ATTRS if not hasattr(zero_optimizer, a)]
    if missing:
        raise RuntimeError(f"--main-params-dtype bf16-remainder: DeepSpeed's {type(zero_optimizer).__name__} lacks "
                           f"{missing}; it needs DeepSpeed's ZeRO-1/2 optimizer (deepspeed "
                           f"{', '.join(TESTED_DEEPSPEED)}'s layout)")
    released = 0
    for i, master in enumerate(zero_optimizer.single_partition_of_fp32_groups):
        rank = dist.get_rank(group=zero_optimizer.real_dp_process_group[i])
        model_slice = zero_optimizer.parallel_partitioned_bit16_groups[i][rank]
        if master.dtype != torch.bfloat16 or model_slice.dtype != torch.bfloat16 or master.shape != model_slice.shape:
            raise RuntimeError(f"--main-params-dtype bf16-remainder: DeepSpeed's master partition {i} is "
                               f"{master.dtype} {tuple(master.shape)}, the model's slice {model_slice.dtype} "
                               f"{tuple(model_slice.shape)}; expected the same bf16 shape")
        if master.data_ptr() == model_slice.data_ptr():
            continue
        if not torch.equal(master, model_slice):
            raise RuntimeError(f"--main-params-dtype bf16-remainder: master partition {i} differs from the model's "
                               "slice; share it before the first step")
        released += master.numel() * master.element_size()
        master.data = model_slice.data
    zero_optimizer._link_all_hp_params()
    return released


# --- the gradient partition read in place ------------------------------------------------------------------------
_FLAT_ATTRS = ("_get_preflattened_grad_partition", "averaged_gradients", "partition_size")


def flat_view(tensors, numel: int) -> torch.Tensor | None:
    """A 1-D view of `numel` elements over `tensors` when they are contiguous, of one dtype, and lie one right
    after the other in one storage (in list order); None otherwise."""
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        return None
    first = tensors[0]
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for t in tensors:
        if (not t.is_contiguous() or t.dtype != first.dtype or t.device != first.device
                or t.untyped_storage().data_ptr() != storage or t.storage_offset() != offset):
            return None
        offset += t.numel()
    if offset - first.storage_offset() != numel:
        return None
    return torch.as_strided(first, (numel,), (1,), first.storage_offset())


def install_flat_grad_partition(zero_optimizer) -> bool:
    """Answer the step's `_get_preflattened_grad_partition` (DeepSpeed asks it before flattening the gradient
    list) with a view of the listed gradients when they are consecutive pieces of one storage covering the
    partition, so the step reads the same values without the copy. False where the optimizer is not DeepSpeed's
    ZeRO-1/2 one."""
    if type(zero_optimizer).__name__ != "DeepSpeedZeroOptimizer" or any(
            not hasattr(zero_optimizer, a) for a in _FLAT_ATTRS):
        return False
    own = type(zero_optimizer)._get_preflattened_grad_partition

    def preflattened(self, group_idx):
        found = own(self, group_idx)  # DeepSpeed's own pre-flattened buffers come first
        if found is not None:
            return found
        grads = self.averaged_gradients.get(group_idx)
        return flat_view(grads, int(self.partition_size[group_idx])) if isinstance(grads, list) else None

    zero_optimizer._get_preflattened_grad_partition = types.MethodType(preflattened, zero_optimizer)
    return True


# --- ZeRO-1 on one data-parallel rank: no reduction --------------------------------------------------------------
# Each must be present and false: a setting under which the boundary does more than reduce over the DP group
# (ZeRO-2's per-micro-batch partitioning, CPU offload, ZenFlow, DeepSpeed's MoE expert groups, gradients kept in
# a separate grad_accum attribute).
_MUST_BE_OFF = ("partition_gradients", "cpu_offload", "zenflow", "has_moe_layers", "use_grad_accum_attribute")


def skip_single_rank_reduction(zero_optimizer) -> bool:
    """Make ZeRO-1's boundary reduction a no-op when every group's data-parallel world is one rank (and
    DeepSpeed's own sequence parallelism is off); returns whether it did. Exact: with one rank the reduction is
    the identity and its division is by 1.0, so the step reads param.grad's values. The reduction buckets then
    receive nothing and are allocated empty."""
    zo = zero_optimizer
    if type(zo).__name__ != "DeepSpeedZeroOptimizer" or not hasattr(zo, "reduce_ready_partitions_and_remove_grads"):
        return False
    if any(getattr(zo, name, True) for name in _MUST_BE_OFF) or getattr(zo, "sequence_parallel_size", 0) != 1:
        return False
    groups = [getattr(zo, "dp_process_group", None), *getattr(zo, "real_dp_process_group", [None])]
    if not dist.is_initialized() or any(g is None or dist.get_world_size(group=g) != 1 for g in groups):
        return False
    # fp32 gradients accumulated for bf16 parameters go through DeepSpeed's separate partition buffer
    compact = getattr(zo, "_use_compact_grad_partition_buffer", None)
    if compact is None or any(compact(i) for i in range(len(zo.bit16_groups))):
        return False

    def reduce_nothing(self, param, i):  # one rank: the gradient already is the reduced gradient
        return None

    zo.reduce_ready_partitions_and_remove_grads = types.MethodType(reduce_nothing, zo)
    setup = getattr(zo, "setup_buckets", None)
    if setup is not None:
        def setup_empty_buckets(self):  # nothing is put in them (above): 0 elements, not reduce_bucket_size
            size, self.reduce_bucket_size = self.reduce_bucket_size, 0
            try:
                setup()
            finally:
                self.reduce_bucket_size = size

        zo.setup_buckets = types.MethodType(setup_empty_buckets, zo)
    return True


# --- the overlapped reduction (DeepSpeed's overlap_comm, --overlap-grad-reduce) ----------------------------------
# Settings under which DeepSpeed's epilogue or reduction does more than the bucketed all-reduce read here: CPU
# offload (its own streams and events), ZenFlow, DeepSpeed's MoE expert groups, ZeRO-1's separate fp32 accumulator.
_OVERLAP_MUST_BE_OFF = ("cpu_offload", "zenflow", "has_moe_layers", "use_grad_accum_attribute")
_OVERLAP_ATTRS = ("independent_gradient_partition_epilogue", "copy_grads_in_partition", "params_in_partition",
                  "grads_in_partition", "grads_in_partition_offset", "reduction_stream", "contiguous_gradients",
                  "use_multi_rank_bucket_allreduce", "partition_gradients", "bit16_groups")


def install_overlapped_reduction(zero_optimizer) -> bool:
    """Under overlap_comm DeepSpeed's gradient hooks copy each gradient into one of two buckets as autograd makes
    it and reduce a full bucket on its reduction stream while backward goes on (ZeRO-1: on the step's last
    micro-batch). Two changes, each keeping DeepSpeed's values; returns whether they were installed:

    - ZeRO-1 lays the reduced gradients of its partition in parameter order, as the boundary reduction does,
      instead of in the order backward makes them: the step then reads them in place (`install_flat_grad_partition`)
      and the norm sums them in the same order as without overlap;
    - on a device with a reduction stream, the end of backward waits for that stream on the device instead of
      DeepSpeed's device-wide synchronize, which made the host wait for the GPU's whole queue (and the GPU then
      idle while the host launched the step). The wait is enqueued on the compute stream before the epilogue, so
      every later use of a gradient, a partition or a bucket buffer the epilogue frees comes after the earlier
      buckets' reductions; the last bucket, with no backward left to overlap, reduces on the compute stream.

    Not installed without overlap_comm, nor where the reduction takes another path (DeepSpeed's non-contiguous or
    per-rank fallbacks, which synchronize by themselves)."""
    zo = zero_optimizer
    if type(zo).__name__ != "DeepSpeedZeroOptimizer" or not getattr(zo, "overlap_comm", False):
        return False
    if any(not hasattr(zo, a) for a in _OVERLAP_ATTRS) or any(getattr(zo, a, True) for a in _OVERLAP_MUST_BE_OFF):
        return False
    if not (zo.contiguous_gradients and zo.use_multi_rank_bucket_allreduce):
        return False
    if not zo.partition_gradients:
        _copy_in_parameter_order(zo)
    if zo.reduction_stream is not None:  # None on a synchronized device (CPU), whose epilogue does not synchronize
        _wait_instead_of_synchronize(zo)
    return True


def _copy_in_parameter_order(zo) -> None:
    """ZeRO-1's `copy_grads_in_partition` puts each reduced gradient of this rank's partition at the next free
    offset of its buffer; here at the offset it takes when the gradients come in parameter order."""
    offsets, total = {}, 0
    for group in zo.params_in_partition:
        for p in group:
            offsets[id(p)] = total
            total += p.numel()
    own = type(zo).copy_grads_in_partition

    def copy_grads_in_partition(self, param, group_idx=None):
        if id(param) in offsets:
            if self.grads_in_partition is None:  # DeepSpeed's allocation (it would restart the offset at 0)
                from deepspeed.accelerator import get_accelerator

                self.grads_in_partition = torch.empty(total, dtype=self.dtype,
                                                      device=get_accelerator().current_device_name())
            self.grads_in_partition_offset = offsets[id(param)]
        return own(self, param, group_idx)

    zo.copy_grads_in_partition = types.MethodType(copy_grads_in_partition, zo)


def _wait_instead_of_synchronize(zo) -> None:
    own = type(zo).independent_gradient_partition_epilogue

    def epilogue(self):
        from deepspeed.accelerator import get_accelerator

        compute = get_accelerator().current_stream()
        compute.wait_stream(self.reduction_stream)
        for bucket in getattr(self, "ipg_buckets", {}).values():  # the last bucket's copies, if made on other streams
            for producer in getattr(bucket, "copy_streams", ()):
                compute.wait_stream(producer)
        self.overlap_comm = False  # DeepSpeed's epilogue: no synchronize, the last bucket on the compute stream
        try:
            own(self)
        finally:
            self.overlap_comm = True

    zo.independent_gradient_partition_epilogue = types.MethodType(epilogue, zo)


# --- the non-finite check on the device (bf16) -------------------------------------------------------------------
_SKIP_ATTRS = ("check_grad_overflow", "compute_grad_norm", "get_grad_norm_direct", "unscale_and_clip_grads",
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
    """Move the engine's ZeRO-1/2 step checks to the device: DeepSpeed's `check_grad_overflow` off, the L2 norm in
    one launch, and the clip factor handed to the client optimizer as `grad_scale` with a non-finite norm setting
    its `found_inf` (torch's GradScaler protocol). None, and DeepSpeed's host check stays, where the client does
    not honour `found_inf`, the optimizer is not DeepSpeedZeroOptimizer, or the run is not bf16."""
    zero = engine.optimizer
    client = getattr(zero, "optimizer", None)
    if type(zero).__name__ != "DeepSpeedZeroOptimizer" or any(not hasattr(zero, a) for a in _SKIP_ATTRS):
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
    """DeepSpeed's `get_grad_norm_direct` for the L2 norm over the same parameters (TP shards, pipeline-replicated
    ones counted once) and with its reductions: one `_foreach_norm` launch for all tensors, or one plain reduction
    where the counted gradients are one run of memory. Both sum squares in fp32, in different orders."""
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
        factor goes to the client optimizer as `grad_scale`, which divides the gradients as it reads them, instead
        of DeepSpeed's separate in-place pass (CoatAdamW rounds as that pass; fused AdamW within an ulp)."""
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
