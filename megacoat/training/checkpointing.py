"""Checkpoints: DeepSpeed's engine state (weights, optimizer, LR schedule) plus megacoat's own (iteration,
consumed samples, skipped steps, the config that made it, the parallel layout, the tokenizer's identity and
every rank's RNG states), written atomically.

Layout of `--save DIR`:
    DIR/iter_0000100/          one complete checkpoint: DeepSpeed's files, megacoat.json, rng_rank00000.pt, ...
    DIR/latest                 the tag of the newest complete checkpoint (DeepSpeed's convention)
    DIR/.tmp-iter_0000200/     a save in progress (or killed mid-way): never read, removed by the next save

A save writes everything into the temporary tag, all ranks barrier, then rank 0 renames it into place and
replaces `latest` (write-temp, fsync, os.replace). A kill at any moment therefore leaves `latest` naming a
complete checkpoint. DeepSpeed's loader finds its files by directory (`DIR/<tag>/mp_rank_00_model_states.pt`,
`DIR/<tag>/zero_pp_rank_*`): no file embeds the tag, so the rename is invisible to it.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

TAG_PREFIX = "iter_"
TMP_PREFIX = ".tmp-"
META_FILE = "megacoat.json"
LATEST_FILE = "latest"
FORMAT_VERSION = 1


class CheckpointMismatchError(ValueError):
    """--load names a checkpoint these flags cannot resume (another model, layout or tokenizer): bad input, which
    pretrain_gpt.py reports as one error line."""


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    skipped_steps: int = 0  # total over the run (the guard's consecutive count restarts at a resume)


@dataclass(frozen=True)
class Layout:
    """What must match between the run that saved and the one that loads (besides the model)."""
    world_size: int
    data_parallel_size: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    zero_stage: int
    fp8_optimizer: bool
    # What DeepSpeed and CoatAdamW keep as master weights and gradients: another choice is another optimizer layout
    # (a bf16 "fp32" partition plus remainders, or DeepSpeed's BF16_Optimizer under ZeRO-1 with fp32 gradients).
    main_params_dtype: str = "fp32"
    main_grads_dtype: str = "fp32"

    def incompatibilities(self, saved: dict) -> list[str]:
        """Reasons DeepSpeed cannot load a checkpoint saved with `saved` into this layout."""
        now = self.__dict__
        bad = [f"{k}: saved {saved[k]}, now {now[k]}" for k in
               ("tensor_model_parallel_size", "pipeline_model_parallel_size", "zero_stage", "fp8_optimizer",
                "main_params_dtype", "main_grads_dtype")
               if k in saved and saved[k] != now[k]]
        if any(k in saved and saved[k] != now[k] for k in ("main_params_dtype", "main_grads_dtype")):
            bad.append("resume with the --main-params-dtype / --main-grads-dtype the checkpoint was saved with")
        # ZeRO partitions the optimizer state over the data-parallel ranks; DeepSpeed cannot re-partition
        # ZeRO-1/2 states for another DP size. ZeRO-0 state is whole on every rank: any DP size loads it.
        if self.zero_stage and saved.get("data_parallel_size", self.data_parallel_size) != self.data_parallel_size:
            bad.append(f"data_parallel_size: saved {saved['data_parallel_size']}, now {self.data_parallel_size} "
                       f"(ZeRO-{self.zero_stage} optimizer state is partitioned over the data-parallel ranks)")
        return bad


def tag_for(iteration: int) -> str:
    return f"{TAG_PREFIX}{iteration:07d}"


def file_identity(path: str | None) -> dict | None:
    """Name and sha256 of a file (the tokenizer): a resumed run must read tokens the same way."""
    if not path:
        return None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return {"path": os.path.abspath(path), "sha256": h.hexdigest()}


# --- RNG states ---------------------------------------------------------------------------------------------
def get_rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _rng_file(rank: int) -> str:
    return f"rng_rank{rank:05d}.pt"


# --- small filesystem helpers -----------------------------------------------------------------------------
def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def list_checkpoints(directory: str) -> list[str]:
    """Complete checkpoint tags under `directory`, oldest first."""
    if not os.path.isdir(directory):
        return []
    tags = [n for n in os.listdir(directory) if re.fullmatch(rf"{TAG_PREFIX}\d+", n)
            and os.path.isfile(os.path.join(directory, n, META_FILE))]
    return sorted(tags, key=lambda n: int(n[len(TAG_PREFIX):]))


def latest_tag(directory: str) -> str | None:
    """The tag `latest` names; without a `latest` file (removed by hand), the newest complete checkpoint."""
    pointer = os.path.join(directory, LATEST_FILE)
    if os.path.isfile(pointer):
        with open(pointer) as f:
            tag = f.read().strip()
        if not os.path.isfile(os.path.join(directory, tag, META_FILE)):
            raise FileNotFoundError(f"--load {directory}: 'latest' names {tag!r}, which is not a complete "
                                    f"megacoat checkpoint (no {os.path.join(directory, tag, META_FILE)})")
        return tag
    tags = list_checkpoints(directory)
    return tags[-1] if tags else None


def _prune(directory: str, keep_last: int | None, current: str) -> list[str]:
    """Remove stale temporary saves and all but the newest `keep_last` complete checkpoints."""
    removed = []
    for name in os.listdir(directory):
        if name.startswith(TMP_PREFIX):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    if keep_last:
        for tag in list_checkpoints(directory)[:-keep_last]:
            if tag != current:
                shutil.rmtree(os.path.join(directory, tag), ignore_errors=True)
                removed.append(tag)
    return removed


# --- save / load ------------------------------------------------------------------------------------------
def save_checkpoint(engine, directory: str, state: TrainState, config_dict: dict, layout: Layout,
                    tokenizer: dict | None = None, keep_last: int | None = None) -> str:
    """Save on every rank (collective); returns the final checkpoint path."""
    tag = tag_for(state.iteration)
    tmp_tag = TMP_PREFIX + tag
    rank = dist.get_rank()
    if rank == 0:
        os.makedirs(directory, exist_ok=True)
        shutil.rmtree(os.path.join(directory, tmp_tag), ignore_errors=True)  # a killed earlier attempt
    dist.barrier()
    meta = {"format_version": FORMAT_VERSION, "iteration": state.iteration,
            "consumed_samples": state.consumed_samples, "skipped_steps": state.skipped_steps,
            "layout": layout.__dict__, "tokenizer": tokenizer, "megacoat_config": config_dict,
            "torch_version": torch.__version__}
    engine.save_checkpoint(directory, tag=tmp_tag, client_state={"megacoat": meta}, save_latest=False)
    tmp_path = os.path.join(directory, tmp_tag)
    os.makedirs(tmp_path, exist_ok=True)
    torch.save(get_rng_state(), os.path.join(tmp_path, _rng_file(rank)))
    if rank == 0:
        # Written last by rank 0: its presence marks a checkpoint complete (list_checkpoints relies on it).
        _write_atomic(os.path.join(tmp_path, META_FILE), json.dumps(meta, indent=1))
    dist.barrier()  # every rank's files are on disk before the checkpoint becomes visible
    final = os.path.join(directory, tag)
    if rank == 0:
        if os.path.exists(final):  # saving the same iteration twice (e.g. a resumed run): the new one wins
            shutil.rmtree(final)
        os.rename(tmp_path, final)
        _fsync_dir(directory)
        _write_atomic(os.path.join(directory, LATEST_FILE), tag)
        _prune(directory, keep_last, tag)
    dist.barrier()
    return final


def _model_diff(saved: dict, now: dict) -> dict:
    keys = sorted(set(saved) | set(now))
    return {k: (saved.get(k), now.get(k)) for k in keys if saved.get(k) != now.get(k)}


def load_checkpoint(engine, directory: str, config_dict: dict, layout: Layout,
                    tokenizer: dict | None = None) -> tuple[str, TrainState] | None:
    """Load the checkpoint `latest` names (collective). None when `directory` holds none yet. A checkpoint
    made by another model, tokenizer or an incompatible parallel layout is an error naming what differs,
    raised before DeepSpeed reads anything."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"--load {directory}: no such directory")
    tag = latest_tag(directory)
    if tag is None:
        return None
    path = os.path.join(directory, tag)
    with open(os.path.join(path, META_FILE)) as f:
        meta = json.load(f)
    saved_model, now_model = meta["megacoat_config"]["model"], config_dict["model"]
    if saved_model != now_model:
        raise CheckpointMismatchError(f"--load {path}: the checkpoint's model differs from the flags "
                                      f"(field: (saved, now)): {_model_diff(saved_model, now_model)}")
    bad = layout.incompatibilities(meta["layout"])
    if bad:
        raise CheckpointMismatchError(f"--load {path}: incompatible parallel layout: " + "; ".join(bad))
    if meta.get("tokenizer") and tokenizer and meta["tokenizer"]["sha256"] != tokenizer["sha256"]:
        raise CheckpointMismatchError(
            f"--load {path}: the checkpoint was trained with tokenizer {meta['tokenizer']['path']} "
            f"(sha256 {meta['tokenizer']['sha256'][:12]}...), not {tokenizer['path']} "
            f"(sha256 {tokenizer['sha256'][:12]}...)")
    loaded, _ = engine.load_checkpoint(directory, tag=tag)
    if loaded is None:
        raise RuntimeError(f"--load {path}: DeepSpeed could not load this checkpoint")
    rng_path = os.path.join(path, _rng_file(dist.get_rank()))
    if os.path.isfile(rng_path):  # absent when resuming on more ranks than saved (ZeRO-0): keep the seeds
        set_rng_state(torch.load(rng_path, weights_only=False))
    return path, TrainState(meta["iteration"], meta["consumed_samples"], meta.get("skipped_steps", 0))
