"""Preprocessing: text -> shards -> text round trip, worker-count independence, sharding, malformed input."""
import os

import numpy as np
import pytest

from megacoat.data import preprocessing as preprocess_module
from megacoat.data.indexed_dataset import IndexedDataset
from megacoat.data.preprocessing import MalformedInputError, preprocess
from megacoat.data.tokenizer import SentencePieceTokenizer
from tests.data.conftest import write_jsonl


def read_all(prefixes):
    return [ds[i] for p in prefixes for ds in [IndexedDataset(p)] for i in range(len(ds))]


def test_jsonl_round_trip(tmp_path, tokenizer_model, documents):
    src = write_jsonl(tmp_path / "in.jsonl", documents)
    r = preprocess([src], str(tmp_path / "out"), tokenizer_model, progress=False)
    tok = SentencePieceTokenizer(tokenizer_model)
    seqs = read_all(r.prefixes)
    assert r.prefixes == [str(tmp_path / "out")] and len(seqs) == len(documents) == r.num_documents
    assert IndexedDataset(r.prefixes[0]).dtype == np.uint16
    for seq, text in zip(seqs, documents):
        assert seq[-1] == tok.eod and tok.eod not in seq[:-1]
        assert tok.decode(seq[:-1]) == text
    assert r.num_tokens == sum(len(s) for s in seqs) and r.num_malformed == 0


def test_text_files_and_directories(tmp_path, tokenizer_model, documents):
    d = tmp_path / "corpus" / "sub"
    d.mkdir(parents=True)
    for i, text in enumerate(documents[:5]):
        (d / f"f{i}.py").write_text(text)
    (d / "empty.txt").write_text("")
    r = preprocess([str(tmp_path / "corpus")], str(tmp_path / "out"), tokenizer_model, progress=False)
    tok = SentencePieceTokenizer(tokenizer_model)
    assert [tok.decode(s[:-1]) for s in read_all(r.prefixes)] == documents[:5]
    assert r.num_empty == 1


def test_workers_and_shards_do_not_change_tokens(tmp_path, tokenizer_model, documents):
    src = write_jsonl(tmp_path / "in.jsonl", documents)
    one = preprocess([src], str(tmp_path / "one"), tokenizer_model, progress=False)
    two = preprocess([src], str(tmp_path / "two"), tokenizer_model, workers=2, shard_tokens=2000,
                     chunk_bytes=2000, progress=False)
    assert len(two.prefixes) > 2 and two.prefixes[0].endswith("two_00000")
    a, b = read_all(one.prefixes), read_all(two.prefixes)
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
    sizes = [IndexedDataset(p).num_tokens for p in two.prefixes]
    assert sizes == two.shard_tokens and sum(sizes) == one.num_tokens
    # A shard closes after the document that reaches the size: every shard but the last reaches it, and
    # would not have without its last document.
    for p, n in zip(two.prefixes[:-1], sizes[:-1]):
        assert n >= 2000 and n - IndexedDataset(p).sequence_lengths[-1] < 2000
    assert two.data_path_args().split()[0::2] == [str(n) for n in sizes]


def test_malformed_lines_are_counted_with_line_numbers(tmp_path, tokenizer_model):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"text": "good one"}\n{bad json\n\n{"other": "x"}\n{"text": 3}\n[1]\n'
                    b'{"text": "\xff\xfe"}\n{"text": "good two"}\n')
    r = preprocess([str(src)], str(tmp_path / "out"), tokenizer_model, progress=False)
    assert r.num_documents == 2 and r.num_malformed == 5
    path = str(src)
    assert [e.split(": ", 1)[0] for e in r.errors] == [f"{path}:{n}" for n in (2, 4, 5, 6, 7)]
    assert "bad JSON" in r.errors[0] and "missing key 'text'" in r.errors[1] and "int" in r.errors[2]
    assert "UTF-8" in r.errors[4]
    with pytest.raises(MalformedInputError, match=r"in\.jsonl:2: bad JSON"):
        preprocess([str(src)], str(tmp_path / "strict"), tokenizer_model, strict=True, progress=False)
    assert not any(n.startswith("strict") and n.endswith((".idx", ".bin")) for n in os.listdir(tmp_path))


def test_interrupted_run_leaves_no_whole_shard(tmp_path, tokenizer_model, documents, monkeypatch):
    src = write_jsonl(tmp_path / "in.jsonl", documents)
    real = preprocess_module._encode_chunk
    calls = []

    def dying(records):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(records)

    monkeypatch.setattr(preprocess_module, "_encode_chunk", dying)
    with pytest.raises(KeyboardInterrupt):
        preprocess([src], str(tmp_path / "out"), tokenizer_model, shard_tokens=10**9, chunk_bytes=500,
                   progress=False)
    assert [n for n in os.listdir(tmp_path) if n.startswith("out")] == []


def test_bad_arguments(tmp_path, tokenizer_model):
    with pytest.raises(FileNotFoundError, match="matches no file"):
        preprocess([str(tmp_path / "*.jsonl")], str(tmp_path / "o"), tokenizer_model, progress=False)
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "b.jsonl").write_text('{"text": ""}\n{"txt": "x"}\n')
    with pytest.raises(ValueError, match=r"no documents .* 1 empty, 1 malformed \(first: .*b\.jsonl:2: missing"):
        preprocess([str(tmp_path / "b.jsonl")], str(tmp_path / "o"), tokenizer_model, progress=False)
    assert not list(tmp_path.glob("o*"))
    with pytest.raises(ValueError, match="workers"):
        preprocess([str(tmp_path / "a.txt")], str(tmp_path / "o"), tokenizer_model, workers=0, progress=False)
