"""Pretrain a Llama-style GPT with megacoat.

    python pretrain_gpt.py                                   # tiny model on the embedded default corpus
    deepspeed --num_gpus 8 pretrain_gpt.py --num-layers 24 --hidden-size 2048 ... --data-path my_text_document
    deepspeed --num_gpus 8 pretrain_gpt.py ... --coat-fp8    # FP8 optimizer states + FP8 activations

`python pretrain_gpt.py --help` lists every flag. Bad input (flags, data shards, checkpoints, parallel sizes)
stops with one `error:` line and exit status 1; `--debug` or MEGACOAT_DEBUG=1 shows the traceback instead.
"""
from __future__ import annotations

import gc
import sys

from megacoat.arguments import parse_config


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_config(argv)  # bad flags stop here, before any work
    from megacoat.training.errors import INPUT_ERRORS, one_line_errors
    from megacoat.training.distributed import shutdown_distributed
    from megacoat.training.stability import NonFiniteTrainingError
    from megacoat.training.trainer import Trainer, check_data_paths

    debug = cfg.training.debug
    with one_line_errors(INPUT_ERRORS, debug):  # set-up: everything here checks what the user gave
        check_data_paths(cfg)  # a missing shard or tokenizer file stops before any work
        trainer = Trainer(cfg)
    # Training: the guard's stop (checkpoints intact) and file-system errors of saves; anything else is a bug.
    with one_line_errors((NonFiniteTrainingError, OSError), debug):
        history = trainer.train()
    # Free the engine (its buffers and the work handles of its collectives) while the process group is alive,
    # then leave the group: left to interpreter exit, a rank aborted after training in ~1 of 4 two-rank CPU runs.
    del trainer
    gc.collect()
    shutdown_distributed()
    return history


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
