#!/usr/bin/env python3
"""Tokenize JSONL or plain text into Megatron-LM indexed-dataset shards (.bin tokens + .idx index).

    python tools/preprocess_data.py --input data/*.jsonl --json-key text --tokenizer-model tok.model \\
        --output-prefix shards/web --workers 8 --shard-tokens 1000000000

One document per JSONL line (or per plain-text file), EOD appended; uint16 tokens when the vocabulary fits,
else int32. The shards read in Megatron-LM (`--data-path`) and megacoat alike. Malformed lines are counted
and listed with their line numbers; --strict stops at the first. Files are written under temporary names and
renamed when complete, so an interrupted run never leaves a shard that looks whole.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from megacoat.arguments import ArgumentParser  # noqa: E402
from megacoat.data.preprocessing import preprocess  # noqa: E402
from megacoat.data.sources import INPUT_FORMATS  # noqa: E402
from megacoat.training.errors import error_line  # noqa: E402

SHOWN_ERRORS = 20


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="files, globs or directories")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin/.idx, or PREFIX_00000.bin/.idx ... "
                                                          "with --shard-tokens")
    p.add_argument("--tokenizer-model", required=True, help="sentencepiece .model (tools/train_tokenizer.py)")
    p.add_argument("--json-key", default="text")
    p.add_argument("--input-format", choices=INPUT_FORMATS, default="auto",
                   help="auto: .jsonl/.json/.ndjson(.gz) are JSONL, anything else plain text (one document a file)")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    p.add_argument("--shard-tokens", type=int, default=None, help="start a new shard after about this many tokens")
    p.add_argument("--strict", action="store_true", help="stop at the first malformed line")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        r = preprocess(args.input, args.output_prefix, args.tokenizer_model, json_key=args.json_key,
                       input_format=args.input_format, workers=args.workers, shard_tokens=args.shard_tokens,
                       strict=args.strict, progress=not args.no_progress)
    except (OSError, ValueError) as e:  # inputs, the tokenizer model, --output-prefix (MalformedInputError too)
        print(error_line(e), file=sys.stderr)
        return 1
    rate = r.num_tokens / r.seconds if r.seconds else 0.0
    print(f"{r.num_documents:,} documents, {r.num_tokens:,} tokens in {len(r.prefixes)} shard(s), "
          f"{r.seconds:.1f} s ({rate / 1e6:.2f} M tokens/s); {r.num_empty} empty documents skipped")
    if r.num_malformed:
        print(f"{r.num_malformed} malformed record(s) skipped:", file=sys.stderr)
        for line in r.errors[:SHOWN_ERRORS]:
            print(f"  {line}", file=sys.stderr)
        if r.num_malformed > SHOWN_ERRORS:
            print(f"  ... and {r.num_malformed - SHOWN_ERRORS} more", file=sys.stderr)
    print(f"--data-path {r.data_path_args()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
