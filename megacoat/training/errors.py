"""How a run that cannot go on says so: one `error:` line that names the flag or file, a non-zero exit status
on every rank, and no Python traceback unless `--debug` or MEGACOAT_DEBUG=1 asks for one.

Every rank runs the same checks on the same files and flags, so every rank fails with the same message; the
first rank of each node prints it (one line per node, not one per GPU), every rank exits with status 1 and
DeepSpeed's launcher then stops the node's other processes.
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager

DEBUG_ENV = "MEGACOAT_DEBUG"
EXIT_STATUS = 1

# Raised by megacoat's own checks of what the user gave it (flags, data shards, checkpoints, tokenizer files):
# ValueError for content that does not fit (the message names the flag or file), OSError for paths.
INPUT_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError)


def debug_requested(flag: bool = False) -> bool:
    return flag or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def error_line(e: BaseException) -> str:
    """`error: <message>` on one line (a multi-line message is joined; an OSError keeps its file name)."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if text.startswith("error: ") else f"error: {text}"


def prints_errors() -> bool:
    """Whether this process prints the run's `error:` line: the first rank of each node."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


@contextmanager
def one_line_errors(kinds: tuple[type[BaseException], ...] = INPUT_ERRORS, debug: bool = False):
    """Turn an exception of `kinds` into `error: ...` and exit status 1; anything else (a bug) keeps its
    traceback. With debug the traceback of every error is shown."""
    try:
        yield
    except kinds as e:
        if debug_requested(debug):
            raise
        if prints_errors():
            print(error_line(e), file=sys.stderr, flush=True)
        raise SystemExit(EXIT_STATUS) from None
