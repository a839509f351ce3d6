"""Megatron's data-parallel batch order and exact resume from consumed_samples."""
import numpy as np
import pytest
import torch

from megacoat.data.sampler import MegatronPretrainingSampler, build_pretraining_data_loader


class Numbered:
    """Sample i is [i, i, ...]: batches show which samples they hold."""

    def __init__(self, n, seq=3):
        self.n, self.seq = n, seq

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.full(self.seq + 1, i, dtype=np.int64)


def take(loader, steps):
    it = iter(loader)
    return [next(it) for _ in range(steps)]


def test_megatron_order_across_ranks():
    mbs, dp = 2, 3
    loaders = [build_pretraining_data_loader(Numbered(100), 0, mbs, r, dp) for r in range(dp)]
    batches = [take(ld, 4) for ld in loaders]
    for step in range(4):
        for r in range(dp):
            b = batches[r][step]
            assert b.dtype == torch.int64 and b.shape == (mbs, 4)
            start = step * mbs * dp + r * mbs
            assert b[:, 0].tolist() == [start, start + 1]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_sees_the_same_batches(num_workers):
    ds, mbs, dp, rank = Numbered(50), 4, 2, 1
    full = take(build_pretraining_data_loader(ds, 0, mbs, rank, dp), 12)
    resumed = take(build_pretraining_data_loader(ds, 7 * mbs * dp, mbs, rank, dp, num_workers=num_workers), 5)
    assert all(torch.equal(a, b) for a, b in zip(full[7:], resumed))


def test_wraps_past_the_end():
    sampler = MegatronPretrainingSampler(10, 8, 4, 0, 1)
    it = iter(sampler)
    assert next(it) == [8, 9, 0, 1] and next(it) == [2, 3, 4, 5]


def test_bad_arguments():
    with pytest.raises(ValueError, match="multiple"):
        MegatronPretrainingSampler(10, 3, 2, 0, 2)
    with pytest.raises(ValueError, match="dp_rank"):
        MegatronPretrainingSampler(10, 0, 2, 2, 2)
    with pytest.raises(ValueError, match="empty"):
        MegatronPretrainingSampler(0, 0, 2, 0, 1)
    assert build_pretraining_data_loader(None, 0, 2, 0, 1) is None
