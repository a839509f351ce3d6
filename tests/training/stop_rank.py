"""pretrain_gpt.py with one rank stopping (SIGSTOP, as a hung or frozen process) before a chosen iteration: the
stopped-rank test's fixture, kept out of the library's training loop.

    STOP_RANK_AT=RANK:ITERATION python tests/training/stop_rank.py [pretrain_gpt.py flags]

RANK stops itself before computing ITERATION (1-based); the other ranks go on into the step's collectives. (An
environment variable, since DeepSpeed's launcher puts --local_rank before the script's own arguments.)
"""
from __future__ import annotations

import os
import signal
import sys

import torch.distributed as dist

import pretrain_gpt
from megacoat.training.trainer import Trainer


def stop_at(rank: int, iteration: int) -> None:
    train_step = Trainer.train_step

    def stopping_train_step(self, data_iter):
        if self.state.iteration + 1 == iteration and dist.get_rank() == rank:
            print(f"rank {rank} stops before iteration {iteration}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        return train_step(self, data_iter)

    Trainer.train_step = stopping_train_step


if __name__ == "__main__":
    rank, iteration = os.environ["STOP_RANK_AT"].split(":")
    stop_at(int(rank), int(iteration))
    pretrain_gpt.main(sys.argv[1:])
    sys.exit(0)
