"""From a DataConfig to train/valid/test datasets: --data-path blends, --split ranges, mock data."""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from megacoat.data.blended_dataset import BlendedDataset, blend_indices
from megacoat.data.config import DataConfig, parse_data_path
from megacoat.data.gpt_dataset import GPTDataset, MockGPTDataset
from megacoat.data.indexed_dataset import IndexedDataset, data_file_path

SPLIT_NAMES = ("train", "valid", "test")


def default_cache_dir() -> str:
    return os.environ.get("MEGACOAT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "megacoat")


def split_weights(split: str) -> list[float]:
    w = [float(p) for p in split.split(",")]
    w += [0.0] * (3 - len(w))
    total = sum(w)
    return [x / total for x in w]


def split_ranges(num_documents: int, split: str) -> list[tuple[int, int]]:
    """Contiguous document ranges for train/valid/test (Megatron's rounding: the last split absorbs the rest)."""
    bounds = [0]
    for w in split_weights(split):
        bounds.append(bounds[-1] + int(round(w * num_documents)))
    diff = bounds[-1] - num_documents
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    return [(max(lo, 0), max(hi, 0)) for lo, hi in zip(bounds[:-1], bounds[1:])]


def build_train_valid_test_datasets(data_config: DataConfig, seq_length: int, train_samples: int,
                                    valid_samples: int, test_samples: int, seed: int, *,
                                    vocab_size: int | None = None, eval_seed: int | None = None):
    """(train, valid, test); a split asked for 0 samples is None. Items are int64 arrays of seq_length + 1.

    `seed` orders the training samples; `eval_seed` (default: `seed`) the validation and test samples, so that
    runs of different seeds can be evaluated on exactly the same batches.

    With several --data-path prefixes each one is split by --split and the splits are blended by weight.
    A split that is asked for samples but has too little data raises, naming the prefix and split.
    """
    wanted = (train_samples, valid_samples, test_samples)
    if any(n < 0 for n in wanted):
        raise ValueError(f"sample counts must be >= 0, got {wanted}")
    eval_seed = seed if eval_seed is None else eval_seed
    if data_config.mock_data:
        if vocab_size is None:
            raise ValueError("mock data needs vocab_size= (the model's vocabulary)")
        return tuple(MockGPTDataset(n, seq_length, vocab_size, (eval_seed if i else seed) + i, name) if n else None
                     for i, (n, name) in enumerate(zip(wanted, SPLIT_NAMES)))
    if not data_config.data_path:
        raise ValueError("no --data-path given: pass shard prefixes, --mock-data, or use "
                         "megacoat.data.prepare_default_corpus() for the embedded corpus")
    weights, prefixes = parse_data_path(data_config.data_path)
    indexed = [IndexedDataset(p) for p in prefixes]
    if weights is None:
        weights = [max(d.num_tokens, 1) for d in indexed]
    cache_dir = os.path.join(data_config.cache_dir or default_cache_dir(), "index")
    if vocab_size is not None:
        for ds in indexed:
            check_token_ids(ds, vocab_size, cache_dir)
    split_weight = split_weights(data_config.split)

    out = []
    for s, (n, name) in enumerate(zip(wanted, SPLIT_NAMES)):
        if n == 0:
            out.append(None)
            continue
        if split_weight[s] == 0:
            raise ValueError(f"{n} {name} samples requested but --split {data_config.split} gives {name} no data")
        counts = blend_indices(weights, n)[2] if len(indexed) > 1 else [n]
        parts = []
        for ds, count in zip(indexed, counts):
            lo, hi = split_ranges(len(ds), data_config.split)[s]
            if lo == hi:
                hint = ", or --eval-iters 0 to train without validation" if name == "valid" else ""
                raise ValueError(f"--split {data_config.split}: the {name} split of {ds.prefix!r} gets none of its "
                                 f"{len(ds)} documents; give it a larger share (e.g. --split 90,10,0){hint}")
            # Every component gets at least one sample so that a small request still validates all of them.
            parts.append(GPTDataset(ds, lo, hi, seq_length, max(int(count), 1), seed if s == 0 else eval_seed,
                                    cache_dir=cache_dir, name=name))
        out.append(parts[0] if len(parts) == 1 else BlendedDataset(parts, weights, n))
    return tuple(out)


def check_token_ids(indexed: IndexedDataset, vocab_size: int, cache_dir: str | None = None) -> None:
    """Every token id of the shard must be < vocab_size (the embedding's rows). The largest id is one pass over
    the .bin, cached in `cache_dir` by the file's path, size and modification time, so it is read once."""
    if np.issubdtype(indexed.dtype, np.unsignedinteger) and np.iinfo(indexed.dtype).max < vocab_size:
        return  # no id the dtype can hold reaches vocab_size
    largest = _cached_max_token_id(indexed, cache_dir)
    if largest >= vocab_size:
        raise ValueError(f"--vocab-size {vocab_size} is too small for {data_file_path(indexed.prefix)}: its largest "
                         f"token id is {largest}; pass --vocab-size {largest + 1} or more (or the tokenizer that "
                         f"made the data with --tokenizer-model)")


def _cached_max_token_id(indexed: IndexedDataset, cache_dir: str | None) -> int:
    if cache_dir is None:
        return indexed.max_token_id()
    bin_path = data_file_path(indexed.prefix)
    st = os.stat(bin_path)
    desc = {"bin": os.path.abspath(bin_path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    key = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:24]
    path = os.path.join(cache_dir, f"max_token_id-{key}.json")
    try:
        with open(path) as f:
            return int(json.load(f)["max_token_id"])
    except (OSError, ValueError, KeyError):
        pass
    largest = indexed.max_token_id()
    os.makedirs(cache_dir, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({**desc, "max_token_id": largest}, f)
    os.replace(tmp, path)  # ranks computing it at once write the same value
    return largest
