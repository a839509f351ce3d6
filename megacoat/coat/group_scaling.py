"""COAT's 1xG group scaling: a tensor cut into groups of G consecutive elements along its last dimension, each
group with its own float32 scale (amax / F.max), so one outlier costs only its group's precision.

It quantizes the precision flow's FP8 inputs of the non-linear layers (the norms' inputs, SwiGLU's input pair, fused
into their kernels: megacoat.ops.rmsnorm, megacoat.ops.swiglu) and CoatAdamW's moments (with dynamic range
expansion, megacoat.coat.expansion). The GEMM operands keep per-tensor scales. GROUP_SIZES are the G the kernels
take (CoatRecipe.group_size); group_quantize / group_dequantize are the torch reference of one [M, D] tensor.
"""
from megacoat.ops.numerics import GROUP_SIZES, check_group_size, group_dequantize, group_quantize, num_groups

__all__ = ["GROUP_SIZES", "check_group_size", "group_dequantize", "group_quantize", "num_groups"]
