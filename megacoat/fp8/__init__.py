"""FP8 numerics: formats, quantized-tensor container, per-tensor/per-group quantization, group scaling, dynamic range expansion."""
