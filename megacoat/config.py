"""MegacoatConfig: every package's config dataclass in one object, built by megacoat.arguments and passed down."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from megacoat.data.config import DataConfig
from megacoat.fp8.config import FP8Config
from megacoat.model.config import ModelConfig
from megacoat.optim.config import OptimizerConfig
from megacoat.parallel.config import ParallelConfig
from megacoat.training.config import TrainingConfig


@dataclass
class MegacoatConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    fp8: FP8Config = field(default_factory=FP8Config)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)

    def to_dict(self) -> dict:
        return asdict(self)
