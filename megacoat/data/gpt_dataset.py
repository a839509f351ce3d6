"""GPT samples: documents packed back to back into `seq_length + 1`-token samples, shuffled by seed, over epochs.

Three index arrays, as in Megatron's GPTDataset, describe the packing:
  doc_idx      the documents of each epoch, each epoch in its own seeded order, epochs concatenated;
  sample_idx   where sample s starts: (position in doc_idx, token offset in that document); sample s covers
               tokens [s * seq_length, s * seq_length + seq_length] of the concatenated stream, so consecutive
               samples share one token (the last label of one is the first input of the next);
  shuffle_idx  the order samples are served in: each epoch's samples are shuffled among themselves, so every
               sample of epoch e is seen before any of epoch e + 1.
Building them is vectorized numpy; they are cached as .npy files keyed by everything they depend on and
memory-mapped on later runs.
"""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from megacoat.data.indexed_dataset import IndexedDataset, data_file_path, index_file_path

INDEX_CACHE_VERSION = 1


class GPTDataset:
    """Samples of `seq_length + 1` tokens (int64) from documents [doc_start, doc_stop) of an IndexedDataset."""

    def __init__(self, indexed: IndexedDataset, doc_start: int, doc_stop: int, seq_length: int, num_samples: int,
                 seed: int, *, cache_dir: str | None = None, name: str = "train"):
        if seq_length < 1 or num_samples < 1:
            raise ValueError(f"seq_length and num_samples must be >= 1, got {seq_length} and {num_samples}")
        if not 0 <= doc_start <= doc_stop <= len(indexed):
            raise ValueError(f"document range [{doc_start}, {doc_stop}) outside {indexed.prefix!r} "
                             f"({len(indexed)} documents)")
        self.indexed, self.seq_length, self.num_samples, self.name = indexed, seq_length, num_samples, name
        lengths = indexed.sequence_lengths[doc_start:doc_stop]
        tokens = int(lengths.sum(dtype=np.int64))
        if tokens < seq_length + 1:
            raise ValueError(f"the {name} split of {indexed.prefix!r} holds {tokens} tokens in "
                             f"{doc_stop - doc_start} documents, fewer than one sample of seq_length + 1 = "
                             f"{seq_length + 1}; give it a larger share with --split or use more data")
        desc = dict(version=INDEX_CACHE_VERSION, prefix=os.path.abspath(indexed.prefix),
                    idx=_file_stamp(index_file_path(indexed.prefix)), bin=_file_stamp(data_file_path(indexed.prefix)),
                    doc_start=doc_start, doc_stop=doc_stop, seq_length=seq_length, num_samples=num_samples,
                    seed=seed, name=name)
        arrays = _load_or_build(cache_dir, desc, lambda: build_gpt_indices(
            indexed.sequence_lengths, doc_start, doc_stop, seq_length, num_samples, seed))
        self.doc_idx, self.sample_idx, self.shuffle_idx = arrays
        # Mapped straight from the files (no per-rank copies of per-document arrays).
        self._lengths, self._pointers = indexed.sequence_lengths, indexed.sequence_pointers
        self._tokens = indexed.tokens
        self._itemsize = indexed.dtype.itemsize

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        if not -self.num_samples <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for a {self.name} dataset of {self.num_samples}")
        j, offset = self.sample_idx[self.shuffle_idx[i]].tolist()
        need = self.seq_length + 1
        doc = int(self.doc_idx[j])
        start = int(self._pointers[doc]) // self._itemsize + offset
        if offset + need <= self._lengths[doc]:  # the common case: one document holds the whole sample
            return self._tokens[start:start + need].astype(np.int64)
        out = np.empty(need, np.int64)
        filled = 0
        while filled < need:
            n = min(int(self._lengths[doc]) - offset, need - filled)
            out[filled:filled + n] = self._tokens[start:start + n]
            filled += n
            j, offset = j + 1, 0
            if filled < need:
                doc = int(self.doc_idx[j])
                start = int(self._pointers[doc]) // self._itemsize
        return out


def build_gpt_indices(lengths: np.ndarray, doc_start: int, doc_stop: int, seq_length: int, num_samples: int,
                      seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(doc_idx, sample_idx, shuffle_idx) for num_samples samples: see the module docstring."""
    docs = np.arange(doc_start, doc_stop, dtype=np.int64)
    tokens_per_epoch = int(lengths[doc_start:doc_stop].sum(dtype=np.int64))
    # Fewest epochs whose stream holds num_samples samples: the stream needs num_samples * L + 1 tokens.
    num_epochs = -(-(num_samples * seq_length + 1) // tokens_per_epoch)
    rng = np.random.default_rng(seed)
    index_dtype = np.int32 if doc_stop < 2**31 else np.int64
    doc_idx = np.concatenate([rng.permutation(docs) for _ in range(num_epochs)]).astype(index_dtype)

    ends = np.cumsum(lengths[doc_idx], dtype=np.int64)  # token position where each doc_idx entry ends
    total_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    starts = np.arange(total_samples, dtype=np.int64) * seq_length
    pos = np.searchsorted(ends, starts, side="right")  # first document ending after the start: skips empty ones
    offset = starts - np.where(pos > 0, ends[np.maximum(pos - 1, 0)], 0)
    sample_idx = np.stack([pos, offset], axis=1).astype(np.int64)

    # Shuffle within each epoch: sample s belongs to the epoch its first token is in.
    epoch_of_sample = starts // tokens_per_epoch
    bounds = np.searchsorted(epoch_of_sample, np.arange(num_epochs + 1), side="left")
    shuffle_idx = np.concatenate([lo + rng.permutation(hi - lo) for lo, hi in zip(bounds[:-1], bounds[1:])])
    return doc_idx, sample_idx, shuffle_idx[:num_samples].astype(np.int64)


class MockGPTDataset:
    """Random tokens in [0, vocab_size), reproducible per (seed, index): pipelines and benchmarks without data."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int, name: str = "train"):
        if vocab_size is None or vocab_size < 1:
            raise ValueError(f"mock data needs a vocab_size >= 1, got {vocab_size}")
        self.num_samples, self.seq_length, self.vocab_size, self.seed, self.name = (
            num_samples, seq_length, vocab_size, seed, name)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for a mock {self.name} dataset of {self.num_samples}")
        rng = np.random.default_rng([self.seed, i])
        return rng.integers(0, self.vocab_size, self.seq_length + 1, dtype=np.int64)


def _file_stamp(path: str) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns]


def _load_or_build(cache_dir: str | None, desc: dict, build):
    """Index arrays from `cache_dir` if built before with the same description, else built (and saved)."""
    if cache_dir is None:
        return build()
    key = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:24]
    base = os.path.join(cache_dir, f"{desc['name']}-{key}")
    names = ("doc_idx", "sample_idx", "shuffle_idx")
    paths = [f"{base}-{n}.npy" for n in names]
    if all(os.path.isfile(p) for p in paths):
        return tuple(np.load(p, mmap_mode="r") for p in paths)
    arrays = build()
    os.makedirs(cache_dir, exist_ok=True)
    # Each file lands whole (temp + rename); ranks building at once write identical contents.
    for p, a in zip(paths, arrays):
        tmp = f"{p}.tmp-{os.getpid()}.npy"
        np.save(tmp, a)
        os.replace(tmp, p)
    tmp = f"{base}.json.tmp-{os.getpid()}"
    with open(tmp, "w") as f:  # what the arrays were built from, for a person looking at the cache
        json.dump(desc, f, indent=1)
    os.replace(tmp, base + ".json")
    return arrays
