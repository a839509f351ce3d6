#!/usr/bin/env python3
"""Train a sentencepiece tokenizer (BPE or unigram, byte fallback) from text files, directories or JSONL.

    python tools/train_tokenizer.py data/*.jsonl --json-key text --vocab-size 32000 --output tok.model

Plain-text files are one document each; JSONL lines are one document each (their --json-key field).
Runs of lines are sampled uniformly (seeded) up to --max-sentences, which bounds the time on large inputs.
Any error (no input, unreadable or empty input, an --output that cannot be written) is one `error:` line and
exit status 1; --output is checked before the (possibly long) training starts.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from megacoat.arguments import ArgumentParser  # noqa: E402
from megacoat.data.sources import INPUT_FORMATS, expand_inputs, iter_documents  # noqa: E402
from megacoat.data.tokenizer import MODEL_TYPES, SentencePieceTokenizer, train_sentencepiece  # noqa: E402
from megacoat.training.errors import error_line  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", help="files, globs or directories")
    p.add_argument("--output", required=True, help="the .model file to write")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--model-type", choices=MODEL_TYPES, default="bpe")
    p.add_argument("--no-byte-fallback", action="store_true", help="unknown characters become <unk>")
    p.add_argument("--user-defined-symbols", nargs="*", default=[], help="pieces kept whole, e.g. <|im_start|>")
    p.add_argument("--json-key", default="text")
    p.add_argument("--input-format", choices=INPUT_FORMATS, default="auto",
                   help="auto: .jsonl/.json/.ndjson(.gz) are JSONL, anything else plain text")
    p.add_argument("--max-sentences", type=int, default=2_000_000,
                   help="sample at most this many training sentences (runs of whole lines, ~256 characters each)")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0, help="seed of the line sample")
    return p


def check_output(path: str) -> None:
    """--output must be a file megacoat can create: not a directory, its directory creatable and writable."""
    if os.path.isdir(path):
        raise ValueError(f"--output {path}: is a directory, not a .model file")
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise ValueError(f"--output {path}: {parent} is a file, not a directory")
    try:
        os.makedirs(parent, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=parent)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"--output {path}: cannot write there ({e.strerror or e})") from None


def train(args) -> int:
    check_output(args.output)
    files = expand_inputs(args.inputs)
    t0 = time.perf_counter()
    documents = iter_documents(files, json_key=args.json_key, input_format=args.input_format)
    try:
        train_sentencepiece(documents, args.output, args.vocab_size, model_type=args.model_type,
                            byte_fallback=not args.no_byte_fallback, user_defined_symbols=args.user_defined_symbols,
                            max_sentences=args.max_sentences, num_threads=args.num_threads, seed=args.seed)
    except ValueError as e:  # the text itself (none, or too little for sentencepiece): name the inputs
        named = files[0] if len(files) == 1 else f"{files[0]} and {len(files) - 1} more input files"
        raise ValueError(f"{named}: {e}") from None
    tok = SentencePieceTokenizer(args.output)
    print(f"wrote {args.output}: vocab {tok.vocab_size}, eod {tok.eod}, pad {tok.pad}, identity {tok.identity()} "
          f"({len(files)} files, {time.perf_counter() - t0:.1f} s)")
    if tok.vocab_size != args.vocab_size:
        print(f"warning: produced a vocabulary of {tok.vocab_size} pieces, not the --vocab-size {args.vocab_size} "
              f"asked for: the input holds too little text for more (give more text for more pieces; "
              f"pretrain_gpt.py's --vocab-size must be at least {tok.vocab_size})", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return train(args)
    except (OSError, ValueError) as e:  # what the user gave: inputs (missing, unreadable, empty), --output
        print(error_line(e), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
