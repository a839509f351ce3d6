"""DataConfig: where tokens come from and how they are split, blended and cached."""
from __future__ import annotations

import math
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
        if self.data_path:
            parse_data_path(self.data_path)  # fail at the command line, not after the model is built


def parse_data_path(data_path: list[str]) -> tuple[list[float] | None, list[str]]:
    """["a"] or ["a", "b"] (weights None: in proportion to size) or ["0.7", "a", "0.3", "b"]."""
    if not data_path:
        raise ValueError("--data-path is empty")

    def number(s):
        try:
            return float(s)
        except ValueError:
            return None

    if number(data_path[0]) is None:
        if any(number(p) is not None for p in data_path):
            raise ValueError(f"--data-path mixes weights and prefixes: {' '.join(data_path)} "
                             f"(give 'W1 PREFIX1 W2 PREFIX2 ...' or only prefixes)")
        return None, list(data_path)
    if len(data_path) % 2:
        raise ValueError(f"--data-path with weights needs 'WEIGHT PREFIX' pairs, got {' '.join(data_path)}")
    weights = [number(w) for w in data_path[0::2]]
    prefixes = list(data_path[1::2])
    if any(w is None or not math.isfinite(w) or w <= 0 for w in weights):
        raise ValueError(f"--data-path weights must be positive numbers, got {data_path[0::2]}")
    return weights, prefixes
