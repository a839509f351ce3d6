"""Pretrain a Llama-style GPT with megacoat.

    python pretrain_gpt.py                                   # tiny model on the embedded default corpus
    deepspeed --num_gpus 8 pretrain_gpt.py --num-layers 24 --hidden-size 2048 ... --data-path my_text_document
    deepspeed --num_gpus 8 pretrain_gpt.py ... --coat-fp8    # FP8 optimizer states + FP8 activations

`python pretrain_gpt.py --help` lists every flag. Bad input (flags, data shards, checkpoints, parallel sizes)
stops with one `error:` line and exit status 1; `--debug` or MEGACOAT_DEBUG=1 shows the traceback instead.
"""
from __future__ import annotations

import gc
import os
import sys
import tempfile

from megacoat.arguments import parse_config

PSEUDO_FILE_SYSTEMS = ("/proc", "/sys", "/dev")


def check_save_dir(save: str | None) -> None:
    """Fail before any work when --save cannot hold checkpoints: under a pseudo file system, a file, or a
    directory that cannot be created or written (tried: a probe file is created and removed)."""
    if save is None:
        return
    real = os.path.realpath(save)
    for fs in PSEUDO_FILE_SYSTEMS:
        if real == fs or real.startswith(fs + os.sep):
            raise ValueError(f"--save {save}: under {fs}, a pseudo file system, not a place for checkpoints")
    if os.path.exists(real) and not os.path.isdir(real):
        raise ValueError(f"--save {save}: is a file, not a directory")
    try:
        os.makedirs(real, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=real)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"--save {save}: cannot write checkpoints there ({e.strerror or e})") from None


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_config(argv)  # bad flags stop here, before any work
    from megacoat.training.errors import INPUT_ERRORS, one_line_errors
    from megacoat.training.distributed import StalledRankError, shutdown_distributed, stalled_rank_errors
    from megacoat.training.stability import NonFiniteTrainingError
    from megacoat.training.trainer import Trainer, check_data_paths

    debug = cfg.training.debug
    stalled = stalled_rank_errors(cfg.training.distributed_timeout_minutes)
    with one_line_errors(INPUT_ERRORS + (StalledRankError,), debug), stalled:
        # set-up: everything here checks what the user gave
        check_save_dir(cfg.training.save)  # a --save that cannot be written stops before the model is built
        check_data_paths(cfg)  # a missing shard or tokenizer file stops before any work
        trainer = Trainer(cfg)
    # Training: the guard's stop (checkpoints intact), file-system errors of saves and a stopped rank; anything
    # else is a bug.
    stalled = stalled_rank_errors(cfg.training.distributed_timeout_minutes)
    with one_line_errors((NonFiniteTrainingError, OSError, StalledRankError), debug), stalled:
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
