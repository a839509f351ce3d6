"""Input documents for tokenizer training and preprocessing: files, globs and directories of JSONL or plain text.

A JSONL line is one document (its `json_key` field); a plain-text file is one document. Records keep their
file and line number so that malformed input can be reported precisely.
"""
from __future__ import annotations

import glob
import gzip
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson", ".jsonl.gz", ".json.gz", ".ndjson.gz")
INPUT_FORMATS = ("auto", "jsonl", "text")


def expand_inputs(inputs: list[str], suffixes: tuple[str, ...] | None = None) -> list[str]:
    """Files named, matched by a glob, or found under a directory (recursively), in a deterministic order."""
    files: list[str] = []
    for item in inputs:
        if os.path.isdir(item):
            found = []
            for root, dirs, names in os.walk(item):
                dirs.sort()
                found += [os.path.join(root, n) for n in sorted(names)
                          if not n.startswith(".") and (suffixes is None or n.endswith(suffixes))]
            files += found
        elif os.path.isfile(item):
            files.append(item)
        else:
            matched = sorted(p for p in glob.glob(item, recursive=True) if os.path.isfile(p))
            if not matched:
                raise FileNotFoundError(f"input {item!r} is not a file or directory and matches no file")
            files += matched
    if not files:
        raise FileNotFoundError(f"no input files found in {inputs}")
    return files


def file_format(path: str, input_format: str = "auto") -> str:
    if input_format not in INPUT_FORMATS:
        raise ValueError(f"input format must be one of {INPUT_FORMATS}, got {input_format!r}")
    if input_format != "auto":
        return input_format
    return "jsonl" if path.endswith(JSONL_SUFFIXES) else "text"


def _open_binary(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


@dataclass
class Record:
    """Undecoded input: one JSONL line (line >= 1) or a whole text file (line 0)."""
    path: str
    line: int
    raw: bytes


class MalformedRecord(ValueError):
    def __init__(self, path: str, line: int, reason: str):
        self.path, self.line, self.reason = path, line, reason
        where = f"{path}:{line}" if line else path
        super().__init__(f"{where}: {reason}")


def iter_records(files: list[str], input_format: str = "auto") -> Iterator[Record]:
    for path in files:
        if file_format(path, input_format) == "jsonl":
            with _open_binary(path) as f:
                for n, raw in enumerate(f, 1):
                    if raw.strip():
                        yield Record(path, n, raw)
        else:
            with _open_binary(path) as f:
                yield Record(path, 0, f.read())


def decode_record(record: Record, json_key: str = "text") -> str:
    """The document's text, or MalformedRecord saying what is wrong with it (bad UTF-8 or JSON, missing key...)."""
    try:
        text = record.raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MalformedRecord(record.path, record.line, f"not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if record.line == 0:
        return text
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise MalformedRecord(record.path, record.line, f"bad JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise MalformedRecord(record.path, record.line, f"expected a JSON object, got {type(obj).__name__}")
    if json_key not in obj:
        raise MalformedRecord(record.path, record.line, f"missing key {json_key!r}")
    value = obj[json_key]
    if not isinstance(value, str):
        raise MalformedRecord(record.path, record.line, f"key {json_key!r} holds {type(value).__name__}, not a string")
    return value


def iter_documents(files: list[str], json_key: str = "text", input_format: str = "auto",
                   skip_malformed: bool = True) -> Iterator[str]:
    """Document texts in order; malformed records are skipped (or raised with skip_malformed=False)."""
    for record in iter_records(files, input_format):
        try:
            yield decode_record(record, json_key)
        except MalformedRecord:
            if not skip_malformed:
                raise
