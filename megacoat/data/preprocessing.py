"""Tokenize documents into Megatron `.bin/.idx` shards with N worker processes (tools/preprocess_data.py's engine).

The main process reads raw records and writes shards; workers decode, tokenize and append EOD. Chunks come
back in input order, so the output is the same for any worker count.
"""
from __future__ import annotations

import multiprocessing as mp
import sys
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from megacoat.data.indexed_dataset import IndexedDatasetWriter, token_dtype
from megacoat.data.sources import MalformedRecord, Record, decode_record, expand_inputs, iter_records
from megacoat.data.tokenizer import SentencePieceTokenizer

MAX_REPORTED_ERRORS = 1000  # all are counted; this many are kept with their line numbers


@dataclass
class PreprocessResult:
    prefixes: list[str]
    num_documents: int = 0
    num_tokens: int = 0            # EOD included
    num_bytes: int = 0             # input bytes of the documents that were kept
    num_empty: int = 0             # documents with no text: skipped
    num_malformed: int = 0
    errors: list[str] = field(default_factory=list)  # "file:line: reason", the first MAX_REPORTED_ERRORS
    shard_tokens: list[int] = field(default_factory=list)
    seconds: float = 0.0

    def data_path_args(self) -> str:
        """The --data-path value that trains on every shard in proportion to its tokens."""
        if len(self.prefixes) == 1:
            return self.prefixes[0]
        return " ".join(f"{n} {p}" for n, p in zip(self.shard_tokens, self.prefixes))


class MalformedInputError(ValueError):
    pass


@dataclass
class _Encoded:
    tokens: np.ndarray
    lengths: np.ndarray
    num_bytes: int
    num_empty: int
    errors: list[tuple[str, int, str]]


_worker_tokenizer: SentencePieceTokenizer | None = None
_worker_json_key = "text"


def _init_worker(model_path: str, json_key: str) -> None:
    global _worker_tokenizer, _worker_json_key
    _worker_tokenizer = SentencePieceTokenizer(model_path)
    _worker_json_key = json_key


def _encode_chunk(records: list[Record]) -> _Encoded:
    tok = _worker_tokenizer
    texts, errors, num_bytes = [], [], 0
    for r in records:
        try:
            texts.append(decode_record(r, _worker_json_key))
            num_bytes += len(r.raw)
        except MalformedRecord as e:
            errors.append((e.path, e.line, e.reason))
    ids = [d for d in tok.encode_batch(texts) if d]
    eod = [tok.eod]
    lengths = np.fromiter((len(d) + 1 for d in ids), dtype=np.int64, count=len(ids))
    tokens = np.fromiter(chain.from_iterable(chain.from_iterable((d, eod) for d in ids)),
                         dtype=np.int32, count=int(lengths.sum()))
    return _Encoded(tokens, lengths, num_bytes, len(texts) - len(ids), errors)


def _chunks(records: Iterator[Record], chunk_bytes: int) -> Iterator[list[Record]]:
    chunk, size = [], 0
    for r in records:
        chunk.append(r)
        size += len(r.raw)
        if size >= chunk_bytes:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


class _ShardWriter:
    """Fills shards of about `shard_tokens` tokens (a shard closes after the document that reaches it)."""

    def __init__(self, prefix: str, dtype: np.dtype, shard_tokens: int | None):
        self.prefix, self.dtype, self.shard_tokens = prefix, dtype, shard_tokens
        self.prefixes: list[str] = []
        self.shard_sizes: list[int] = []
        self._writer: IndexedDatasetWriter | None = None

    def _open(self) -> IndexedDatasetWriter:
        if self._writer is None:
            name = self.prefix if self.shard_tokens is None else f"{self.prefix}_{len(self.prefixes):05d}"
            self._writer = IndexedDatasetWriter(name, self.dtype)
        return self._writer

    def _close(self) -> None:
        self.shard_sizes.append(self._writer.num_tokens)
        self.prefixes.append(self._writer.finalize())
        self._writer = None

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        while len(lengths):
            w = self._open()
            if self.shard_tokens is None:
                w.add_documents(tokens, lengths)
                return
            ends = np.cumsum(lengths)
            room = self.shard_tokens - w.num_tokens
            k = int(np.searchsorted(ends, room, side="left")) + 1  # docs up to and including the one that fills it
            if k >= len(lengths):
                w.add_documents(tokens, lengths)
                if w.num_tokens >= self.shard_tokens:
                    self._close()
                return
            n = int(ends[k - 1])
            w.add_documents(tokens[:n], lengths[:k])
            self._close()
            tokens, lengths = tokens[n:], lengths[k:]

    def finish(self) -> None:
        if self._writer is not None and (self._writer.num_documents or not self.prefixes):
            self._close()
        elif self._writer is not None:
            self._writer.abort()

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()


def preprocess(inputs: list[str], output_prefix: str, tokenizer_model: str, *, json_key: str = "text",
               input_format: str = "auto", workers: int = 1, shard_tokens: int | None = None,
               strict: bool = False, progress: bool = True, chunk_bytes: int = 1 << 18) -> PreprocessResult:
    """Tokenize every document of `inputs` into `{output_prefix}.bin/.idx` (or `{output_prefix}_00000...` shards
    of about `shard_tokens` tokens). Malformed records are counted and reported; `strict` stops at the first."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if shard_tokens is not None and shard_tokens < 1:
        raise ValueError(f"shard_tokens must be >= 1, got {shard_tokens}")
    files = expand_inputs(inputs)
    tokenizer = SentencePieceTokenizer(tokenizer_model)
    out = _ShardWriter(output_prefix, token_dtype(tokenizer.vocab_size), shard_tokens)
    result = PreprocessResult(prefixes=[])
    chunks = _chunks(iter_records(files, input_format), chunk_bytes)
    start = time.perf_counter()
    bar = _progress_bar(progress)
    try:
        for enc in _encode_all(chunks, tokenizer_model, json_key, workers):
            for path, line, reason in enc.errors:
                where = f"{path}:{line}" if line else path
                if strict:
                    raise MalformedInputError(f"{where}: {reason} (--strict stops at the first malformed record)")
                result.num_malformed += 1
                if len(result.errors) < MAX_REPORTED_ERRORS:
                    result.errors.append(f"{where}: {reason}")
            out.add(enc.tokens, enc.lengths)
            result.num_documents += len(enc.lengths)
            result.num_tokens += len(enc.tokens)
            result.num_bytes += enc.num_bytes
            result.num_empty += enc.num_empty
            if bar is not None:
                bar.update(len(enc.lengths))
                bar.set_postfix_str(f"{result.num_tokens / (time.perf_counter() - start) / 1e6:.2f}M tok/s, "
                                    f"{result.num_malformed} malformed", refresh=False)
        if result.num_documents == 0:
            raise ValueError(f"no documents to write from {len(files)} input file(s): {result.num_empty} empty, "
                             f"{result.num_malformed} malformed" + (f" (first: {result.errors[0]})"
                                                                    if result.errors else ""))
        out.finish()
    except BaseException:
        out.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
    result.seconds = time.perf_counter() - start
    result.prefixes, result.shard_tokens = out.prefixes, out.shard_sizes
    return result


def _encode_all(chunks: Iterator[list[Record]], tokenizer_model: str, json_key: str,
                workers: int) -> Iterator[_Encoded]:
    """Encoded chunks in input order. With several workers, a bounded number of chunks is in flight so memory
    stays flat on inputs of any size; a worker that dies fails the run (BrokenProcessPool) instead of hanging."""
    if workers == 1:  # in-process: no pickling, the fastest single-core path
        _init_worker(tokenizer_model, json_key)
        yield from map(_encode_chunk, chunks)
        return
    # fork where there is one: workers start at once instead of re-importing the caller's __main__ (torch and
    # all, under spawn). As with torch's DataLoader, the children touch only numpy and sentencepiece, never
    # what the parent's threads (torch, CUDA) may hold.
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    with ProcessPoolExecutor(workers, mp_context=mp.get_context(method), initializer=_init_worker,
                             initargs=(tokenizer_model, json_key)) as pool:
        pending = deque()
        try:
            for chunk in chunks:
                pending.append(pool.submit(_encode_chunk, chunk))
                if len(pending) >= 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for f in pending:
                f.cancel()


def _progress_bar(enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm
    return tqdm(unit="docs", file=sys.stderr, dynamic_ncols=True, smoothing=0.1)
