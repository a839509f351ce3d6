"""FP8 training: formats, FP8 linear layers and the COAT precision flow (numerics and kernels: megacoat.ops)."""
from megacoat.fp8.formats import E4M3, E5M2, FORMATS, Fp8Format, get_format

__all__ = ["E4M3", "E5M2", "FORMATS", "Fp8Format", "get_format"]
