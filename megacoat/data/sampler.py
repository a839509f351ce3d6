"""Data-parallel batches in Megatron's order, resumable from the global count of consumed samples."""
from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import DataLoader


class MegatronPretrainingSampler:
    """Yields index lists of micro_batch_size: global step k covers samples [k * G, (k + 1) * G) with
    G = micro_batch_size * dp_size, and rank r takes [r * mbs, (r + 1) * mbs) of it.

    Starting at `consumed_samples` (a multiple of G) reproduces exactly the batches an uninterrupted run
    would have seen from there. It never ends: index g reads sample g % len(dataset), and the dataset
    already holds its epochs in order.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int):
        if total_samples < 1:
            raise ValueError(f"the dataset is empty (total_samples={total_samples})")
        if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"bad sampler arguments: micro_batch_size={micro_batch_size}, dp_rank={dp_rank}, "
                             f"dp_size={dp_size}")
        step = micro_batch_size * dp_size
        if consumed_samples < 0 or consumed_samples % step:
            raise ValueError(f"consumed_samples={consumed_samples} must be a non-negative multiple of "
                             f"micro_batch_size * dp_size = {step}")
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.micro_batch_size, self.dp_rank, self.step = micro_batch_size, dp_rank, step

    def __iter__(self):
        start = self.consumed_samples + self.dp_rank * self.micro_batch_size
        while True:
            yield [(start + i) % self.total_samples for i in range(self.micro_batch_size)]
            start += self.step


def _collate(samples: list[np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(np.stack(samples))


def build_pretraining_data_loader(dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int,
                                  dp_size: int, num_workers: int = 0, *, pin_memory: bool | None = None):
    """An endless iterable of LongTensor [micro_batch_size, seq_length + 1]; None for a None dataset."""
    if dataset is None:
        return None
    sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    return DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers, collate_fn=_collate,
                      pin_memory=pin_memory, persistent_workers=num_workers > 0)
