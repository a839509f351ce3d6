"""Checkpoints: DeepSpeed's engine state (weights, optimizer, LR schedule) plus megacoat's own (iteration,
consumed samples, skipped steps, the config that made it, the parallel layout, the tokenizer's identity and
every rank's RNG states), written atomically.

Layout of `--save DIR`:
    DIR/iter_0000100/          one complete checkpoint: DeepSpeed's files, megacoat.json, rng_rank00000.pt, ...
    DIR/latest                 the tag of the newest complete checkpoint (DeepSpeed's convention)
    DIR/.tmp-iter_0000200/     a save in progress (or killed mid-way): never read, removed by the next save
    DIR/iter_0000100/layout_free/   made on a --load by another layout or optimizer (training/reshard.py)

A save writes everything into the temporary tag, all ranks barrier, then rank 0 renames it into place and
replaces `latest` (write-temp, fsync, os.replace). A kill at any moment therefore leaves `latest` naming a
complete checkpoint. DeepSpeed's loader finds its files by directory (`DIR/<tag>/mp_rank_00_model_states.pt`,
`DIR/<tag>/zero_pp_rank_*`): no file embeds the tag, so the rename is invisible to it.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megacoat.checkpoint.layout_free import is_layout_free
from megacoat.training import reshard
from megacoat.training.rng_state import get_rng_state, set_rng_state

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
        """Reasons DeepSpeed cannot load a checkpoint saved with `saved` into this layout as it is (the loader then
        goes through the layout-free form; the optimizer is compared separately, reshard.optimizer_changes)."""
        now = self.__dict__
        bad = [f"{k}: saved {saved[k]}, now {now[k]}" for k in
               ("tensor_model_parallel_size", "pipeline_model_parallel_size", "zero_stage")
               if k in saved and saved[k] != now[k]]
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


# --- what --load names ------------------------------------------------------------------------------------
def resolve_load(load: str, save: str | None = None) -> tuple[str, str] | None:
    """(checkpoint directory, tag) that `--load` names, checked before any model is built.

    `--load DIR` is the save directory: its `latest` (or, without one, its newest complete checkpoint).
    `--load DIR/iter_0000100` is that one checkpoint (DeepSpeed's tag). None (start from scratch) only where
    that is plainly meant: `--load` is the `--save` directory and holds no checkpoint yet (the first run of a
    job that resumes itself). Anything else that holds no checkpoint is an error naming the path.
    """
    path = os.path.normpath(load)
    if os.path.isfile(os.path.join(path, META_FILE)):  # one checkpoint: DIR/iter_N
        return os.path.dirname(path) or ".", os.path.basename(path)
    first_run = save is not None and os.path.abspath(path) == os.path.abspath(os.path.normpath(save))
    if not os.path.isdir(path):
        if first_run:
            return None
        raise FileNotFoundError(f"--load {load}: no such directory")
    tag = latest_tag(path)
    if tag is not None:
        return path, tag
    if first_run:
        return None
    name = os.path.basename(path)
    if name.startswith(TAG_PREFIX) or name.startswith(TMP_PREFIX + TAG_PREFIX):
        raise FileNotFoundError(f"--load {load}: not a complete megacoat checkpoint (no {META_FILE}; a save that "
                                f"was interrupted, or not written by megacoat)")
    raise FileNotFoundError(f"--load {load}: no checkpoint in this directory (neither {LATEST_FILE} nor "
                            f"{TAG_PREFIX}N/{META_FILE}); to start from scratch drop --load, or give the same "
                            f"directory to --save and --load")


def read_meta(directory: str, tag: str) -> dict:
    path = os.path.join(directory, tag, META_FILE)
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"--load {os.path.join(directory, tag)}: {path} is not valid JSON ({e})") from None


def check_compatible(path: str, meta: dict, config_dict: dict, layout: Layout, tokenizer: dict | None = None,
                     *, finetune: bool = False, convert_optimizer: bool = False) -> None:
    """Refuse a checkpoint made by another model or tokenizer, or holding another optimizer's state without
    `convert_optimizer`, naming what differs. Reads only megacoat.json: runs before the model is built. Another
    parallel layout is no error: load_checkpoint reshards through the layout-free form."""
    saved_model, now_model = meta["megacoat_config"]["model"], config_dict["model"]
    # Fine-tuning may train at another sequence length; the initialisation's std does not matter to loaded weights.
    ignored = ("seq_length", "init_std") if finetune else ()
    diff = {k: v for k, v in _model_diff(saved_model, now_model).items() if k not in ignored}
    if diff:
        raise CheckpointMismatchError(f"--load {path}: the checkpoint's model differs from the flags "
                                      f"(field: (saved, now)): {diff}")
    saved_layout = meta.get("layout") or {}  # a layout-free checkpoint (e.g. from Hugging Face) has none
    masters = [f"{k}: saved {saved_layout[k]}, now {getattr(layout, k)}"
               for k in ("main_params_dtype", "main_grads_dtype")
               if k in saved_layout and saved_layout[k] != getattr(layout, k)]
    if masters and not finetune:
        raise CheckpointMismatchError(f"--load {path}: the checkpoint keeps its master weights and gradients otherwise "
                                      f"({'; '.join(masters)}): resume with the flags it was saved with, or --finetune")
    changed = optimizer_changes_of(meta, config_dict, finetune)
    if changed and not convert_optimizer:
        raise CheckpointMismatchError(
            f"--load {path}: the checkpoint's optimizer state is not this run's: " + "; ".join(changed)
            + ". Pass --override-optimizer-state convert to convert it (moments kept as fp32 and re-quantized), "
            "or --finetune to start the optimizer afresh")
    if meta.get("tokenizer") and tokenizer and meta["tokenizer"]["sha256"] != tokenizer["sha256"]:
        raise ValueError(f"--load {path}: the checkpoint was trained with tokenizer {meta['tokenizer']['path']} "
                         f"(sha256 {meta['tokenizer']['sha256'][:12]}...), not {tokenizer['path']} "
                         f"(sha256 {tokenizer['sha256'][:12]}...)")


def scaling_changes(meta: dict, config_dict: dict) -> list[str]:
    """The FP8 switches (scaling, the output layer) that differ from the checkpoint's run, as notes: switching is
    allowed (the amax histories start afresh, or are dropped; the head's weight is the same parameter either way), but
    a run resumed after the default changed should not switch silently."""
    saved = (meta.get("megacoat_config") or {}).get("fp8") or {}
    now = config_dict.get("fp8") or {}
    notes = []
    for key, flag in (("grad_scaling", "--fp8-grad-scaling"), ("activation_scaling", "--fp8-activation-scaling"),
                      ("output_layer", "--fp8-output-layer")):
        if key in saved and key in now and saved[key] != now[key]:
            was, now_ = (("on" if v else "off") if isinstance(v, bool) else v for v in (saved[key], now[key]))
            notes.append(f"note: the checkpoint was trained with {flag} {was}, this run uses {now_} "
                         f"(pass {flag} {was} to keep it)")
    return notes


def optimizer_changes_of(meta: dict, config_dict: dict, finetune: bool) -> list[str]:
    """What differs between the optimizer state the checkpoint holds and this run's (empty when none is loaded)."""
    if finetune or (is_layout_free(meta) and not meta.get("optimizer")):
        return []
    return reshard.optimizer_changes(meta["megacoat_config"].get("optim", {}), config_dict.get("optim", {}))


def load_checkpoint(engine, directory: str, config_dict: dict, layout: Layout, tokenizer: dict | None = None,
                    tag: str | None = None, *, tp_rank: int = 0, finetune: bool = False,
                    convert_optimizer: bool = False) -> tuple[str, TrainState] | None:
    """Load checkpoint `tag` of `directory` (default: the one `latest` names; collective). None when
    `directory` holds none yet. A checkpoint made by another model or tokenizer is an error naming what differs
    (check_compatible), raised before anything is read.

    DeepSpeed loads its own files when the layout and the optimizer are the ones that saved them. Otherwise, and
    for a layout-free checkpoint (tools/convert_checkpoint.py, tools/convert_from_hf.py), every rank takes its
    slices of the layout-free form (training/reshard.py). Another optimizer (AdamW <-> CoatAdamW, other
    CoatAdamW formats or group size) needs `convert_optimizer` (--override-optimizer-state convert).
    `finetune` (--finetune): weights only; iteration, data position, optimizer and LR schedule start at zero."""
    if tag is None:
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"--load {directory}: no such directory")
        tag = latest_tag(directory)
        if tag is None:
            return None
    path = os.path.join(directory, tag)
    meta = read_meta(directory, tag)
    check_compatible(path, meta, config_dict, layout, tokenizer, finetune=finetune,
                     convert_optimizer=convert_optimizer)
    layout_free = is_layout_free(meta)
    changed = optimizer_changes_of(meta, config_dict, finetune)
    if not layout_free and not finetune and not changed and not layout.incompatibilities(meta["layout"]):
        loaded, _ = engine.load_checkpoint(directory, tag=tag)
        if loaded is None:
            raise ValueError(f"--load {path}: DeepSpeed could not load this checkpoint")
        rng_path = os.path.join(path, _rng_file(dist.get_rank()))
        if os.path.isfile(rng_path):  # absent when resuming on more ranks than saved (ZeRO-0): keep the seeds
            set_rng_state(torch.load(rng_path, weights_only=False))
        return path, TrainState(meta["iteration"], meta["consumed_samples"], meta.get("skipped_steps", 0))
    if not layout_free:
        path = reshard.ensure_layout_free(path, need_state=not finetune)
    meta = reshard.load_layout_free(engine, path, tp_rank, meta["megacoat_config"]["model"]["num_layers"],
                                    layout.tensor_model_parallel_size, finetune)
    if finetune:
        return path, TrainState()
    return path, TrainState(meta["iteration"], meta["consumed_samples"], meta.get("skipped_steps", 0))
