"""Finding one checkpoint: a `--save DIR` (the tag its `latest` names) or one `iter_*` directory inside it; and
replacing a small file (`latest`, megacoat.json) atomically.

`latest` may name only an `iter_N` directory that lies inside DIR (no other name, no link out of it); anything
else is an error naming DIR. A small file is replaced by writing a new file that no one else can have planted
(a fresh random name opened with O_EXCL, which also refuses a symlink) and renaming it over the old one.
"""
from __future__ import annotations

import os
import re
import tempfile

META_FILE = "megacoat.json"
LATEST_FILE = "latest"
TAG_PATTERN = r"iter_\d+"


def check_tag(directory: str, tag: str) -> str:
    """The path of checkpoint `tag` of `directory`, refusing a name that could lead out of it."""
    if not re.fullmatch(TAG_PATTERN, tag):
        raise ValueError(f"{directory}: '{LATEST_FILE}' names {tag!r}; it may name only an iter_N directory "
                         f"inside {directory}")
    path = os.path.join(directory, tag)
    if os.path.islink(path) or (os.path.exists(path) and os.path.dirname(os.path.realpath(path))
                                != os.path.realpath(directory)):
        raise ValueError(f"{path}: a link out of {directory}; a checkpoint must be a directory inside it")
    return path


def read_latest(directory: str) -> str | None:
    """The tag `directory/latest` names (checked by check_tag), or None without a `latest` file."""
    pointer = os.path.join(directory, LATEST_FILE)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        tag = f.read(256).strip()
    check_tag(directory, tag)
    return tag


def resolve_tag_dir(path: str) -> str:
    """A checkpoint directory (`--save DIR`, follows `latest`) or one tag directory inside it."""
    if os.path.isfile(os.path.join(path, META_FILE)):
        return path
    tag = read_latest(path)
    if tag is not None and os.path.isfile(os.path.join(path, tag, META_FILE)):
        return os.path.join(path, tag)
    raise FileNotFoundError(f"{path}: not a megacoat checkpoint (no {META_FILE}, no 'latest' naming one)")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: str, text: str) -> None:
    """Replace `path` by `text`: a kill leaves the old file or the new one, never a part, and no file but `path`
    is ever written (a planted `path.tmp` symlink is not followed)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def write_latest(directory: str, tag: str) -> None:
    """Point `directory/latest` at `tag`."""
    write_text_atomic(os.path.join(directory, LATEST_FILE), tag)
