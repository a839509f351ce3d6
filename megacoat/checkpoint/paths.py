"""Finding one checkpoint: a `--save DIR` (the tag its `latest` names) or one `iter_*` directory inside it."""
from __future__ import annotations

import os

META_FILE = "megacoat.json"
LATEST_FILE = "latest"


def resolve_tag_dir(path: str) -> str:
    """A checkpoint directory (`--save DIR`, follows `latest`) or one tag directory inside it."""
    if os.path.isfile(os.path.join(path, META_FILE)):
        return path
    latest = os.path.join(path, LATEST_FILE)
    if os.path.isfile(latest):
        with open(latest) as f:
            tag_dir = os.path.join(path, f.read().strip())
        if os.path.isfile(os.path.join(tag_dir, META_FILE)):
            return tag_dir
    raise FileNotFoundError(f"{path}: not a megacoat checkpoint (no {META_FILE}, no 'latest' naming one)")


def write_latest(directory: str, tag: str) -> None:
    """Point `directory/latest` at `tag` (write a temporary file, then rename)."""
    tmp = os.path.join(directory, LATEST_FILE + ".tmp")
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, LATEST_FILE))
