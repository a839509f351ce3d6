"""Training: the DeepSpeed engine set-up, the train/eval loop, logging, FLOP/MFU accounting and checkpoints."""
from megacoat.training.trainer import Trainer, pretrain

__all__ = ["Trainer", "pretrain"]
