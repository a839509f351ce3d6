"""The .bin/.idx format: read files written by an independent writer, write files it can read, reject bad ones."""
import os
import struct

import numpy as np
import pytest

from megacoat.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter, IndexFormatError, token_dtype


def write_reference(prefix, documents, dtype=np.uint16, code=8):
    """A minimal writer that follows Megatron-LM's format description, independent of megacoat's writer:
    magic "MMIDIDX\\0\\0", <Q version 1, <B dtype code, <Q sequence count, <Q document count, then int32
    lengths, int64 byte pointers, int64 document indices (0 and the sequence count after each document).
    Here a document may hold several sequences (Megatron's sentence splitting)."""
    seqs = [np.asarray(s, dtype=dtype) for doc in documents for s in doc]
    doc_idx = np.cumsum([0] + [len(doc) for doc in documents])
    with open(prefix + ".bin", "wb") as f:
        for s in seqs:
            f.write(s.tobytes())
    lengths = np.array([len(s) for s in seqs], np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1].astype(np.int64) * np.dtype(dtype).itemsize)])
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(seqs)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(lengths.tobytes())
        f.write(pointers.astype(np.int64).tobytes())
        f.write(doc_idx.astype(np.int64).tobytes())


DOCS = [[[5, 6, 7]], [[1], [2, 3]], [[65000, 0, 9, 9]]]  # documents of sequences


@pytest.mark.parametrize("dtype,code", [(np.uint16, 8), (np.int32, 4), (np.int64, 5)])
def test_reads_reference_writer(tmp_path, dtype, code):
    prefix = str(tmp_path / "ref")
    write_reference(prefix, DOCS, dtype, code)
    ds = IndexedDataset(prefix)
    flat = [s for doc in DOCS for s in doc]
    assert len(ds) == 4 and ds.num_documents == 3 and ds.dtype == np.dtype(dtype)
    assert ds.num_tokens == sum(map(len, flat))
    for i, s in enumerate(flat):
        assert ds[i].tolist() == s
    assert ds.get(3, offset=1, length=2).tolist() == [0, 9]
    assert ds.document_indices.tolist() == [0, 1, 3, 4]


def test_writer_output_matches_reference_bytes(tmp_path):
    docs = [[5, 6, 7], [1, 2, 3], [65000, 0]]
    write_reference(str(tmp_path / "ref"), [[d] for d in docs])
    with IndexedDatasetWriter(str(tmp_path / "ours"), np.uint16) as w:
        for d in docs:
            w.add_document(d)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"ref{ext}").read_bytes()


def test_token_dtype_by_vocab():
    assert token_dtype(32000) == np.uint16
    assert token_dtype(128256) == np.int32


def test_writer_rejects_ids_outside_dtype(tmp_path):
    w = IndexedDatasetWriter(str(tmp_path / "x"), np.uint16)
    with pytest.raises(ValueError, match="range"):
        w.add_document([70000])
    w.abort()
    assert os.listdir(tmp_path) == []


def test_interrupted_write_leaves_no_shard(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(str(tmp_path / "x"), np.uint16) as w:
            w.add_document([1, 2, 3])
            raise RuntimeError("killed")
    assert os.listdir(tmp_path) == []


def test_empty_dataset(tmp_path):
    with IndexedDatasetWriter(str(tmp_path / "e"), np.uint16):
        pass
    ds = IndexedDataset(str(tmp_path / "e"))
    assert len(ds) == 0 and ds.num_tokens == 0


def _corrupt(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.fixture
def good(tmp_path):
    prefix = str(tmp_path / "good")
    write_reference(prefix, DOCS)
    return prefix


def test_missing_files(good):
    os.remove(good + ".bin")
    with pytest.raises(FileNotFoundError, match=r"good\.bin"):
        IndexedDataset(good)
    with pytest.raises(FileNotFoundError, match="nothing"):
        IndexedDataset(good + "nothing")


@pytest.mark.parametrize("what,offset,data,message", [
    ("magic", 0, b"NOTANIDX\x00", "magic"),
    ("version", 9, struct.pack("<Q", 2), "version 2"),
    ("dtype", 17, struct.pack("<B", 42), "dtype code 42"),
    ("sequence count", 18, struct.pack("<Q", 5), "truncated or corrupt"),
    ("pointer", 34 + 4 * 4 + 8, struct.pack("<q", 2), "sequence 1 points at byte 2"),
    ("document index", 34 + 4 * 12 + 8, struct.pack("<q", 7), "document_indices"),
])
def test_corrupt_index(good, what, offset, data, message):
    _corrupt(good + ".idx", offset, data)
    with pytest.raises(IndexFormatError, match=message) as e:
        IndexedDataset(good)
    assert str(e.value).startswith(good + ".idx: ")


def test_truncated_index(good):
    size = os.path.getsize(good + ".idx")
    for cut in (5, size - 3):
        with open(good + ".idx", "r+b") as f:
            f.truncate(cut)
        with pytest.raises(IndexFormatError, match="good.idx"):
            IndexedDataset(good)


def test_truncated_or_grown_bin(good):
    size = os.path.getsize(good + ".bin")
    with open(good + ".bin", "r+b") as f:
        f.truncate(size - 2)
    with pytest.raises(IndexFormatError, match=r"good\.bin.*truncated"):
        IndexedDataset(good)
    with open(good + ".bin", "ab") as f:
        f.write(b"\x00" * 6)
    with pytest.raises(IndexFormatError, match=r"good\.bin"):
        IndexedDataset(good)


def test_pickles_by_path(good):
    import pickle
    ds = pickle.loads(pickle.dumps(IndexedDataset(good)))
    assert ds[3].tolist() == [65000, 0, 9, 9]


def test_max_token_id_over_chunks(tmp_path, monkeypatch):
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 5000, int(n)) for n in rng.integers(0, 50, 40)]
    docs[17][-1:] = 60000  # the largest id, near the end of one document
    with IndexedDatasetWriter(str(tmp_path / "d"), np.uint16) as w:
        for doc in docs:
            w.add_document(doc)
    ds = IndexedDataset(str(tmp_path / "d"))
    assert ds.max_token_id() == 60000 == max(int(d.max()) for d in docs if len(d))
    with IndexedDatasetWriter(str(tmp_path / "e"), np.uint16):
        pass
    assert IndexedDataset(str(tmp_path / "e")).max_token_id() == -1
