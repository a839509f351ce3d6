"""pretrain_gpt.py with torchao's float8 training in place of megacoat's FP8 flow: the peer that
benchmarks/e2e/speed.py's `torchao-float8` mode measures in the same run as megacoat's modes.

    python -m benchmarks.e2e.torchao_pretrain <pretrain_gpt.py flags> --compile

The same GPT, data, DeepSpeed engine and loop as pretrain_gpt.py (megacoat's trainer, through its
`model_converter` hook); only the block linears change: torchao's `convert_to_float8_training` with the
tensorwise recipe (dynamic per-tensor scales; E4M3 forward, E5M2 gradients). As torchao's documentation does,
the output head stays in high precision (module filter) and linears with a dimension not divisible by 16 are
skipped; the embedding is not a linear. Compile (--compile) is what lets Inductor fuse torchao's amax and casts
into neighbouring kernels. On a machine without CUDA (tests) torchao emulates the FP8 GEMMs.

torchao is a benchmark-only dependency (`pip install -e ".[bench]"`); without it this stops with an error.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import sys

from torch import nn

from megacoat.arguments import parse_config  # noqa: E402

MISSING = "torchao is not installed (a benchmark-only dependency: pip install -e '.[bench]')"


def keep_linear_in_float8(module: nn.Module, fqn: str) -> bool:
    """torchao's module filter: not the output head, and only GEMMs whose dimensions FP8 kernels accept."""
    if fqn == "output" or fqn.endswith(".output"):
        return False
    if isinstance(module, nn.Linear):
        return module.in_features % 16 == 0 and module.out_features % 16 == 0
    return True


def float8_linears(model: nn.Module) -> nn.Module:
    import torch
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name("tensorwise")
    if not torch.cuda.is_available():
        config = dataclasses.replace(config, emulate=True)
    return convert_to_float8_training(model, config=config, module_filter_fn=keep_linear_in_float8)


def main(argv: list[str] | None = None) -> dict:
    if importlib.util.find_spec("torchao") is None:
        raise SystemExit(f"error: {MISSING}")
    cfg = parse_config(argv)
    if cfg.fp8.enabled:
        raise SystemExit("error: --fp8-activations/--coat-fp8: torchao's float8 linears replace megacoat's FP8 "
                         "flow here; leave the flag out")
    if cfg.parallel.tensor_model_parallel_size > 1:
        raise SystemExit("error: --tensor-model-parallel-size: torchao's float8 linears are not megacoat's "
                         "tensor-parallel shards; run with 1")
    from megacoat.training.trainer import check_data_paths, pretrain

    try:
        check_data_paths(cfg)
    except FileNotFoundError as e:
        raise SystemExit(f"error: {e}") from None
    return pretrain(cfg, model_converter=float8_linears)


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
