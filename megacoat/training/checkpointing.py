"""Checkpoints: DeepSpeed's engine state (weights, optimizer, LR schedule) plus megacoat's own (iteration,
consumed samples, skipped steps, run id, the config that made it, the parallel layout, the tokenizer's identity,
every rank's RNG states and every file's sha256), written atomically and read as data only.

Layout of `--save DIR`:
    DIR/iter_0000100/          one complete checkpoint: DeepSpeed's files, megacoat.json, rng_rank00000.pt, ...
    DIR/latest                 the tag of the newest complete checkpoint (DeepSpeed's convention)
    DIR/.tmp-iter_0000200/     a save in progress (or killed mid-way): never read, removed by the next save
    DIR/.old-iter_0000100/     a checkpoint being replaced by a new save of the same iteration (read only if
                               the replacement was killed before it took its place)
    DIR/iter_0000100/layout_free/   made on a --load by another layout or optimizer (training/reshard.py)

Guarantees: a kill at any moment leaves `latest` naming a complete checkpoint (a save is written under the
temporary tag and renamed into place; a re-save moves the old copy aside first and removes it only after);
non-finite weights or optimizer state are never saved; a failed write (a full disk) removes the partial save;
every file loads with weights_only=True (megacoat.checkpoint.integrity), DeepSpeed's too; a file that changed
since the save, or a megacoat.json whose iteration or sample count disagrees with DeepSpeed's own, is refused.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megacoat.checkpoint.integrity import file_manifest, safe_torch_load, verify_manifest_shared
from megacoat.checkpoint.layout_free import is_layout_free
from megacoat.checkpoint.paths import fsync_dir, read_latest, write_text_atomic
from megacoat.training import reshard
from megacoat.training.rng_state import get_rng_state, load_rng_file
from megacoat.training.stability import NonFiniteTrainingError

TAG_PREFIX = "iter_"
TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"
META_FILE = "megacoat.json"
LATEST_FILE = "latest"
FORMAT_VERSION = 1


class CheckpointWriteError(OSError):
    """A save the file system refused (a full disk): the partial save is removed, `latest` untouched."""


class CheckpointMismatchError(ValueError):
    """--load names a checkpoint these flags cannot resume (another model, layout or tokenizer): bad input, which
    pretrain_gpt.py reports as one error line."""


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    skipped_steps: int = 0  # total over the run (the guard's consecutive count restarts at a resume)
    # Which run wrote a checkpoint: --keep-last prunes only this run's. Kept across resumes; new for --finetune.
    run_id: str | None = field(default=None, compare=False)


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
def _complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, META_FILE))


def list_checkpoints(directory: str) -> list[str]:
    """Complete checkpoint tags under `directory`, oldest first."""
    if not os.path.isdir(directory):
        return []
    tags = [n for n in os.listdir(directory) if re.fullmatch(rf"{TAG_PREFIX}\d+", n)
            and not os.path.islink(os.path.join(directory, n)) and _complete(os.path.join(directory, n))]
    return sorted(tags, key=lambda n: int(n[len(TAG_PREFIX):]))


def latest_tag(directory: str) -> str | None:
    """The tag `latest` names; without a `latest` file (removed by hand), the newest complete checkpoint. A
    re-save killed between moving the old copy aside and renaming the new one into place leaves the old copy
    under OLD_PREFIX + tag: that is the tag returned then."""
    try:
        tag = read_latest(directory)
    except ValueError as e:
        raise ValueError(f"--load {e}") from None
    if tag is not None:
        if not os.path.exists(os.path.join(directory, tag)) and _complete(os.path.join(directory, OLD_PREFIX + tag)):
            return OLD_PREFIX + tag
        if not _complete(os.path.join(directory, tag)):
            raise FileNotFoundError(f"--load {directory}: 'latest' names {tag!r}, which is not a complete "
                                    f"megacoat checkpoint (no {os.path.join(directory, tag, META_FILE)})")
        return tag
    tags = list_checkpoints(directory)
    return tags[-1] if tags else None


def _run_of(directory: str, tag: str) -> str | None:
    try:
        with open(os.path.join(directory, tag, META_FILE)) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    return meta.get("run_id") if isinstance(meta, dict) else None


def _clean_up(directory: str) -> None:
    """Remove killed saves; put back an old copy whose replacement never took its place."""
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if name.startswith(TMP_PREFIX):
            shutil.rmtree(path, ignore_errors=True)
        elif name.startswith(OLD_PREFIX) and not os.path.islink(path):
            final = os.path.join(directory, name[len(OLD_PREFIX):])
            if _complete(final):
                shutil.rmtree(path, ignore_errors=True)
            elif not os.path.lexists(final):
                os.rename(path, final)


def _prune(directory: str, keep_last: int | None, current: str, run_id: str | None) -> tuple[list[str], list[str]]:
    """Remove all but the newest `keep_last` complete checkpoints of run `run_id`: (removed, other runs' kept)."""
    removed, others = [], []
    if keep_last:
        ours = []
        for tag in list_checkpoints(directory):
            (ours if run_id is not None and _run_of(directory, tag) == run_id else others).append(tag)
        for tag in ours[:-keep_last]:
            if tag != current:
                shutil.rmtree(os.path.join(directory, tag), ignore_errors=True)
                removed.append(tag)
    return removed, [t for t in others if t != current]


def _publish(directory: str, tmp_path: str, tag: str) -> None:
    """Rename the finished save into place and point `latest` at it, never without a complete copy: an existing
    checkpoint of the same tag is first moved aside (latest_tag reads it there) and removed only at the end."""
    final, aside = os.path.join(directory, tag), os.path.join(directory, OLD_PREFIX + tag)
    if os.path.lexists(final):
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
    os.rename(tmp_path, final)
    fsync_dir(directory)
    write_text_atomic(os.path.join(directory, LATEST_FILE), tag)
    shutil.rmtree(aside, ignore_errors=True)


# --- what a save refuses ------------------------------------------------------------------------------------
def _state_tensors(engine):
    """(name, tensor) of everything a save writes that must be finite: weights, buffers (the FP8 amax histories
    and scales), the optimizer's master weights and states (FP8 moments and their scales)."""
    module = getattr(engine, "module", None)
    if module is not None:
        yield from module.named_parameters()
        yield from ((n, b) for n, b in module.named_buffers() if b.is_floating_point())
    seen = set()
    opt = getattr(engine, "optimizer", None)
    for optimizer in (opt, getattr(opt, "optimizer", None)):
        if not isinstance(optimizer, torch.optim.Optimizer) or id(optimizer) in seen:
            continue
        seen.add(id(optimizer))
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                yield f"optimizer group {g} parameter {i}", p
                for key, value in optimizer.state.get(p, {}).items():
                    if torch.is_tensor(value) and value.is_floating_point():
                        yield f"optimizer state {key!r} of group {g} parameter {i}", value


def _nonfinite(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.element_size() == 1:  # FP8: no isfinite kernel for every format; the upcast is exact
        t = t.float()
    return (~torch.isfinite(t)).any()


def first_nonfinite(engine) -> str | None:
    """The name of the first non-finite tensor a save would write on any rank (collective), or None."""
    tensors = list(_state_tensors(engine))
    device = tensors[0][1].device if tensors else torch.device("cpu")
    flag = torch.zeros(1, dtype=torch.int64, device=device)
    if tensors:  # one host sync for all of them
        flag = torch.stack([_nonfinite(t).to(device) for _, t in tensors]).any().long().reshape(1)
    if dist.get_world_size() > 1:
        flag = flag.to("cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not int(flag.item()):
        return None
    return next((name for name, t in tensors if bool(_nonfinite(t))), "a tensor of another rank")


def _write_failure(e: BaseException) -> str | None:
    """The cause of a refused write, or None when `e` is no file-system error. torch.save reports a full disk
    as a RuntimeError of its zip writer ('unexpected pos', 'file write failed'), with no errno."""
    if isinstance(e, OSError):
        return os.strerror(e.errno) if e.errno else (str(e) or type(e).__name__)
    text = str(e)
    if isinstance(e, RuntimeError) and any(s in text for s in ("unexpected pos", "file write failed",
                                                                "failed writing", "No space left")):
        first = " ".join(text.split())[:160]
        return f"{os.strerror(errno.ENOSPC)} (torch: {first})"
    return None


def _kept(directory: str) -> str | None:
    """The checkpoint a failed save leaves in place, for its message (None: there is none)."""
    try:
        return latest_tag(directory) if os.path.isdir(directory) else None
    except (OSError, ValueError):
        return None


# --- save / load ------------------------------------------------------------------------------------------
def _already_saved(final: str, state: TrainState, resumed_from: str | None) -> bool:
    """This run resumed from `final` and has not stepped since: saving it again would only risk the copy."""
    if not resumed_from or os.path.realpath(resumed_from) != os.path.realpath(final) or not _complete(final):
        return False
    try:
        with open(os.path.join(final, META_FILE)) as f:
            return json.load(f).get("iteration") == state.iteration
    except (OSError, ValueError, AttributeError):
        return False


def save_checkpoint(engine, directory: str, state: TrainState, config_dict: dict, layout: Layout,
                    tokenizer: dict | None = None, keep_last: int | None = None, *, resumed_from: str | None = None,
                    log=None) -> str:
    """Save on every rank (collective); returns the final checkpoint path. `resumed_from`: the checkpoint this
    run loaded (not saved again while unchanged). `log`: where notes go (rank 0). Raises NonFiniteTrainingError
    for non-finite state and CheckpointWriteError for a refused write; either leaves `latest` as it was."""
    log = log or (lambda line: None)
    tag = tag_for(state.iteration)
    tmp_tag = TMP_PREFIX + tag
    final = os.path.join(directory, tag)
    rank = dist.get_rank()
    if _already_saved(final, state, resumed_from):
        log(f"checkpoint {final} already holds iteration {state.iteration}: not saved again")
        return final
    bad = first_nonfinite(engine)
    if bad is not None:
        kept = _kept(directory)
        kept = f"{os.path.join(directory, kept)} is kept" if kept else "nothing was saved"
        raise NonFiniteTrainingError(f"--save {directory}: refusing to save iteration {state.iteration}: {bad} "
                                     f"holds NaN or Inf ({kept})")
    if state.run_id is None:
        state.run_id = uuid.uuid4().hex  # only rank 0's is written
    tmp_path = os.path.join(directory, tmp_tag)
    try:
        if rank == 0:
            os.makedirs(directory, exist_ok=True)
            _clean_up(directory)
        dist.barrier()
        meta = {"format_version": FORMAT_VERSION, "iteration": state.iteration,
                "consumed_samples": state.consumed_samples, "skipped_steps": state.skipped_steps,
                "run_id": state.run_id, "layout": layout.__dict__, "tokenizer": tokenizer,
                "megacoat_config": config_dict, "torch_version": torch.__version__}
        engine.save_checkpoint(directory, tag=tmp_tag, client_state={"megacoat": meta}, save_latest=False)
        os.makedirs(tmp_path, exist_ok=True)
        torch.save(get_rng_state(), os.path.join(tmp_path, _rng_file(rank)))
        dist.barrier()  # every rank's files are on disk: hash them, each rank its share
        names = sorted(n for n in os.listdir(tmp_path) if os.path.isfile(os.path.join(tmp_path, n)))
        shares = [None] * dist.get_world_size()
        dist.all_gather_object(shares, file_manifest(tmp_path, names[rank::dist.get_world_size()]))
        if rank == 0:
            meta["files"] = {k: v for share in shares for k, v in share.items()}
            # Written last by rank 0: its presence marks a checkpoint complete (list_checkpoints relies on it).
            write_text_atomic(os.path.join(tmp_path, META_FILE), json.dumps(meta, indent=1))
    except (OSError, RuntimeError) as e:
        cause = _write_failure(e)
        if cause is None:
            raise
        shutil.rmtree(tmp_path, ignore_errors=True)
        kept = _kept(directory)
        kept = f"'latest' still names {kept}" if kept else "no earlier checkpoint"
        raise CheckpointWriteError(f"--save {directory}: writing {tag} failed: {cause}; the partial save was "
                                   f"removed ({kept})") from None
    dist.barrier()  # every rank's files are on disk before the checkpoint becomes visible
    if rank == 0:
        _publish(directory, tmp_path, tag)
        removed, others = _prune(directory, keep_last, tag, state.run_id)
        if others:
            log(f"--keep-last {keep_last}: kept {', '.join(others)} in {directory} (not written by this run)")
    log(f"saved checkpoint {final}")
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


# megacoat.json's keys: (types allowed, required). Checked before anything else reads them.
_META_KEYS = {"iteration": ((int,), True), "consumed_samples": ((int,), True), "megacoat_config": ((dict,), True),
              "skipped_steps": ((int,), False), "layout": ((dict, type(None)), False),
              "tokenizer": ((dict, type(None)), False), "files": ((dict,), False), "run_id": ((str, type(None)), False)}
_KIND = {int: "a non-negative integer", dict: "an object", str: "a string"}


def check_meta(path: str, meta) -> dict:
    """`meta` (the megacoat.json at `path`) as megacoat wrote it: an object whose keys have their types."""
    def bad(what: str):
        return ValueError(f"--load {os.path.dirname(path)}: {path}: {what}")

    if not isinstance(meta, dict):
        raise bad(f"not a JSON object (a {type(meta).__name__})")
    for key, (types, required) in _META_KEYS.items():
        if key not in meta:
            if required:
                raise bad(f"no {key!r}")
            continue
        value = meta[key]
        if not isinstance(value, types) or isinstance(value, bool) or (isinstance(value, int) and value < 0):
            raise bad(f"{key!r} is {value!r}, not {_KIND[types[0]]}")
    if not isinstance(meta["megacoat_config"].get("model"), dict):
        raise bad("'megacoat_config' has no 'model' object")
    if not is_layout_free(meta) and not isinstance(meta.get("layout"), dict):
        raise bad("no 'layout' object")
    tok = meta.get("tokenizer")
    if tok is not None and not (isinstance(tok.get("sha256"), str) and isinstance(tok.get("path"), str)):
        raise bad("'tokenizer' needs 'path' and 'sha256' strings")
    for name, entry in (meta.get("files") or {}).items():
        if (os.path.basename(name) != name or not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int)
                or not isinstance(entry.get("sha256"), str)):
            raise bad(f"'files' entry {name!r} is not {{'bytes': int, 'sha256': str}} for a file of the checkpoint")
    return meta


def read_meta(directory: str, tag: str) -> dict:
    path = os.path.join(directory, tag, META_FILE)
    try:
        with open(path) as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--load {os.path.join(directory, tag)}: {path} is not valid JSON ({e})") from None
    return check_meta(path, meta)


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
    if meta.get("files"):  # before anything reads them, the layout-free conversion included
        verify_manifest_shared(path, meta["files"])
    if not layout_free and not finetune and not changed and not layout.incompatibilities(meta["layout"]):
        _load_deepspeed_files(engine, directory, tag)
        _check_engine_counts(engine, path, meta)
        rng_path = os.path.join(path, _rng_file(dist.get_rank()))
        if os.path.isfile(rng_path):  # absent when resuming on more ranks than saved (ZeRO-0): keep the seeds
            load_rng_file(rng_path)
        return path, TrainState(meta["iteration"], meta["consumed_samples"], meta.get("skipped_steps", 0),
                                meta.get("run_id"))
    if not layout_free:
        path = reshard.ensure_layout_free(path, need_state=not finetune)
    loaded = reshard.load_layout_free(engine, path, tp_rank, meta["megacoat_config"]["model"]["num_layers"],
                                      layout.tensor_model_parallel_size, finetune)
    if finetune:
        return path, TrainState()
    return path, TrainState(loaded["iteration"], loaded["consumed_samples"], loaded.get("skipped_steps", 0),
                            meta.get("run_id"))


class SafeCheckpointEngine:
    """DeepSpeed's checkpoint engine for loading: every file it reads goes through safe_torch_load
    (weights_only) instead of DeepSpeed's torch.load(weights_only=False); the rest is the engine's own."""

    def __init__(self, inner):
        self.inner = inner

    def load(self, path: str, map_location=None):
        return safe_torch_load(path, map_location=map_location or "cpu")

    def __getattr__(self, name):
        return getattr(self.inner, name)


@contextlib.contextmanager
def safe_deepspeed_loads(engine):
    """For the duration: DeepSpeed reads a checkpoint's files as data only (SafeCheckpointEngine)."""
    inner = getattr(engine, "checkpoint_engine", None)
    if inner is None:
        yield
        return
    engine.checkpoint_engine = SafeCheckpointEngine(inner)
    try:
        yield
    finally:
        engine.checkpoint_engine = inner


def _load_deepspeed_files(engine, directory: str, tag: str) -> None:
    path = os.path.join(directory, tag)
    try:
        with safe_deepspeed_loads(engine):
            loaded, _ = engine.load_checkpoint(directory, tag=tag)
    except RuntimeError as e:  # load_state_dict: the weights are not the model megacoat.json describes
        if "size mismatch" not in str(e) and "Error(s) in loading state_dict" not in str(e):
            raise
        detail = next((line.strip() for line in str(e).splitlines() if "size mismatch" in line), str(e)[:200])
        raise ValueError(f"--load {path}: the weights do not fit the model its {META_FILE} describes "
                         f"({detail})") from None
    except (AssertionError, FileNotFoundError) as e:  # DeepSpeed's own checks: a file it needs is not there
        raise ValueError(f"--load {path}: DeepSpeed could not load this checkpoint ({e})") from None
    if loaded is None:
        raise ValueError(f"--load {path}: DeepSpeed could not load this checkpoint")


def _check_engine_counts(engine, path: str, meta: dict) -> None:
    """megacoat.json's iteration and sample count are DeepSpeed's own step and sample counters in the
    model-states file: a megacoat.json edited or taken from another checkpoint disagrees."""
    steps, samples = getattr(engine, "global_steps", None), getattr(engine, "global_samples", None)
    if not isinstance(steps, int) or not isinstance(samples, int):
        return
    if (steps, samples) != (meta["iteration"], meta["consumed_samples"]):
        raise ValueError(f"--load {path}: {META_FILE} says iteration {meta['iteration']} and "
                         f"{meta['consumed_samples']} consumed samples, but DeepSpeed's model-states file says "
                         f"{steps} steps and {samples} samples ({META_FILE} was altered, or is another "
                         f"checkpoint's)")
