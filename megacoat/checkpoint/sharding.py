"""Where each parameter of the GPT lives in a parallel layout, by name: which dimension tensor parallelism
splits (column-parallel weights and the vocabulary on dim 0, row-parallel weights on dim 1, norms replicated),
and the plain GPT's name of a parameter of DeepSpeed's PipelineModule. Element-wise optimizer state (Adam's
moments) is split exactly as its parameter is."""
from __future__ import annotations

import torch

# Kept in step with megacoat.parallel.tensor_parallel's plan (tested there against the live modules).
COLUMN = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
ROW = ("attention.wo", "feed_forward.w2")
VOCAB = ("tok_embeddings.weight", "output.weight")


def tensor_parallel_dim(name: str) -> int | None:
    """The dimension tensor parallelism splits parameter `name` (plain GPT name) along; None: replicated."""
    dotted = f".{name}"
    if name in VOCAB or any(f".{c}." in dotted for c in COLUMN):
        return 0
    if any(f".{r}." in dotted for r in ROW):
        return 1
    return None


def tp_shard(full: torch.Tensor, name: str, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Tensor-parallel rank `tp_rank`'s contiguous slice of the full tensor `name`."""
    dim = tensor_parallel_dim(name)
    if tp_size == 1 or dim is None:
        return full
    if full.shape[dim] % tp_size:
        raise ValueError(f"{name}: dimension {dim} of {tuple(full.shape)} does not split over {tp_size} ranks")
    return full.chunk(tp_size, dim)[tp_rank]


def merge_tensor_parallel(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One dict per tensor-parallel rank (plain names) -> the full tensors; replicated ones must agree."""
    if len(shards) == 1:
        return dict(shards[0])
    out = {}
    for name, first in shards[0].items():
        pieces = [s[name] for s in shards]
        dim = tensor_parallel_dim(name)
        if dim is not None:
            out[name] = torch.cat(pieces, dim)
        else:
            if not all(torch.equal(first, p) for p in pieces[1:]):
                raise ValueError(f"{name}: replicated parameter differs between tensor-parallel ranks")
            out[name] = first
    return out


def plain_name(name: str, num_layers: int) -> str:
    """The plain GPT's name of a parameter, whether `name` comes from the GPT itself (unchanged) or from the
    PipelineModule megacoat.parallel.pipeline builds: [0: embedding] [1..L: blocks] [L+1: final norm]
    [L+2: head], with a tied embedding/head under `tied_modules.embed`."""
    if name.startswith("tied_modules.embed."):
        return name[len("tied_modules.embed."):]
    head, _, rest = name.partition(".")
    if not head.isdigit():
        return name
    layer = int(head)
    if layer == 0 or layer == num_layers + 2:
        return rest  # tok_embeddings.weight / output.weight
    if layer <= num_layers:
        if not rest.startswith("block."):
            raise ValueError(f"pipeline parameter {name!r}: expected a transformer block at layer {layer}")
        return f"layers.{layer - 1}.{rest[len('block.'):]}"
    if layer == num_layers + 1:
        return f"norm.{rest}"
    raise ValueError(f"pipeline parameter {name!r}: layer {layer} is beyond a {num_layers}-layer GPT")
