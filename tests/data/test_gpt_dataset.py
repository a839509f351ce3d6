"""Packing, shuffling, epochs and the index cache of GPTDataset."""
import os

import numpy as np
import pytest

from megacoat.data.gpt_dataset import GPTDataset, MockGPTDataset, build_gpt_indices
from megacoat.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter


def make_indexed(path, lengths, dtype=np.int32):
    """Documents whose tokens name them: doc d holds d * 1000 + position, so a sample shows its sources."""
    with IndexedDatasetWriter(str(path), dtype) as w:
        for d, n in enumerate(lengths):
            w.add_document(d * 1000 + np.arange(n))
    return IndexedDataset(str(path))


LENGTHS = [5, 17, 1, 0, 30, 8, 12, 3, 40, 9]  # an empty document on purpose


@pytest.fixture
def indexed(tmp_path):
    return make_indexed(tmp_path / "docs", LENGTHS)


def test_samples_pack_the_shuffled_document_stream(indexed):
    seq, n = 16, 40
    ds = GPTDataset(indexed, 0, len(LENGTHS), seq, n, seed=3)
    stream = np.concatenate([indexed[int(d)] for d in ds.doc_idx])
    served = set()
    for i in range(n):
        s = ds[i]
        assert s.dtype == np.int64 and s.shape == (seq + 1,)
        k = int(ds.shuffle_idx[i])
        assert np.array_equal(s, stream[k * seq:k * seq + seq + 1])  # consecutive samples share one token
        served.add(k)
    assert len(served) == n
    epoch_docs = len(LENGTHS)
    for e in range(len(ds.doc_idx) // epoch_docs):  # every epoch is a permutation of all documents
        assert sorted(ds.doc_idx[e * epoch_docs:(e + 1) * epoch_docs]) == list(range(epoch_docs))


def test_epochs_are_served_in_order(indexed):
    seq, n = 16, 60  # 125 tokens per epoch: about 7.8 samples each, so several epochs
    ds = GPTDataset(indexed, 0, len(LENGTHS), seq, n, seed=0)
    tokens_per_epoch = sum(LENGTHS)
    epoch = np.asarray(ds.shuffle_idx) * seq // tokens_per_epoch
    assert epoch.max() >= 5 and np.all(np.diff(epoch) >= 0)
    assert not np.array_equal(ds.shuffle_idx, np.sort(ds.shuffle_idx))  # shuffled within epochs


def test_determinism_by_seed(indexed):
    a = GPTDataset(indexed, 0, 10, 8, 30, seed=1)
    b = GPTDataset(indexed, 0, 10, 8, 30, seed=1)
    c = GPTDataset(indexed, 0, 10, 8, 30, seed=2)
    assert all(np.array_equal(a[i], b[i]) for i in range(30))
    assert not all(np.array_equal(a[i], c[i]) for i in range(30))


def test_document_range(indexed):
    ds = GPTDataset(indexed, 4, 9, 8, 20, seed=0)
    docs = {int(t) // 1000 for i in range(20) for t in ds[i]}
    assert docs <= {4, 5, 6, 7, 8}


def test_index_cache_is_reused_and_keyed(indexed, tmp_path):
    cache = str(tmp_path / "cache")
    a = GPTDataset(indexed, 0, 10, 8, 30, seed=1, cache_dir=cache)
    files = sorted(os.listdir(cache))
    assert len(files) == 4 and not isinstance(a.doc_idx, np.memmap)
    b = GPTDataset(indexed, 0, 10, 8, 30, seed=1, cache_dir=cache)
    assert isinstance(b.doc_idx, np.memmap) and sorted(os.listdir(cache)) == files
    assert all(np.array_equal(a[i], b[i]) for i in range(30))
    GPTDataset(indexed, 0, 10, 8, 30, seed=2, cache_dir=cache)  # another seed: its own entry
    assert len(os.listdir(cache)) == 8


def test_too_few_tokens_is_an_error(indexed):
    with pytest.raises(ValueError, match=r"valid split .* holds 5 tokens"):
        GPTDataset(indexed, 0, 1, 8, 10, seed=0, name="valid")  # doc 0 alone: 5 tokens < 9


def test_indices_scale(indexed):
    lengths = np.random.default_rng(0).integers(0, 3000, 200_000).astype(np.int32)
    doc_idx, sample_idx, shuffle_idx = build_gpt_indices(lengths, 0, len(lengths), 2048, 500_000, seed=0)
    assert len(shuffle_idx) == 500_000 and shuffle_idx.max() < len(sample_idx)


def test_mock_data_is_reproducible():
    ds = MockGPTDataset(10, 32, vocab_size=100, seed=5)
    assert ds[3].shape == (33,) and ds[3].max() < 100 and np.array_equal(ds[3], MockGPTDataset(10, 32, 100, 5)[3])
    with pytest.raises(IndexError):
        ds[10]
