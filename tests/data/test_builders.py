"""From DataConfig to datasets: --data-path parsing and blending, --split, mock data, clear errors."""
import os

import numpy as np
import pytest

from megacoat.data.blended_dataset import blend_indices
from megacoat.data.builders import build_train_valid_test_datasets, check_token_ids, split_ranges
from megacoat.data.config import DataConfig, parse_data_path
from megacoat.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from tests.data.test_gpt_dataset import make_indexed


def test_parse_data_path():
    assert parse_data_path(["a"]) == (None, ["a"])
    assert parse_data_path(["a", "b"]) == (None, ["a", "b"])
    assert parse_data_path(["0.7", "a", "0.3", "b"]) == ([0.7, 0.3], ["a", "b"])
    for bad, msg in ([["0.7", "a", "0.3"], "pairs"], [["a", "0.3"], "mixes"], [["-1", "a"], "positive"],
                     [[], "empty"]):
        with pytest.raises(ValueError, match=msg):
            parse_data_path(bad)
    with pytest.raises(ValueError, match="pairs"):  # caught when the config is built from the command line
        DataConfig(data_path=["0.5", "a", "b"])


def test_split_ranges_cover_documents_in_order():
    assert split_ranges(1000, "969,30,1") == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges(10, "1") == [(0, 10), (10, 10), (10, 10)]
    assert split_ranges(7, "98,2,0") == [(0, 7), (7, 7), (7, 7)]  # rounding: the tail absorbs the difference


@pytest.mark.parametrize("weights", [[0.7, 0.3], [0.5, 0.3, 0.2], [0.999, 0.001]])
def test_blend_ratios_within_one_sample_at_every_prefix(weights):
    n = 5000
    dataset_index, sample_index, counts = blend_indices(weights, n)
    w = np.array(weights) / sum(weights)
    running = np.zeros((n, len(w)))
    running[np.arange(n), dataset_index] = 1
    running = np.cumsum(running, axis=0)
    assert np.abs(running - np.outer(np.arange(1, n + 1), w)).max() < 1.0
    for d in range(len(w)):  # each dataset's samples are taken in its own order, none twice
        assert np.array_equal(sample_index[dataset_index == d], np.arange(counts[d]))


@pytest.fixture
def two_corpora(tmp_path):
    rng = np.random.default_rng(0)
    a = make_indexed(tmp_path / "a", rng.integers(1, 60, 200))              # tokens < 200_000
    with IndexedDatasetWriter(str(tmp_path / "b"), np.int32) as w:         # tokens >= 10**6: source is visible
        for n in rng.integers(1, 60, 100):
            w.add_document(10**6 + np.arange(n))
    return a.prefix, str(tmp_path / "b")


def test_blended_train_valid_test(two_corpora, tmp_path):
    a, b = two_corpora
    cfg = DataConfig(data_path=["0.7", a, "0.3", b], split="90,8,2", cache_dir=str(tmp_path / "cache"))
    train, valid, test = build_train_valid_test_datasets(cfg, 16, 2000, 100, 10, seed=1)
    assert (len(train), len(valid), len(test)) == (2000, 100, 10)
    from_b = np.array([train[i][0] >= 10**6 for i in range(2000)])
    assert abs(from_b.mean() - 0.3) < 1 / 2000 + 1e-9
    # Splits are disjoint document ranges: valid samples only come from valid documents of each corpus.
    lo, hi = split_ranges(200, "90,8,2")[1]
    docs_a = {int(t) // 1000 for i in range(100) for t in valid[i] if t < 10**6}
    assert docs_a and docs_a <= set(range(lo, hi))
    again = build_train_valid_test_datasets(cfg, 16, 2000, 100, 10, seed=1)[0]
    assert all(np.array_equal(train[i], again[i]) for i in range(0, 2000, 97))


def test_eval_seed_fixes_validation_samples_across_training_seeds(two_corpora, tmp_path):
    a, _ = two_corpora
    cfg = DataConfig(data_path=[a], split="80,20", cache_dir=str(tmp_path / "cache"))
    runs = [build_train_valid_test_datasets(cfg, 16, 200, 50, 0, seed=s, eval_seed=0) for s in (1, 2)]
    (train1, valid1, _), (train2, valid2, _) = runs
    assert all(np.array_equal(valid1[i], valid2[i]) for i in range(50))
    assert not all(np.array_equal(train1[i], train2[i]) for i in range(200))
    default = build_train_valid_test_datasets(cfg, 16, 200, 50, 0, seed=2)[1]  # eval_seed defaults to seed
    assert not all(np.array_equal(default[i], valid1[i]) for i in range(50))


def test_unweighted_prefixes_blend_by_size(two_corpora):
    a, b = two_corpora
    cfg = DataConfig(data_path=[a, b], split="1")
    train, valid, test = build_train_valid_test_datasets(cfg, 16, 1000, 0, 0, seed=0)
    assert valid is None and test is None
    from_b = np.mean([train[i][0] >= 10**6 for i in range(1000)])
    ta, tb = (IndexedDataset(p).num_tokens for p in (a, b))
    assert abs(from_b - tb / (ta + tb)) < 0.01


def test_requested_split_without_data_is_an_error(two_corpora):
    a, _ = two_corpora
    with pytest.raises(ValueError, match="gives valid no data"):
        build_train_valid_test_datasets(DataConfig(data_path=[a], split="100,0,0"), 16, 10, 5, 0, seed=0)
    with pytest.raises(ValueError, match="test split of .* gets none of its 200 documents"):
        build_train_valid_test_datasets(DataConfig(data_path=[a], split="10000,0,1"), 16, 10, 0, 5, seed=0)
    short_tail = make_indexed(os.path.join(os.path.dirname(a), "tail"), [50] * 9 + [3]).prefix
    with pytest.raises(ValueError, match="test split .* 3 tokens in 1 documents, fewer than one sample"):
        build_train_valid_test_datasets(DataConfig(data_path=[short_tail], split="9,0,1"), 16, 10, 0, 5, seed=0)


def test_small_data_with_the_default_split_names_the_flag(tmp_path):
    """10 documents: 969,30,1 rounds the valid split to none of them."""
    small = make_indexed(tmp_path / "small", [50] * 10).prefix
    with pytest.raises(ValueError, match=r"--split 969,30,1: the valid split of .* gets none of its 10 documents; "
                                         r"give it a larger share \(e.g. --split 90,10,0\), or --eval-iters 0"):
        build_train_valid_test_datasets(DataConfig(data_path=[small]), 16, 10, 5, 0, seed=0)
    train, valid, _ = build_train_valid_test_datasets(DataConfig(data_path=[small], split="90,10,0"), 16, 10, 5, 0,
                                                      seed=0)
    assert len(train) == 10 and len(valid) == 5


def test_token_ids_beyond_the_vocabulary_name_the_flag(tmp_path):
    prefix = make_indexed(tmp_path / "d", [20, 30]).prefix  # ids up to 1000 + 29
    cfg = DataConfig(data_path=[prefix], split="1,1,0", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"--vocab-size 1000 is too small for .*d.bin: its largest token id is "
                                         r"1029; pass --vocab-size 1030 or more"):
        build_train_valid_test_datasets(cfg, 8, 4, 0, 0, seed=0, vocab_size=1000)
    assert build_train_valid_test_datasets(cfg, 8, 4, 0, 0, seed=0, vocab_size=1030)[0] is not None
    cached = [n for n in os.listdir(tmp_path / "cache" / "index") if n.startswith("max_token_id-")]
    assert len(cached) == 1


def test_largest_token_id_is_read_once_per_shard(tmp_path, monkeypatch):
    prefix = make_indexed(tmp_path / "d", [20, 30]).prefix
    calls = []
    original = IndexedDataset.max_token_id
    monkeypatch.setattr(IndexedDataset, "max_token_id", lambda self: calls.append(1) or original(self))
    cache = str(tmp_path / "cache")
    for _ in range(3):
        check_token_ids(IndexedDataset(prefix), 2000, cache)
    assert len(calls) == 1
    make_indexed(tmp_path / "d", [20, 31])  # rewritten: another size, so the cached value is not reused
    with pytest.raises(ValueError, match="largest token id is 1030"):
        check_token_ids(IndexedDataset(prefix), 1030, cache)
    assert len(calls) == 2
    # uint8 ids are all below a vocabulary of 256 or more: nothing to read
    with IndexedDatasetWriter(str(tmp_path / "u8"), np.uint8) as w:
        w.add_document(np.arange(256))
    check_token_ids(IndexedDataset(str(tmp_path / "u8")), 256, cache)
    assert len(calls) == 2


def test_mock_and_missing_data():
    train, valid, test = build_train_valid_test_datasets(DataConfig(mock_data=True), 8, 10, 4, 0, seed=0,
                                                         vocab_size=50)
    assert len(train) == 10 and len(valid) == 4 and test is None and train[0].max() < 50
    assert not np.array_equal(train[0], valid[0])
    with pytest.raises(ValueError, match="vocab_size"):
        build_train_valid_test_datasets(DataConfig(mock_data=True), 8, 10, 0, 0, seed=0)
    with pytest.raises(ValueError, match="no --data-path"):
        build_train_valid_test_datasets(DataConfig(), 8, 10, 0, 0, seed=0)
    with pytest.raises(FileNotFoundError, match="missing"):
        build_train_valid_test_datasets(DataConfig(data_path=["/nonexistent/x"]), 8, 10, 0, 0, seed=0)
