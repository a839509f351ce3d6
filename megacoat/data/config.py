"""DataConfig: where tokens come from and how they are split, blended and cached."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DataConfig:
    # Megatron-style: ["prefix"] or ["0.7", "prefixA", "0.3", "prefixB"] (weights, then shard prefixes).
    data_path: list[str] = field(default_factory=list)
    split: str = "969,30,1"
    tokenizer_model: str | None = None
    # Where the embedded default corpus and dataset index caches live (None: ~/.cache/megacoat).
    cache_dir: str | None = None
    num_workers: int = 0
    mock_data: bool = False  # random tokens, no files: for smoke tests and benchmarks

    def __post_init__(self):
        parts = self.split.split(",")
        try:
            weights = [float(p) for p in parts]
        except ValueError:
            raise ValueError(f"--split must be comma-separated numbers, got {self.split!r}") from None
        if len(weights) > 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"--split takes up to three non-negative weights with a positive sum, got {self.split!r}")
        if self.num_workers < 0:
            raise ValueError(f"--num-workers must be >= 0, got {self.num_workers}")
