"""A Llama-style decoder in plain PyTorch, read top to bottom: RMSNorm, rotary embeddings, grouped-query
attention, SwiGLU MLP, blocks, the model and its loss.

Nothing here knows about FP8, tensor parallelism or the training loop: `megacoat.coat.convert_to_coat` and
`megacoat.parallel.apply_tp` swap modules of this model (blocks, `layers`, `head`) from outside, by name (torchtitan's
separation). The names follow Llama / torchtitan so checkpoints map one to one onto Hugging Face's
`LlamaForCausalLM`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megacoat.model.config import ModelConfig
from megacoat.ops.attention import causal_attention

IGNORE_INDEX = -100  # labels with this value (padding) do not count in the loss


def make_linear(in_features: int, out_features: int) -> nn.Linear:
    """Every projection of the model is built here: bias-free, as in Llama. Converters replace these
    modules after construction (FP8, tensor-parallel shards); they keep the parameter name `weight`."""
    return nn.Linear(in_features, out_features, bias=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 whatever the activation dtype: the mean of squares loses too much in bf16.
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


def rope_tables(head_dim: int, seq_length: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of the rotary angles, shape [seq, head_dim/2], fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq_length, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x [batch, seq, heads, head_dim] by the position's angle
    (the interleaved convention of the original Llama code)."""
    seq = x.shape[1]
    cos = cos[:seq].view(1, seq, 1, -1)
    sin = sin[:seq].view(1, seq, 1, -1)
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query attention: `num_query_groups` key/value heads shared by the query heads."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_query_groups
        self.head_dim = cfg.head_dim
        self.wq = make_linear(cfg.hidden_size, self.n_heads * self.head_dim)
        self.wk = make_linear(cfg.hidden_size, self.n_kv_heads * self.head_dim)
        self.wv = make_linear(cfg.hidden_size, self.n_kv_heads * self.head_dim)
        self.wo = make_linear(self.n_heads * self.head_dim, cfg.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 rather than the configured head count: a tensor-parallel shard holds only its heads.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return self.wo(causal_attention(q, k, v))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = make_linear(cfg.hidden_size, cfg.ffn_hidden_size)  # gate
        self.w3 = make_linear(cfg.hidden_size, cfg.ffn_hidden_size)  # up
        self.w2 = make_linear(cfg.ffn_hidden_size, cfg.hidden_size)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = Layers(TransformerBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.output = make_linear(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.head = Head()  # logits from `output`, or the loss; converters swap it (vocab-parallel, FP8)
        # Plain attributes, not buffers: a model cast to bf16 must keep its rotary tables in fp32, and they
        # are a function of the config, so nothing is saved. `_rope` moves them to the activations' device.
        self._rope_cpu = rope_tables(cfg.head_dim, cfg.seq_length, cfg.rope_theta)
        self._rope_cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.reset_parameters()

    def _rope(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._rope_cache:
            self._rope_cache[device] = tuple(t.to(device) for t in self._rope_cpu)
        return self._rope_cache[device]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, std) for embeddings and projections; output projections of each residual branch
        (wo, w2) scaled by 1/sqrt(2 * layers) as in GPT-2/Megatron so the residual stream's variance does not
        grow with depth."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2.0 * self.cfg.num_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                last = name.rsplit(".", 1)[-1]
                nn.init.normal_(module.weight, mean=0.0, std=out_std if last in ("wo", "w2") else std)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [batch, seq] → logits [batch, seq, vocab]; with labels, the mean cross-entropy over the
        labels that are not IGNORE_INDEX."""
        if tokens.shape[1] > self.cfg.seq_length:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens exceeds --seq-length {self.cfg.seq_length}")
        h = self.tok_embeddings(tokens)
        cos, sin = self._rope(h.device)
        h = self.norm(self.layers(h, cos, sin))
        return self.head(self.output, h, labels)


class Layers(nn.ModuleList):
    """The blocks, run in sequence (FP8 converters swap in a stack that fuses across blocks)."""

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        for layer in self:
            h = layer(h, cos, sin)
        return h


class Head(nn.Module):
    """output(h) → logits, or with labels their mean cross-entropy over the labels that are not IGNORE_INDEX.
    It holds no parameter (the projection stays `output`, as checkpoints name it); loss_fn(logits, labels) is the
    loss, compiled by apply_compile's swap."""

    def __init__(self, loss_fn=None):
        super().__init__()
        self.loss_fn = loss_fn or cross_entropy_loss
        self.ignore_index = IGNORE_INDEX

    def forward(self, output: nn.Module, h: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        logits = output(h)
        return logits if labels is None else self.loss(logits, labels)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(logits, labels)


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # fp32 softmax: bf16 logits lose the small probabilities the loss is made of.
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
