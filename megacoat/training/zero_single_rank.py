"""DeepSpeed's ZeRO-1 gradient reduction skipped where there is nothing to reduce: one data-parallel rank.

At the accumulation boundary DeepSpeed 0.19.8's ZeRO-1 copies every gradient into its reduction bucket, divides
the bucket by the data-parallel world size, reduces it over the group, and copies each gradient out again into
its partition buffer (`reduce_independent_p_g_buckets_and_remove_grads`, `average_tensor`,
`copy_grads_in_partition`). With one rank the reduction is the identity and the division is by 1.0, so the step
reads param.grad's values bit for bit, after two copies of every gradient byte and a pass of division: ~6 ms a
step for 1.3 B parameters on an H100, in every mode (Megatron's DDP does nothing there).

`skip_single_rank_reduction` makes the boundary's per-parameter reduction a no-op on such an optimizer. DeepSpeed's
epilogue then lists param.grad itself as the partition's gradients; the step reads them in place where they lie
flat in one buffer (zero_flat_grads.py; own_graph_gradients lays them out so) and flattens them once otherwise.
The reduction buckets then receive nothing, so they are made empty: DeepSpeed allocates each at a step's first
gradient hook and holds it to the accumulation boundary (`setup_buckets`, `_release_ipg_buffers`;
`reduce_bucket_size`, 5e8 elements of bf16 by default, 0.93 GiB), and the boundary only narrows it to the 0
elements it holds.

It uses DeepSpeedZeroOptimizer's attributes by name; anything it does not recognise keeps DeepSpeed's own path.
"""
from __future__ import annotations

import types

import torch.distributed as dist

# Each must be present and false: a setting under which the boundary does more than reduce over the DP group
# (ZeRO-2's per-micro-batch partitioning, CPU offload, ZenFlow, DeepSpeed's MoE expert groups, gradients kept in
# a separate grad_accum attribute).
_MUST_BE_OFF = ("partition_gradients", "cpu_offload", "zenflow", "has_moe_layers", "use_grad_accum_attribute")


def skip_single_rank_reduction(zero_optimizer) -> bool:
    """Make ZeRO-1's boundary reduction a no-op when every group's data-parallel world is one rank (and
    DeepSpeed's own sequence parallelism is off); returns whether it did. Exact: see the module docstring."""
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
