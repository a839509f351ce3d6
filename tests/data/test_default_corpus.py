"""The embedded stdlib corpus: built once through the preprocessing tools, reused, rebuilt if interrupted."""
import os

import numpy as np
import pytest

from megacoat.data import default_corpus
from megacoat.data.default_corpus import prepare_default_corpus, stdlib_source_files
from megacoat.data.indexed_dataset import IndexedDataset
from megacoat.data.tokenizer import SentencePieceTokenizer


@pytest.fixture
def few_files(monkeypatch):
    files = stdlib_source_files()[:25]
    monkeypatch.setattr(default_corpus, "stdlib_source_files", lambda: files)
    return files


def test_stdlib_files_are_sorted_sources():
    files = stdlib_source_files()
    assert len(files) > 300 and all(f.endswith(".py") for f in files)
    assert not any("site-packages" in f or f"{os.sep}test{os.sep}" in f for f in files)
    assert files == stdlib_source_files()


def test_full_corpus_round_trips(tmp_path):
    corpus = prepare_default_corpus(str(tmp_path), vocab_size=4096, progress=False)
    tok = SentencePieceTokenizer(corpus.tokenizer_model)
    ds = IndexedDataset(corpus.data_prefix)
    assert tok.vocab_size == 4096 and ds.dtype == np.uint16
    assert corpus.num_tokens == ds.num_tokens > 1_000_000  # several MB of real text
    files = [f for f in stdlib_source_files() if os.path.getsize(f)]
    for i in (0, len(ds) // 2, len(ds) - 1):  # documents are the non-empty files, in order
        with open(files[i], encoding="utf-8") as f:
            assert tok.decode(ds[i][:-1]) == f.read()


def test_reused_from_cache_and_keyed_by_vocab(tmp_path, few_files, monkeypatch, capsys):
    monkeypatch.setenv("MEGACOAT_CACHE", str(tmp_path))
    first = prepare_default_corpus(vocab_size=512)
    assert first.cache_dir.startswith(str(tmp_path)) and str(tmp_path) in capsys.readouterr().err
    stamp = os.stat(first.data_prefix + ".bin").st_mtime_ns
    monkeypatch.setattr(default_corpus, "preprocess", None)  # a rebuild would fail
    again = prepare_default_corpus(vocab_size=512, progress=False)
    assert again == first and os.stat(first.data_prefix + ".bin").st_mtime_ns == stamp
    with pytest.raises(TypeError):
        prepare_default_corpus(vocab_size=600, progress=False)  # another vocabulary is another corpus


def test_interrupted_build_is_redone(tmp_path, few_files):
    corpus = prepare_default_corpus(str(tmp_path), vocab_size=512, progress=False)
    os.remove(os.path.join(corpus.cache_dir, "manifest.json"))  # as if killed before the end
    os.remove(corpus.data_prefix + ".idx")
    again = prepare_default_corpus(str(tmp_path), vocab_size=512, progress=False)
    assert len(IndexedDataset(again.data_prefix)) == again.num_documents > 0
    assert not [n for n in os.listdir(os.path.dirname(again.cache_dir)) if ".tmp-" in n]
