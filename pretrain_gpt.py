"""Pretrain a Llama-style GPT with megacoat.

    python pretrain_gpt.py                                   # tiny model on the embedded default corpus
    deepspeed --num_gpus 8 pretrain_gpt.py --num-layers 24 --hidden-size 2048 ... --data-path my_text_document
    deepspeed --num_gpus 8 pretrain_gpt.py ... --coat-fp8    # FP8 optimizer states + FP8 activations

`python pretrain_gpt.py --help` lists every flag.
"""
from __future__ import annotations

import sys

from megacoat.arguments import parse_config


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_config(argv)  # bad flags stop here, before any work
    from megacoat.training.trainer import check_data_paths, pretrain

    try:
        check_data_paths(cfg)  # a missing shard or tokenizer file also stops before any work
    except FileNotFoundError as e:
        raise SystemExit(f"error: {e}") from None
    from megacoat.training.checkpointing import CheckpointMismatchError
    from megacoat.training.stability import NonFiniteTrainingError

    try:
        return pretrain(cfg)
    except NonFiniteTrainingError as e:  # the guard's stop: a message, not a traceback; checkpoints intact
        raise SystemExit(f"error: {e}") from None
    except CheckpointMismatchError as e:  # --load names a checkpoint these flags cannot resume
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
