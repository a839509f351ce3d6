"""The layout-free checkpoint format: what a run is, independent of how it was split over ranks.

    DIR/iter_0000100/
        megacoat.json              as in every megacoat checkpoint (iteration, consumed samples, config, ...) plus
                                   "format": "layout-free", "optimizer" ({kind, step, settings, keys} or null for
                                   weights only) and "lr_scheduler" (its state dict, or null)
        model.safetensors          every parameter, full (no TP/PP shard), fp32, under the plain GPT's names
                                   (`output.weight` absent when tied to the embedding)
        optim.<key>.safetensors    per-element optimizer state, full fp32 per parameter (`exp_avg`, `exp_avg_sq`)
        rng_rank00000.pt ...       the source run's RNG states, per rank (a rank of the new layout restores its own
                                   if the source had that rank)
    DIR/latest

safetensors so that each rank of a large model reads only its own slice of each tensor (memory-mapped,
`get_slice`), never the whole checkpoint. A directory is written under a temporary name and renamed when complete;
its megacoat.json records every file's sha256 ("files"), checked when a run loads it.
"""
from __future__ import annotations

import json
import os
import shutil

import torch

from megacoat.checkpoint.integrity import file_manifest
from megacoat.checkpoint.paths import META_FILE, write_text_atomic
from megacoat.checkpoint.sharding import tensor_parallel_dim

LAYOUT_FREE = "layout-free"
WEIGHTS_FILE = "model.safetensors"


def state_file(key: str) -> str:
    return f"optim.{key}.safetensors"


def is_layout_free(meta: dict) -> bool:
    return meta.get("format") == LAYOUT_FREE


def _save(tensors: dict[str, torch.Tensor], path: str) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().to("cpu", torch.float32).contiguous().clone() for k, v in tensors.items()}, path)


def write_layout_free(tag_dir: str, meta: dict, weights: dict[str, torch.Tensor],
                      state: dict[str, dict[str, torch.Tensor]] | None = None, rng_files: tuple[str, ...] = (),
                      tied: bool = False) -> str:
    """Write one layout-free checkpoint at `tag_dir` (atomically: into a temporary sibling, then renamed).
    `state`: {optimizer key: {parameter name: fp32 tensor}}; None for a weights-only checkpoint."""
    parent = os.path.dirname(os.path.abspath(tag_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, ".tmp-" + os.path.basename(tag_dir))
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    if tied:
        weights = {k: v for k, v in weights.items() if k != "output.weight"}
    _save(weights, os.path.join(tmp, WEIGHTS_FILE))
    for key, tensors in (state or {}).items():
        missing = set(weights) - set(tensors)
        if missing:
            raise ValueError(f"optimizer state {key!r} lacks parameters {sorted(missing)[:4]}")
        _save({k: tensors[k] for k in weights}, os.path.join(tmp, state_file(key)))
    for path in rng_files:
        shutil.copyfile(path, os.path.join(tmp, os.path.basename(path)))
    files = file_manifest(tmp, sorted(os.listdir(tmp)))  # the source's manifest described the source's files
    write_text_atomic(os.path.join(tmp, META_FILE), json.dumps({**meta, "format": LAYOUT_FREE, "files": files},
                                                               indent=1))
    # An existing one is moved aside, not deleted, until the new one is in place.
    aside = os.path.join(parent, ".old-" + os.path.basename(tag_dir))
    if os.path.lexists(tag_dir):
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(tag_dir, aside)
    os.rename(tmp, tag_dir)
    shutil.rmtree(aside, ignore_errors=True)
    return tag_dir


class LayoutFreeCheckpoint:
    """Reads one layout-free checkpoint; `tensor(name, ...)` returns a parameter's full tensor or one tensor-
    parallel rank's slice of it, in fp32, reading only that slice from disk."""

    def __init__(self, tag_dir: str):
        self.path = tag_dir
        with open(os.path.join(tag_dir, META_FILE)) as f:
            self.meta = json.load(f)
        if not is_layout_free(self.meta):
            raise ValueError(f"{tag_dir}: not a layout-free checkpoint")
        self.optimizer = self.meta.get("optimizer")  # None: weights only
        self.tied = self.meta["megacoat_config"]["model"]["tie_embeddings"]
        self._files: dict[str, object] = {}

    @property
    def state_keys(self) -> list[str]:
        return list(self.optimizer["keys"]) if self.optimizer else []

    def _file(self, key: str | None):
        name = WEIGHTS_FILE if key is None else state_file(key)
        if name not in self._files:
            from safetensors import safe_open

            self._files[name] = safe_open(os.path.join(self.path, name), framework="pt")
        return self._files[name]

    def names(self) -> list[str]:
        return list(self._file(None).keys())

    def tensor(self, name: str, key: str | None = None, tp_rank: int = 0, tp_size: int = 1) -> torch.Tensor:
        """Parameter `name` (key None) or its optimizer state `key`, sliced for `tp_rank` of `tp_size`."""
        if self.tied and name == "output.weight":
            name = "tok_embeddings.weight"
        f = self._file(key)
        if name not in f.keys():
            raise KeyError(f"{self.path}: no parameter {name!r} in {WEIGHTS_FILE if key is None else state_file(key)}")
        dim = tensor_parallel_dim(name)
        if tp_size == 1 or dim is None:
            return f.get_tensor(name).float()
        sl = f.get_slice(name)
        size = sl.get_shape()[dim]
        if size % tp_size:
            raise ValueError(f"{name}: dimension {dim} ({size}) does not split over {tp_size} tensor-parallel ranks")
        part = size // tp_size
        index = [slice(None)] * len(sl.get_shape())
        index[dim] = slice(tp_rank * part, (tp_rank + 1) * part)
        return sl[tuple(index)].float()

    def rng_file(self, rank: int) -> str | None:
        path = os.path.join(self.path, f"rng_rank{rank:05d}.pt")
        return path if os.path.isfile(path) else None
