"""pretrain_gpt.py with a fault at a checkpoint save: the checkpoint-safety tests' fixture, kept out of the
library.

    python tests/training/checkpoint_faults.py FAULT ITERATION [pretrain_gpt.py flags]

FAULT `disk-full`: every torch.save of the save at ITERATION fails as torch's zip writer fails on a full disk.
FAULT `inf-weights`: the first weight holds Inf when the save at ITERATION begins (a corrupted optimizer step).
"""
from __future__ import annotations

import sys

import torch

import pretrain_gpt
from megacoat.training.trainer import Trainer


def inject(fault: str, iteration: int) -> None:
    save_checkpoint = Trainer.save_checkpoint

    def faulty_save(self, directory):
        if self.state.iteration != iteration:
            return save_checkpoint(self, directory)
        if fault == "inf-weights":
            with torch.no_grad():
                next(self.engine.module.parameters()).fill_(float("inf"))
            return save_checkpoint(self, directory)
        real_save = torch.save

        def full(*args, **kwargs):
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4736 vs 4630")

        torch.save = full
        try:
            return save_checkpoint(self, directory)
        finally:
            torch.save = real_save

    Trainer.save_checkpoint = faulty_save


if __name__ == "__main__":
    inject(sys.argv[1], int(sys.argv[2]))
    pretrain_gpt.main(sys.argv[3:])
    sys.exit(0)
