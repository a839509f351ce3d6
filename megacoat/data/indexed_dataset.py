"""Megatron-LM's indexed dataset format: a `.bin` of raw tokens and an `.idx` that says where each sequence starts.

`.idx` layout (little endian), as written by megatron/core/datasets/indexed_dataset.py:

    9 bytes   magic b"MMIDIDX\\x00\\x00"
    uint64    version (1)
    uint8     dtype code of the tokens in .bin (see DTYPE_CODES)
    uint64    sequence_count  S
    uint64    document_count  D (= number of documents + 1)
    int32[S]  sequence_lengths, in tokens
    int64[S]  sequence_pointers, byte offsets of each sequence in .bin
    int64[D]  document_indices: 0, then the sequence count after each document
    (int8[S]  sequence_modes, only in Megatron's multimodal variant; accepted and ignored)

megacoat writes one sequence per document (EOD appended), like Megatron's preprocess_data.py without
sentence splitting. The reader maps both files and checks every size against the file lengths, so a truncated
or foreign file fails loudly with its name instead of yielding garbage tokens.
"""
from __future__ import annotations

import mmap
import os
import struct

import numpy as np

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count

DTYPE_CODES = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
_CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (Megatron's rule leaves a little headroom below 2^16), else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def dataset_exists(prefix: str) -> bool:
    return os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix))


class IndexFormatError(ValueError):
    """A .bin/.idx pair that does not follow the format; the message names the file."""


class IndexedDataset:
    """Read-only, memory-mapped view of one `.bin/.idx` pair. `ds[i]` is sequence i as a numpy view."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"indexed dataset {prefix!r}: missing {path}")
        self._index = _read_index(idx_path)
        self.dtype, self.sequence_lengths, self.sequence_pointers, self.document_indices = self._index
        bin_size = os.path.getsize(bin_path)
        _check_pointers(idx_path, bin_path, bin_size, self.dtype, self.sequence_lengths, self.sequence_pointers)
        # Plain ndarray over the map (np.memmap slices cost microseconds each); an empty .bin cannot be mapped.
        self.tokens = _map(bin_path, self.dtype) if bin_size else np.empty(0, self.dtype)
        self._max_token_id: int | None = None

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def max_token_id(self) -> int:
        """The largest token id in the .bin (-1 if it is empty): a vectorised pass over the map, in chunks of
        64 Mi tokens so that a large shard is streamed through the page cache, not copied."""
        if self._max_token_id is None:
            chunk = 1 << 26
            best = -1
            for lo in range(0, len(self.tokens), chunk):
                best = max(best, int(self.tokens[lo:lo + chunk].max()))
            self._max_token_id = best
        return self._max_token_id

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence i, without copying."""
        if length is None:
            length = int(self.sequence_lengths[i]) - offset
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        return self.tokens[start:start + length]

    def __getstate__(self):  # workers re-map the files instead of pickling the maps
        return self.prefix

    def __setstate__(self, prefix):
        self.__init__(prefix)


def _read_index(path: str):
    size = os.path.getsize(path)
    if size < _HEADER.size:
        raise IndexFormatError(f"{path}: {size} bytes is too short for the {_HEADER.size}-byte MMIDIDX header")
    with open(path, "rb") as f:
        magic, version, code, n_seq, n_doc = _HEADER.unpack(f.read(_HEADER.size))
    if magic != INDEX_MAGIC:
        raise IndexFormatError(f"{path}: not a Megatron indexed dataset index (magic {magic!r}, "
                               f"expected {INDEX_MAGIC!r})")
    if version != INDEX_VERSION:
        raise IndexFormatError(f"{path}: index version {version} is not supported (expected {INDEX_VERSION})")
    if code not in DTYPE_CODES:
        raise IndexFormatError(f"{path}: unknown token dtype code {code} (known: {sorted(DTYPE_CODES)})")
    dtype = np.dtype(DTYPE_CODES[code])
    arrays = _HEADER.size + n_seq * (4 + 8) + n_doc * 8
    if size not in (arrays, arrays + n_seq):  # + n_seq: Megatron's multimodal sequence_modes (int8)
        raise IndexFormatError(f"{path}: {size} bytes, but its header ({n_seq} sequences, {n_doc} document "
                               f"boundaries) needs {arrays} (truncated or corrupt)")
    if n_doc < 1:
        raise IndexFormatError(f"{path}: document_count is 0; it must be at least 1 (the leading 0)")
    raw = _map(path, np.uint8) if size > _HEADER.size else np.empty(0, np.uint8)
    o = _HEADER.size
    lengths = raw[o:o + 4 * n_seq].view(np.int32)
    o += 4 * n_seq
    pointers = raw[o:o + 8 * n_seq].view(np.int64)
    o += 8 * n_seq
    documents = raw[o:o + 8 * n_doc].view(np.int64)
    if n_seq and lengths.min() < 0:
        raise IndexFormatError(f"{path}: negative sequence length at sequence {int(np.argmin(lengths))}")
    if documents[0] != 0 or documents[-1] != n_seq or (n_doc > 1 and np.any(np.diff(documents) < 0)):
        raise IndexFormatError(f"{path}: document_indices must rise from 0 to the sequence count {n_seq}")
    return dtype, lengths, pointers, documents


def _map(path: str, dtype) -> np.ndarray:
    with open(path, "rb") as f:
        return np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), dtype=dtype)


def _check_pointers(idx_path: str, bin_path: str, bin_size: int, dtype: np.dtype, lengths: np.ndarray,
                    pointers: np.ndarray) -> None:
    """Sequences must lie back to back in .bin and fill it exactly."""
    byte_lengths = lengths.astype(np.int64) * dtype.itemsize
    end = int(byte_lengths.sum())
    if end != bin_size:
        raise IndexFormatError(f"{bin_path}: holds {bin_size} bytes but {idx_path} describes {end} "
                               f"({len(lengths)} sequences of {dtype.name}; truncated, or the wrong .idx)")
    if len(lengths):
        expected = np.zeros(len(lengths), np.int64)
        np.cumsum(byte_lengths[:-1], out=expected[1:])
        bad = np.flatnonzero(pointers != expected)
        if len(bad):
            i = int(bad[0])
            raise IndexFormatError(f"{idx_path}: sequence {i} points at byte {int(pointers[i])}, expected "
                                   f"{int(expected[i])} (corrupt index)")


class IndexedDatasetWriter:
    """Appends documents to `{prefix}.bin/.idx` under temporary names; `finalize()` renames them into place.

    The .bin is renamed before the .idx, so a prefix whose .idx exists is always complete; an interrupted
    write leaves only `*.tmp-<pid>` files behind.
    """

    def __init__(self, prefix: str, dtype: np.dtype):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise ValueError(f"token dtype {self.dtype} has no code in the indexed dataset format")
        suffix = f".tmp-{os.getpid()}"
        self._tmp_bin = data_file_path(prefix) + suffix
        self._tmp_idx = index_file_path(prefix) + suffix
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._bin = open(self._tmp_bin, "wb")
        self._lengths: list[np.ndarray] = []
        self.num_tokens = 0
        self.num_documents = 0

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents given as their concatenated tokens and per-document lengths."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != len(tokens):
            raise ValueError(f"document lengths sum to {int(lengths.sum())} but {len(tokens)} tokens were given")
        if len(tokens) and (tokens.min() < 0 or tokens.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"token ids outside {self.dtype.name}'s range: pick a wider dtype")
        self._bin.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self._lengths.append(lengths.astype(np.int32))
        self.num_tokens += len(tokens)
        self.num_documents += len(lengths)

    def add_document(self, tokens) -> None:
        tokens = np.asarray(tokens)
        self.add_documents(tokens, np.array([len(tokens)]))

    def finalize(self) -> str:
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        pointers = np.zeros(len(lengths), np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        documents = np.arange(len(lengths) + 1, dtype=np.int64)  # one sequence per document
        with open(self._tmp_idx, "wb") as f:
            f.write(_HEADER.pack(INDEX_MAGIC, INDEX_VERSION, _CODE_OF[self.dtype], len(lengths), len(documents)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(documents.tobytes())
        os.replace(self._tmp_bin, data_file_path(self.prefix))
        os.replace(self._tmp_idx, index_file_path(self.prefix))
        return self.prefix

    def abort(self) -> None:
        self._bin.close()
        for path in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.finalize()
        else:
            self.abort()
