"""What megacoat trusts in a checkpoint: files are read as data, never as code, and each is checked against the
sha256 recorded when it was written.

- `safe_torch_load` reads a torch file with `weights_only=True`: tensors, containers, numbers and strings, plus
  the few plain classes megacoat's and DeepSpeed's own files hold (numpy arrays of the RNG state, DeepSpeed's
  loss scaler, ZeRO stage and fragment address). A file that asks for anything else is refused, naming the file.
- `file_manifest` / `verify_manifest`: {file name: {"bytes", "sha256"}} of a checkpoint's files, recorded in its
  megacoat.json; a file missing, resized or altered since is an error naming it. A checksum catches corruption,
  not a forger who rewrites megacoat.json too: loading stays safe (weights_only) either way.
Every failure is a `CheckpointFileError` (a ValueError: bad input, one error line).
"""
from __future__ import annotations

import hashlib
import importlib
import os
import pickle
import re
import zipfile

import torch


class CheckpointFileError(ValueError):
    """A checkpoint file that cannot be trusted or read (refused, corrupted, truncated, missing)."""


def _allowed_globals() -> list:
    import numpy as np

    allowed = [np.ndarray, np.dtype, np.dtypes.UInt32DType, torch.torch_version.TorchVersion]
    reconstruct = getattr(getattr(np, "_core", None), "multiarray", None) or np.core.multiarray
    allowed.append(reconstruct._reconstruct)
    for module, names in (("deepspeed.runtime.fp16.loss_scaler", ("LossScaler", "DynamicLossScaler")),
                          ("deepspeed.runtime.zero.config", ("ZeroStageEnum",)),
                          ("deepspeed.utils.tensor_fragment", ("fragment_address",))):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        allowed += [getattr(mod, n) for n in names if hasattr(mod, n)]
    return allowed


def safe_torch_load(path: str, map_location="cpu"):
    """torch.load(path, weights_only=True) with the allowed classes; any failure names the file."""
    if not os.path.isfile(path):
        raise CheckpointFileError(f"{path}: no such file")
    try:
        with torch.serialization.safe_globals(_allowed_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"unsupported (global|operand)\W+(GLOBAL )?[\w.]+", str(e), re.IGNORECASE)  # torch words it two ways
        if found:
            raise CheckpointFileError(f"{path}: refused: it holds Python code or objects, not only data "
                                      f"({found.group(0).strip()}); it may have been tampered with, and nothing in "
                                      f"it was run") from None
        raise CheckpointFileError(f"{path}: corrupted or not a torch file ({_first_line(e)})") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError, KeyError, AttributeError) as e:
        size = os.path.getsize(path)
        what = "empty" if size == 0 else "truncated or corrupted"
        raise CheckpointFileError(f"{path}: {what} ({size} bytes; {_first_line(e)})") from None


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:200] if lines else type(e).__name__


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_manifest(directory: str, names) -> dict[str, dict]:
    """{name: {"bytes": size, "sha256": hex}} of the files `names` in `directory`."""
    return {n: {"bytes": os.path.getsize(os.path.join(directory, n)), "sha256": sha256_file(os.path.join(directory, n))}
            for n in names}


def verify_manifest(directory: str, manifest: dict, names) -> None:
    """Check the files `names` (of `manifest`) in `directory`; the first that differs is an error naming it."""
    for name in names:
        path = os.path.join(directory, name)
        want = manifest[name]
        if not os.path.isfile(path):
            raise CheckpointFileError(f"{path}: missing (megacoat.json records it: the checkpoint is incomplete)")
        size = os.path.getsize(path)
        if size != want["bytes"]:
            raise CheckpointFileError(f"{path}: {size} bytes, but {want['bytes']} were written (truncated or "
                                      f"altered since the save)")
        if sha256_file(path) != want["sha256"]:
            raise CheckpointFileError(f"{path}: sha256 differs from the one recorded at the save (the file is "
                                      f"corrupted)")


def verify_manifest_shared(directory: str, manifest: dict) -> None:
    """verify_manifest over every file of `manifest`, shared out over the ranks when torch.distributed is up
    (collective then: every rank raises the same error)."""
    import torch.distributed as dist

    names = sorted(manifest)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        verify_manifest(directory, manifest, names)
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        verify_manifest(directory, manifest, names[rank::world])
        error = None
    except CheckpointFileError as e:
        error = str(e)
    errors = [None] * world
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointFileError(first)
