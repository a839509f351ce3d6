"""pretrain_gpt.py with a NaN injected into the loss at chosen iterations: the stability tests' fixture, kept
out of the library's training loop.

    python tests/training/nan_injection.py ITERATIONS [pretrain_gpt.py flags]

ITERATIONS: comma-separated, 1-based (the iteration being computed), e.g. `3,5`. During those steps the
model's loss function returns its loss times NaN on every rank, so backward fills every gradient with NaN, as
a diverging step would; the trainer itself is not changed.
"""
from __future__ import annotations

import sys

import pretrain_gpt
from megacoat.training.trainer import Trainer


def inject_nan_at(iterations: set[int]) -> None:
    train_step = Trainer.train_step

    def poisoned_train_step(self, data_iter):
        if self.state.iteration + 1 not in iterations:
            return train_step(self, data_iter)
        head = self.engine.module.head
        loss = head.loss
        head.loss = lambda logits, labels: loss(logits, labels) * float("nan")  # shadows the method
        try:
            return train_step(self, data_iter)
        finally:
            del head.loss

    Trainer.train_step = poisoned_train_step


if __name__ == "__main__":
    inject_nan_at({int(i) for i in sys.argv[1].split(",")})
    pretrain_gpt.main(sys.argv[2:])
    sys.exit(0)
