"""Load a layout-free checkpoint into a live DeepSpeed engine of any layout: every rank reads its own slice of
each full tensor and writes it where this layout keeps it.

Where the state lives, per kind of DeepSpeed optimizer:
- the client optimizer itself (ZeRO-0, fp32): its parameters are the model's (tensor-parallel shards, this
  pipeline stage's layers); the state is per parameter.
- DeepSpeed's ZeRO-1/2 optimizer or BF16_Optimizer: the client optimizer updates one flat fp32 partition per
  parameter group; DeepSpeed links each model parameter to its fragment of this rank's partition
  (`param._hp_mapping`: offset in the flattened parameter, offset in the partition, length). The weights go to
  the model parameter and to the fragment; the moments are assembled into a flat fp32 partition (zero in the
  alignment padding) and converted once per partition, so CoatAdamW's groups run along the partition as they do
  in training.
- DeepSpeed's ZeRO-3 optimizer: each parameter is partitioned on its own (this rank holds ceil(n / D) elements
  of its flattened n from rank x ceil(n / D), `param.ds_tensor`), and the client optimizer updates one flat fp32
  partition per sub-group, which concatenates those pieces (`grad_position`: sub-group, offset, length). The
  weights go to both; the moments are assembled per sub-group and converted once, as for ZeRO-1/2.
"""
from __future__ import annotations

import torch

from megacoat.checkpoint.layout_free import LayoutFreeCheckpoint
from megacoat.checkpoint.optimizer_state import state_from_fp32
from megacoat.checkpoint.sharding import plain_name
from megacoat.ops.param_remainder import split_fp32

# (model-parameter groups, flat fp32 partitions) attribute names of DeepSpeed's wrapping optimizers
_FLAT_OPTIMIZERS = (("bit16_groups", "single_partition_of_fp32_groups"), ("bf16_groups", "fp32_groups_flat_partition"))


def _flat_groups(optimizer):
    """(lp groups, hp partitions, client optimizer), or None when DeepSpeed hands the model's parameters to the
    client optimizer directly."""
    for lp_attr, hp_attr in _FLAT_OPTIMIZERS:
        if hasattr(optimizer, lp_attr) and hasattr(optimizer, hp_attr):
            return getattr(optimizer, lp_attr), getattr(optimizer, hp_attr), optimizer.optimizer
    if isinstance(optimizer, torch.optim.Optimizer):
        return None
    raise ValueError(f"loading a layout-free checkpoint into DeepSpeed's {type(optimizer).__name__} is not supported "
                     "(ZeRO-0 with --bf16 without pipelining); use --fp32 or --zero-stage 1/2")


def _fragment(m, full: torch.Tensor) -> torch.Tensor:
    """The part of a (TP-local) parameter's full tensor that DeepSpeed's mapping `m` places in this partition."""
    return full.reshape(-1).narrow(0, m.lp_fragment_address.start, m.lp_fragment_address.numel)


@torch.no_grad()
def load_into_engine(engine, ckpt: LayoutFreeCheckpoint, tp_rank: int, tp_size: int, num_layers: int,
                     load_optimizer: bool = True) -> None:
    """Weights (and, with `load_optimizer`, Adam's state, converted to this run's optimizer) of `ckpt` into
    `engine`. No collectives: every rank reads its own slices, one parameter at a time."""
    names = {id(p): plain_name(n, num_layers) for n, p in engine.module.named_parameters()}
    if load_optimizer and ckpt.optimizer is None:
        raise ValueError(f"{ckpt.path} holds weights only (no optimizer state): load it with --finetune")
    if _is_zero3(engine.optimizer):
        _load_zero3(engine, ckpt, names, tp_rank, tp_size, load_optimizer)
        return
    flat = _flat_groups(engine.optimizer)
    # CoatAdamW's remainders (--main-params-dtype bf16-remainder): the fp32 weights are split into the bf16 the
    # run keeps and the remainder, so that the pair is the saved master exactly.
    remainders = flat is not None and any(g.get("param_remainders") for g in flat[2].param_groups)
    for p in (p for _, p in engine.module.named_parameters()):
        value = ckpt.tensor(names[id(p)], None, tp_rank, tp_size)
        if value.shape != p.shape:
            raise ValueError(f"{ckpt.path}: {names[id(p)]} has shape {tuple(value.shape)} on this rank, the model "
                             f"{tuple(p.shape)}")
        p.copy_(split_fp32(value)[0] if remainders else value)
    split = []  # per flat group: the remainders of its partition
    if flat is not None:
        for lps, hp in zip(flat[0], flat[1]):
            master = torch.zeros(hp.numel(), dtype=torch.float32, device=hp.device) if remainders else hp
            for lp in lps:
                m = getattr(lp, "_hp_mapping", None)
                if m is not None:
                    master.narrow(0, m.hp_fragment_address.start, m.hp_fragment_address.numel).copy_(
                        _fragment(m, ckpt.tensor(names[id(lp)], None, tp_rank, tp_size)))
            if remainders:
                bf16, remainder = split_fp32(master)
                hp.copy_(bf16)
                split.append(remainder)
    if not load_optimizer:
        return
    keys, step, kind = ckpt.state_keys, ckpt.optimizer["step"], ckpt.optimizer["kind"]
    if flat is None:
        client = engine.optimizer
        for group in client.param_groups:
            for p in group["params"]:
                fp32 = {k: ckpt.tensor(names[id(p)], k, tp_rank, tp_size).reshape(-1) for k in keys}
                client.state[p] = state_from_fp32(fp32, step, group, p, client.state.get(p), source_kind=kind)
        return
    lp_groups, hp_parts, client = flat
    for i, (group, lps, hp) in enumerate(zip(client.param_groups, lp_groups, hp_parts)):
        (p,) = group["params"]
        if p is not hp:
            raise RuntimeError("DeepSpeed's flat partition is not its client optimizer's parameter")
        fp32 = {k: torch.zeros(hp.numel(), dtype=torch.float32, device=hp.device) for k in keys}  # padding: 0
        for lp in lps:
            m = getattr(lp, "_hp_mapping", None)
            if m is None:
                continue
            for k in keys:
                fp32[k].narrow(0, m.hp_fragment_address.start, m.hp_fragment_address.numel).copy_(
                    _fragment(m, ckpt.tensor(names[id(lp)], k, tp_rank, tp_size)))
        client.state[p] = state_from_fp32(fp32, step, group, p, client.state.get(p), source_kind=kind)
        if remainders:
            client.state[p]["remainder"] = split[i]
    if hasattr(engine.optimizer, "_hp_optimizer_states_linked"):
        engine.optimizer._hp_optimizer_states_linked = False  # DeepSpeed's fragment views of the state: relink


def _is_zero3(optimizer) -> bool:
    return all(hasattr(optimizer, a) for a in ("fp32_partitioned_groups_flat", "grad_position", "sub_group_to_group_id"))


def _load_zero3(engine, ckpt: LayoutFreeCheckpoint, names: dict, tp_rank: int, tp_size: int,
                load_optimizer: bool) -> None:
    """ZeRO-3 (module docstring): this rank's piece of every parameter into its partition and the fp32 master,
    and with `load_optimizer` the moments per sub-group."""
    zero = engine.optimizer
    client, masters = zero.optimizer, zero.fp32_partitioned_groups_flat
    keys = ckpt.state_keys if load_optimizer else ()
    moments = [{k: torch.zeros(hp.numel(), dtype=torch.float32, device=hp.device) for k in keys} for hp in masters]
    for p in (p for _, p in engine.module.named_parameters()):
        name = names[id(p)]
        value = ckpt.tensor(name, None, tp_rank, tp_size)
        if value.shape != p.ds_shape:
            raise ValueError(f"{ckpt.path}: {name} has shape {tuple(value.shape)} on this rank, the model "
                             f"{tuple(p.ds_shape)}")
        i, offset, count = zero.grad_position[zero.get_param_id(p)]
        start = zero._get_param_partition_rank(p) * count
        length = max(0, min(count, value.numel() - start))  # the last rank's piece ends in padding

        def piece(full: torch.Tensor) -> torch.Tensor:
            return full.reshape(-1).narrow(0, start, length)

        p.ds_tensor.narrow(0, 0, length).copy_(piece(value))
        masters[i].narrow(0, offset, length).copy_(piece(value))
        for k in keys:
            moments[i][k].narrow(0, offset, length).copy_(piece(ckpt.tensor(name, k, tp_rank, tp_size)))
    if not load_optimizer:
        return
    step, kind = ckpt.optimizer["step"], ckpt.optimizer["kind"]
    for i, (hp, fp32) in enumerate(zip(masters, moments)):
        group = client.param_groups[zero.sub_group_to_group_id[i]]
        client.state[hp] = state_from_fp32(fp32, step, group, hp, client.state.get(hp), source_kind=kind)
