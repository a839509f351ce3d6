"""Blending: several datasets mixed in fixed proportions, interleaved evenly rather than drawn at random."""
from __future__ import annotations

import numpy as np


def blend_indices(weights: list[float], num_samples: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dataset_index, dataset_sample_index, counts) for num_samples blended samples.

    Dataset d's k-th sample is placed at time (k + 0.5) / w_d and samples are served in time order, so every
    prefix of the blend holds each dataset within one sample of its share (Megatron's greedy error rule gives
    the same property; this form is a sort, not a Python loop).
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or np.any(~np.isfinite(w)) or np.any(w <= 0):
        raise ValueError(f"blend weights must be positive numbers, got {list(weights)}")
    w = w / w.sum()
    # Enough candidates from each dataset: the num_samples-th time is at most num_samples + len(w) / 2.
    per = np.ceil(w * num_samples).astype(np.int64) + len(w) + 1
    times = np.concatenate([(np.arange(n) + 0.5) / wd for n, wd in zip(per, w)])
    which = np.repeat(np.arange(len(w)), per)
    local = np.concatenate([np.arange(n) for n in per])
    order = np.lexsort((which, times))[:num_samples]  # ties go to the lower dataset index
    dataset_index, sample_index = which[order], local[order]
    counts = np.bincount(dataset_index, minlength=len(w))
    return dataset_index.astype(np.int16 if len(w) < 2**15 else np.int64), sample_index, counts


class BlendedDataset:
    def __init__(self, datasets: list, weights: list[float], num_samples: int):
        self.datasets, self.num_samples = datasets, num_samples
        self.dataset_index, self.dataset_sample_index, counts = blend_indices(weights, num_samples)
        for d, (ds, n) in enumerate(zip(datasets, counts)):
            if len(ds) < n:
                raise ValueError(f"blended dataset {d} has {len(ds)} samples but the blend needs {n}")

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        return self.datasets[self.dataset_index[i]][int(self.dataset_sample_index[i])]
