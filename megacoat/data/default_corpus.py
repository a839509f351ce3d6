"""The embedded default corpus: the running Python's standard library sources, tokenized once and cached.

Real text (several MB of code and docstrings) that every machine already has, so `pretrain_gpt.py` with no
flags trains on something meaningful. It is built through the same tokenizer trainer and preprocessor as
tools/train_tokenizer.py and tools/preprocess_data.py, in a temporary folder renamed into place when complete,
under a lock so concurrent ranks build it once.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import sysconfig
import time
from dataclasses import dataclass

from megacoat.data.builders import default_cache_dir
from megacoat.data.preprocessing import preprocess
from megacoat.data.sources import iter_documents
from megacoat.data.tokenizer import train_sentencepiece

CORPUS_FORMAT_VERSION = 2  # 2: tokenizer trained on runs of lines
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
TOKENIZER_SAMPLE_SENTENCES = 60_000  # all of the stdlib's sources; bounds the tokenizer's training time


@dataclass
class DefaultCorpus:
    data_prefix: str
    tokenizer_model: str
    cache_dir: str
    num_documents: int
    num_tokens: int


def stdlib_source_files() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        files += [os.path.join(dirpath, n) for n in sorted(names) if n.endswith(".py")]
    if not files:
        raise FileNotFoundError(f"no Python sources under the standard library folder {root}")
    return files


def prepare_default_corpus(cache_dir: str | None = None, vocab_size: int = 4096, progress: bool = True,
                           workers: int | None = None) -> DefaultCorpus:
    """Build (first use) or reuse the stdlib corpus: a sentencepiece model and one `.bin/.idx` shard."""
    root = os.path.join(cache_dir or default_cache_dir(), "corpus")
    name = f"stdlib-py{sys.version_info.major}.{sys.version_info.minor}-v{vocab_size}-f{CORPUS_FORMAT_VERSION}"
    final = os.path.join(root, name)
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder; the others wait here and then reuse its result
        if not os.path.isfile(os.path.join(final, "manifest.json")):
            _build(final, vocab_size, progress, workers)
        with open(os.path.join(final, "manifest.json")) as f:
            manifest = json.load(f)
    if progress:
        print(f"megacoat: default corpus (Python stdlib sources, {manifest['num_tokens']:,} tokens) in {final}",
              file=sys.stderr)
    return DefaultCorpus(data_prefix=os.path.join(final, "stdlib"),
                         tokenizer_model=os.path.join(final, "tokenizer.model"),
                         cache_dir=final, num_documents=manifest["num_documents"], num_tokens=manifest["num_tokens"])


def _build(final: str, vocab_size: int, progress: bool, workers: int | None) -> None:
    tmp = f"{final}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(final, ignore_errors=True)  # a folder without a manifest is an interrupted build
    os.makedirs(tmp)
    files = stdlib_source_files()
    if progress:
        print(f"megacoat: building the default corpus from {len(files)} stdlib files into {final} "
              f"(first use only)", file=sys.stderr)
    t0 = time.perf_counter()
    model = train_sentencepiece(iter_documents(files, input_format="text"), os.path.join(tmp, "tokenizer.model"),
                                vocab_size, max_sentences=TOKENIZER_SAMPLE_SENTENCES)
    t1 = time.perf_counter()
    result = preprocess(files, os.path.join(tmp, "stdlib"), model, input_format="text",
                        workers=workers or min(os.cpu_count() or 1, 8), progress=progress)
    manifest = dict(format=CORPUS_FORMAT_VERSION, python=sys.version, vocab_size=vocab_size,
                    num_files=len(files), num_documents=result.num_documents, num_tokens=result.num_tokens,
                    num_malformed=result.num_malformed, tokenizer_seconds=round(t1 - t0, 2),
                    preprocess_seconds=round(result.seconds, 2))
    with open(os.path.join(tmp, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(tmp, final)
