"""FP8 numerics: formats, QuantizedTensor, per-tensor/per-group quantization, group scaling, range expansion."""
from megacoat.fp8.expansion import K_MAX, K_MIN, expand_dequantize, expand_quantize, expansion_exponent
from megacoat.fp8.formats import E4M3, E5M2, FORMATS, Fp8Format, get_format
from megacoat.fp8.group_scaling import (elementwise_group_amax, group_amax, quantize_group_scaled,
                                        reduce_group_amax)
from megacoat.fp8.quantize import dequantize, quantize_per_group, quantize_per_tensor
from megacoat.fp8.quantized_tensor import GROUP_SIZES, QuantizedTensor

__all__ = [
    "E4M3", "E5M2", "FORMATS", "Fp8Format", "get_format", "GROUP_SIZES", "QuantizedTensor",
    "quantize_per_tensor", "quantize_per_group", "dequantize",
    "K_MIN", "K_MAX", "expansion_exponent", "expand_quantize", "expand_dequantize",
    "group_amax", "elementwise_group_amax", "reduce_group_amax", "quantize_group_scaled",
]
