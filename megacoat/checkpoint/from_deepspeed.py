"""Read a megacoat checkpoint in DeepSpeed's files (any ZeRO stage, tensor- and pipeline-parallel shards) into
full per-parameter fp32 tensors, offline on the CPU, and write it as a layout-free checkpoint.

DeepSpeed's files (per model-parallel rank mp = pipeline stage x TP size + TP rank, and data-parallel rank dp):
- ZeRO-1/2: `zero_pp_rank_{dp}_mp_rank_{mp}_optim_states.pt` (`bf16_zero_pp_rank_...` under --bf16) hold this
  rank's flat master partition of each parameter group, the optimizer's state for it (CoatAdamW: FP8 codes with
  groups along the partition) and `param_slice_mappings` (name -> offset and length of the parameter's fragment
  in the partition). A parameter's fragments, in data-parallel rank order, concatenate to the whole (TP-local)
  parameter. The weights are the master: the fp32 partition, or under --main-params-dtype bf16-remainder the bf16
  partition joined with CoatAdamW's `remainder` state (megacoat.ops.param_remainder), exact fp32 either way.
- ZeRO-3: `zero_pp_rank_{dp}_mp_rank_{mp}_model_states.pt` per rank (no weights in its module: they are
  partitioned) and the optimizer file of ZeRO-1/2's name, whose `fp32_flat_groups[i]` concatenates this rank's
  partition of each parameter of sub-group i in `param_shapes` order. Each parameter is partitioned on its own:
  rank dp holds elements [dp * ceil(n / D), (dp + 1) * ceil(n / D)) of its flattened n elements, zero-padded at
  the end (DeepSpeed's zero_to_fp32.py reads them the same way); the client optimizer's state is per sub-group.
- ZeRO-0: `mp_rank_{mp}_model_states.pt` holds the module's weights and the optimizer's state dict, whose
  parameters are numbered in megacoat's group order (matrices, then vectors; megacoat.optim.param_groups).
- Pipeline: weights in `layer_{ii}-model_{tp}-model_states.pt` (read by tools/convert_to_hf.py); ZeRO-1 names the
  partition fragments with the PipelineModule's names (megacoat.checkpoint.sharding.plain_name maps them).

Every file is read as data only (megacoat.checkpoint.integrity.safe_torch_load): a file holding code is refused.
"""
from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass, field

import torch

from megacoat.checkpoint.integrity import safe_torch_load
from megacoat.checkpoint.layout_free import META_FILE, write_layout_free
from megacoat.checkpoint.optimizer_state import optimizer_settings, state_step, state_to_fp32
from megacoat.checkpoint.sharding import merge_tensor_parallel, plain_name
from megacoat.ops.param_remainder import join_fp32

# DeepSpeed's optimizer files for data-parallel rank dp of model-parallel rank mp: fp32 runs, then --bf16 runs
ZERO_FILE_PATTERNS = ("zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt",
                      "bf16_zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt")


@dataclass
class FullCheckpoint:
    """A checkpoint as full fp32 tensors per parameter (plain GPT names)."""
    meta: dict
    weights: dict[str, torch.Tensor]
    state: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # optimizer key -> name -> tensor
    optimizer: dict | None = None  # {kind, step, settings..., keys}; None: no optimizer state
    lr_scheduler: dict | None = None


def zero_file(tag_dir: str, dp: int, mp: int) -> str | None:
    """DeepSpeed's ZeRO optimizer file of (dp, mp) under either name, or None."""
    for pattern in ZERO_FILE_PATTERNS:
        path = os.path.join(tag_dir, pattern.format(dp=dp, mp=mp))
        if os.path.isfile(path):
            return path
    return None


def _model_files(tag_dir: str, mp_size: int, zero3: bool = False) -> list[str]:
    name = "zero_pp_rank_0_mp_rank_{mp:02d}_model_states.pt" if zero3 else "mp_rank_{mp:02d}_model_states.pt"
    files = [os.path.join(tag_dir, name.format(mp=mp)) for mp in range(mp_size)]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise FileNotFoundError(f"{tag_dir}: missing DeepSpeed model-state files {[os.path.basename(m) for m in missing]}")
    return files


def _model_states(path: str) -> dict:
    sd = safe_torch_load(path)
    if not isinstance(sd, dict):
        raise ValueError(f"{path}: not a DeepSpeed model-state file (a {type(sd).__name__}, not a dict)")
    return sd


class _Collector:
    """Per tensor-parallel rank, per kind ('param' or an optimizer key): plain name -> fragments in order."""

    def __init__(self, tp_size: int):
        self.pieces = [dict() for _ in range(tp_size)]
        self.shapes = [dict() for _ in range(tp_size)]
        self.owner = [dict() for _ in range(tp_size)]  # name -> the model-parallel rank it is read from
        self.steps: set[int] = set()
        self.settings: dict | None = None

    def add(self, tp: int, kind: str, name: str, piece: torch.Tensor, mp: int = 0) -> None:
        """A tied embedding sits on the first and the last pipeline stage: read it from the first only."""
        if self.owner[tp].setdefault(name, mp) != mp:
            return
        self.pieces[tp].setdefault(kind, {}).setdefault(name, []).append(piece.reshape(-1).float())

    def full(self, kind: str) -> dict[str, torch.Tensor]:
        shards = []
        for tp, by_kind in enumerate(self.pieces):
            shards.append({name: torch.cat(p).view(self.shapes[tp][name]) for name, p in by_kind.get(kind, {}).items()})
        return merge_tensor_parallel(shards)

    def kinds(self) -> list[str]:
        return sorted({k for by_kind in self.pieces for k in by_kind} - {"param"})


def _master_partition(path: str, partition: torch.Tensor, state: dict, group: dict) -> torch.Tensor:
    """The exact fp32 master of one flat partition: DeepSpeed's fp32 partition, or under CoatAdamW's remainders
    its bf16 partition joined with the remainder state."""
    if not group.get("param_remainders"):
        if partition.dtype != torch.float32:
            raise ValueError(f"{path}: a {partition.dtype} master partition without CoatAdamW's remainders")
        return partition
    remainder = state.get("remainder")
    if remainder is None:  # never stepped: the master is the bf16 value itself (CoatAdamW starts remainders at 0)
        return partition.float()
    if partition.dtype != torch.bfloat16 or remainder.numel() != partition.numel():
        raise ValueError(f"{path}: a {partition.dtype} partition of {partition.numel()} elements with "
                         f"{remainder.numel()} remainders")
    return join_fp32(partition, remainder.reshape(-1))


def _read_zero(tag_dir: str, mp: int, tp: int, dp_size: int, param_shapes: list, num_layers: int,
               col: _Collector) -> None:
    """ZeRO-1/2: weights from the fp32 master partitions, optimizer state from the partitions' state."""
    names_by_group = [list(g) for g in param_shapes]
    shapes = {n: s for g in param_shapes for n, s in g.items()}
    seen: set[str] = set()
    for dp in range(dp_size):
        path = zero_file(tag_dir, dp, mp)
        if path is None:
            name = ZERO_FILE_PATTERNS[0].format(dp=dp, mp=mp)
            raise FileNotFoundError(f"{tag_dir}: missing {name} or bf16_{name} (saved with data-parallel size "
                                    f"{dp_size})")
        sd = safe_torch_load(path)["optimizer_state_dict"]
        base = sd["base_optimizer_state"]
        if not isinstance(base, dict) or "state" not in base:
            raise ValueError(f"{path}: unsupported ZeRO optimizer state (elastic checkpoint?)")
        for i, mapping in enumerate(sd["param_slice_mappings"]):
            group = base["param_groups"][i]
            col.settings = col.settings or optimizer_settings(group)
            state = base["state"].get(i, {})
            if state:
                col.steps.add(state_step(state))
            flat = {"param": _master_partition(path, sd["single_partition_of_fp32_groups"][i], state, group),
                    **state_to_fp32(state, group)}
            flat.pop("remainder", None)  # folded into the master
            for name, addr in mapping.items():
                plain = plain_name(name, num_layers)
                col.shapes[tp][plain] = tuple(shapes[name])
                seen.add(name)
                for kind, tensor in flat.items():
                    col.add(tp, kind, plain, tensor.narrow(0, addr.start, addr.numel), mp)
    unmapped = [n for g in names_by_group for n in g if n not in seen]
    if unmapped:
        raise ValueError(f"{tag_dir}: ZeRO partitions of mp rank {mp} lack parameters {unmapped[:4]}")


def _read_zero3(tag_dir: str, mp: int, tp: int, dp_size: int, param_shapes: list, num_layers: int,
                col: _Collector) -> None:
    """ZeRO-3: each parameter's D partitions (module docstring) from the fp32 flat groups and their state."""
    ranks = []
    for dp in range(dp_size):
        path = zero_file(tag_dir, dp, mp)
        if path is None:
            raise FileNotFoundError(f"{tag_dir}: missing {ZERO_FILE_PATTERNS[0].format(dp=dp, mp=mp)} (saved with "
                                    f"data-parallel size {dp_size})")
        sd = safe_torch_load(path)["optimizer_state_dict"]
        base, flats = sd.get("optimizer_state_dict"), sd.get("fp32_flat_groups")
        if not isinstance(base, dict) or "state" not in base or not isinstance(flats, list):
            raise ValueError(f"{path}: not a ZeRO-3 optimizer file (no optimizer_state_dict / fp32_flat_groups)")
        if len(flats) != len(param_shapes):
            raise ValueError(f"{path}: {len(flats)} flat groups for {len(param_shapes)} groups of param_shapes")
        groups = {pid: g for g in base["param_groups"] for pid in g["params"]}  # sub-group -> its param group
        parts = []
        for i, flat in enumerate(flats):
            group, state = groups[i], base["state"].get(i, {})
            col.settings = col.settings or optimizer_settings(group)
            if state:
                col.steps.add(state_step(state))
            if flat.dtype != torch.float32:
                raise ValueError(f"{path}: a {flat.dtype} fp32 flat group {i}")
            parts.append({"param": flat, **state_to_fp32(state, group)})
        ranks.append(parts)
    for i, shapes in enumerate(param_shapes):
        offset = 0
        for name, shape in shapes.items():
            numel = int(torch.Size(shape).numel())
            per_rank = -(-numel // dp_size)
            plain = plain_name(name, num_layers)
            col.shapes[tp][plain] = tuple(shape)
            for kind in ranks[0][i]:
                whole = torch.cat([parts[i][kind].narrow(0, offset, per_rank) for parts in ranks])
                col.add(tp, kind, plain, whole[:numel], mp)
            offset += per_rank


def _zero0_names(model_sd: dict) -> list[str]:
    """Parameter names in optimizer order (megacoat.optim.param_groups: matrices, then vectors), from the saved
    module (a tied weight appears once, under its first name)."""
    module, buffers = model_sd["module"], set(model_sd.get("buffer_names") or ())
    names, seen = [], set()
    for name, t in module.items():
        if name in buffers or t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        names.append(name)
    return [n for n in names if module[n].dim() >= 2] + [n for n in names if module[n].dim() < 2]


def _read_zero0(path: str, model_sd: dict, tp: int, num_layers: int, col: _Collector, with_state: bool) -> None:
    module = model_sd.get("module")
    if not isinstance(module, dict):
        raise ValueError(f"{path}: not a DeepSpeed model-state file (no 'module' state dict)")
    names = _zero0_names(model_sd)
    for name in names:
        plain = plain_name(name, num_layers)
        col.shapes[tp][plain] = tuple(module[name].shape)
        col.add(tp, "param", plain, module[name])
    if not with_state:
        return
    opt = model_sd.get("optimizer")
    if not (isinstance(opt, dict) and "state" in opt and "param_groups" in opt):
        raise ValueError(f"{path}: optimizer state in a form megacoat cannot convert "
                         f"({sorted(opt) if isinstance(opt, dict) else type(opt).__name__})")
    ids = [i for g in opt["param_groups"] for i in g["params"]]
    groups = [g for g in opt["param_groups"] for _ in g["params"]]
    if len(ids) != len(names):
        raise ValueError(f"{path}: {len(ids)} optimizer parameters but {len(names)} module parameters")
    for pid, group, name in zip(ids, groups, names):
        col.settings = col.settings or optimizer_settings(group)
        state = opt["state"].get(pid, {})
        if not state:
            continue
        col.steps.add(state_step(state))
        for kind, tensor in state_to_fp32(state, group).items():
            if tensor.numel() != module[name].numel():
                raise ValueError(f"{path}: optimizer state {kind} of {name} has {tensor.numel()} elements, the "
                                 f"weight {module[name].numel()} (parameter order differs from megacoat's groups)")
            col.add(tp, kind, plain_name(name, num_layers), tensor)


def _pipeline_layer_weights(tag_dir: str, num_layers: int, tied: bool, col: _Collector) -> None:
    """ZeRO-0 under PP: the weights from the per-layer files (the optimizer state is not convertible)."""
    for path in glob.glob(os.path.join(tag_dir, "layer_*-model_*-model_states.pt")):
        layer, tp = map(int, re.search(r"layer_(\d+)-model_(\d+)-model_states", path).groups())
        for key, value in safe_torch_load(path).items():
            name = plain_name("tied_modules.embed." + key if tied and layer == 0 else f"{layer}.{key}", num_layers)
            col.shapes[tp][name] = tuple(value.shape)
            col.add(tp, "param", name, value)


def read_checkpoint(tag_dir: str, with_state: bool = True) -> FullCheckpoint:
    """The full fp32 tensors of a megacoat DeepSpeed checkpoint (one `iter_*` directory)."""
    meta_path = os.path.join(tag_dir, META_FILE)
    with open(meta_path) as f:
        try:
            meta = json.load(f)
            layout, model = meta["layout"], meta["megacoat_config"]["model"]
            tp_size, pp_size = layout["tensor_model_parallel_size"], layout["pipeline_model_parallel_size"]
            dp_size, num_layers, tied = layout["data_parallel_size"], model["num_layers"], model["tie_embeddings"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{meta_path}: not the record of a DeepSpeed-layout megacoat checkpoint "
                             f"({type(e).__name__}: {e})") from None
    col = _Collector(tp_size)
    zero3 = layout.get("zero_stage") == 3
    files = _model_files(tag_dir, tp_size * pp_size, zero3)
    # Flat master partitions exist under ZeRO-1/2 and under DeepSpeed's BF16_Optimizer (bf16 pipelines at ZeRO-0).
    partitioned = zero_file(tag_dir, 0, 0) is not None
    if not partitioned and pp_size > 1:
        if with_state:
            raise ValueError(f"{tag_dir}: a pipeline-parallel ZeRO-0 checkpoint keeps its optimizer state by "
                             "position only: convert it weights only (--weights-only, or --load with --finetune)")
        _pipeline_layer_weights(tag_dir, num_layers, tied, col)
    for mp, path in enumerate(files if partitioned or pp_size == 1 else []):
        model_sd = _model_states(path)
        tp = mp % tp_size
        if partitioned:
            if not model_sd.get("param_shapes"):
                raise ValueError(f"{path}: no param_shapes beside the ZeRO partitions; cannot place them")
            read = _read_zero3 if zero3 else _read_zero
            read(tag_dir, mp, tp, dp_size, model_sd["param_shapes"], num_layers, col)
        else:
            _read_zero0(path, model_sd, tp, num_layers, col, with_state)
    first = _model_states(files[0])
    weights = col.full("param")
    if tied:
        weights.pop("output.weight", None)
    state = {kind: col.full(kind) for kind in col.kinds()} if with_state else {}
    optimizer = None
    if state:
        missing = {k: sorted(set(weights) - set(v))[:4] for k, v in state.items() if set(weights) - set(v)}
        if missing:  # a parameter without state (never stepped): no consistent Adam state to carry
            raise ValueError(f"{tag_dir}: optimizer state missing for {missing}")
        # The weights hold the master whatever form it had: the layout-free state does not depend on it.
        settings = {k: v for k, v in col.settings.items() if k != "param_remainders"}
        optimizer = {**settings, "step": max(col.steps), "keys": sorted(state)}
    return FullCheckpoint(meta=meta, weights=weights, state=state, optimizer=optimizer,
                          lr_scheduler=first.get("lr_scheduler"))


def to_layout_free(src_tag_dir: str, dst_tag_dir: str, with_state: bool = True) -> str:
    """Convert one DeepSpeed-layout megacoat checkpoint into a layout-free one at `dst_tag_dir`."""
    full = read_checkpoint(src_tag_dir, with_state)
    meta = {**full.meta, "optimizer": full.optimizer, "lr_scheduler": full.lr_scheduler,
            "converted_from": os.path.abspath(src_tag_dir)}
    rng = sorted(glob.glob(os.path.join(src_tag_dir, "rng_rank*.pt")))
    return write_layout_free(dst_tag_dir, meta, full.weights, full.state or None, tuple(rng),
                             tied=full.meta["megacoat_config"]["model"]["tie_embeddings"])
