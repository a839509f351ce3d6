"""Training: the DeepSpeed engine set-up, the train/eval loop, logging, FLOP/MFU accounting and checkpoints."""
from megacoat.training.config import TrainingConfig

__all__ = ["Trainer", "TrainingConfig", "pretrain"]


def __getattr__(name):
    # Lazy: megacoat.config imports TrainingConfig from here, and the trainer imports megacoat.config.
    if name in ("Trainer", "pretrain"):
        from megacoat.training import trainer

        return getattr(trainer, name)
    raise AttributeError(name)
