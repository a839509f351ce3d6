"""ModelConfig: the hyper-parameters of the Llama-style GPT, validated once, here."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelConfig:
    num_layers: int = 4
    hidden_size: int = 192
    ffn_hidden_size: int = 512
    num_attention_heads: int = 6
    num_query_groups: int | None = None  # None: as many as heads (plain multi-head attention)
    seq_length: int = 128
    vocab_size: int = 4096
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    init_std: float = 0.02

    def __post_init__(self):
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                     "num_query_groups", "seq_length", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"--hidden-size ({self.hidden_size}) must be divisible by "
                             f"--num-attention-heads ({self.num_attention_heads})")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"--num-attention-heads ({self.num_attention_heads}) must be divisible by "
                             f"--num-query-groups ({self.num_query_groups})")
        if self.head_dim % 2:
            raise ValueError(f"head dim (hidden {self.hidden_size} / heads {self.num_attention_heads}) must be "
                             "even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def num_parameters(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        h, f, v = self.hidden_size, self.ffn_hidden_size, self.vocab_size
        kv = self.num_query_groups * self.head_dim
        per_layer = h * h + 2 * h * kv + h * h + 3 * h * f + 2 * h
        out = 0 if self.tie_embeddings else v * h
        return v * h + self.num_layers * per_layer + h + out
