"""One copy of the bf16 weights under --main-params-dtype bf16-remainder.

DeepSpeed's ZeRO-1/2 optimizer (0.19.8, `bf16.bf16_master_weights_and_grads`) hands the client optimizer a "master"
partition of this rank's slice of the weights in bf16, cloned from the model's flat bf16 buffer, and after every
step copies it back into that buffer. With CoatAdamW's remainders that clone holds exactly the model's bf16 values
at every step boundary: 2 redundant bytes per parameter of the partition. `share_master_partitions` makes the
optimizer's partition a view of the model's own slice (the same tensor object, so the optimizer's state keyed by it
stays valid), re-links DeepSpeed's per-parameter views of it (`_link_all_hp_params`, what DeepSpeed itself calls
after loading a checkpoint) and lets the clone be freed. DeepSpeed's copy back becomes a copy onto itself, and a
checkpoint load writes the saved partition into the model's slice, which holds the same values.

It uses DeepSpeedZeroOptimizer's attributes by name (`single_partition_of_fp32_groups`,
`parallel_partitioned_bit16_groups`, `real_dp_process_group`); a DeepSpeed without them is a clear error here.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_ATTRS = ("single_partition_of_fp32_groups", "parallel_partitioned_bit16_groups", "real_dp_process_group",
          "_link_all_hp_params")


def share_master_partitions(zero_optimizer) -> int:
    """Point each bf16 master partition at the model's slice; returns the bytes of clones released."""
    missing = [a for a in _ATTRS if not hasattr(zero_optimizer, a)]
    if missing:
        raise RuntimeError(f"--main-params-dtype bf16-remainder: DeepSpeed's {type(zero_optimizer).__name__} lacks "
                           f"{missing}; it needs DeepSpeed's ZeRO-1/2 optimizer (deepspeed 0.19.8's layout)")
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
