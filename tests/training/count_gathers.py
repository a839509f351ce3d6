"""pretrain_gpt.py with every all-gather counted: the bytes each rank sends (its input tensor), per dtype, written
as JSON to $GATHER_COUNT_DIR/gathers_rank{R}.json when the run ends; the test fixture for ZeRO-3's FP8 weight
gather (a directory from the environment: DeepSpeed's launcher puts --local_rank before the arguments).

    GATHER_COUNT_DIR=DIR python tests/training/count_gathers.py [pretrain_gpt.py flags]

torch.distributed.all_gather_into_tensor is wrapped before DeepSpeed binds it, so DeepSpeed's bf16 gathers and
megacoat's FP8 ones are both counted.
"""
from __future__ import annotations

import collections
import json
import os
import sys

import torch.distributed as dist

SENT: collections.Counter = collections.Counter()


def count_all_gathers() -> None:
    gather = dist.all_gather_into_tensor

    def counted(output_tensor, input_tensor, *args, **kwargs):
        SENT[str(input_tensor.dtype).removeprefix("torch.")] += input_tensor.numel() * input_tensor.element_size()
        return gather(output_tensor, input_tensor, *args, **kwargs)

    dist.all_gather_into_tensor = counted


def write_counts(out_dir: str) -> None:
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(out_dir, f"gathers_rank{rank}.json"), "w") as f:
        json.dump(dict(SENT), f)


if __name__ == "__main__":
    count_all_gathers()
    import pretrain_gpt

    try:
        pretrain_gpt.main(sys.argv[1:])
    finally:
        write_counts(os.environ["GATHER_COUNT_DIR"])
    sys.exit(0)
