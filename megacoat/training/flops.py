"""Model FLOPs per token and the GPU's peak, for the TFLOP/s and MFU figures of the training log.

Convention (Megatron-LM / PaLM appendix B): count only matrix multiplies, forward + backward = 3 x forward,
2 FLOPs per multiply-add, attention without a causal discount:
    per token = 6 * (matmul parameters of the blocks + the output projection h*V)
              + 12 * layers * seq * hidden            (QK^T and attention x V: 2 * 2 * s * h forward, x3)
The input embedding is a lookup and costs nothing; norms and element-wise ops are not counted.
"""
from __future__ import annotations

import torch

from megacoat.model.config import ModelConfig

# Dense (no sparsity) bf16 tensor-core peaks, FLOP/s, by a substring of torch.cuda.get_device_name().
BF16_PEAK_FLOPS = {
    "H200": 989.4e12,
    "H100 NVL": 835.0e12,
    "H100 PCIe": 756.0e12,
    "H100": 989.4e12,  # SXM
    "A100": 312.0e12,
}


def matmul_parameters(cfg: ModelConfig) -> int:
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    kv = cfg.num_query_groups * cfg.head_dim
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * f
    return cfg.num_layers * per_layer + h * cfg.vocab_size


def flops_per_token(cfg: ModelConfig) -> int:
    attention = 12 * cfg.num_layers * cfg.seq_length * cfg.hidden_size
    return 6 * matmul_parameters(cfg) + attention


def peak_flops(device: torch.device) -> float | None:
    """bf16 dense peak of this GPU, or None (CPU, unknown GPU): MFU is then reported as null."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in BF16_PEAK_FLOPS.items():  # ordered: more specific names first
        if key in name:
            return flops
    return None
