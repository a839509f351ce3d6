"""DeepSpeed op_builder subclasses for megacoat's CUDA kernels (JIT-compiled on first use, cached by torch under
TORCH_EXTENSIONS_DIR).

The CUDA sources live in the top-level `kernels/` folder of a source checkout; `pip install .` copies them into the
package as `megacoat/ops/kernels/` (setup.py), and `kernels_dir()` finds either.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from deepspeed.ops.op_builder.builder import CUDAOpBuilder

_PACKAGE_KERNELS = Path(__file__).resolve().parent / "kernels"  # installed package
_CHECKOUT_KERNELS = Path(__file__).resolve().parents[2] / "kernels"  # source checkout / pip install -e .


def kernels_dir() -> Path:
    for d in (_PACKAGE_KERNELS, _CHECKOUT_KERNELS):
        if (d / "coat_adamw.cu").is_file():
            return d
    raise FileNotFoundError(f"megacoat's CUDA sources not found in {_PACKAGE_KERNELS} or {_CHECKOUT_KERNELS}; "
                            "reinstall megacoat (pip install .) or run from a source checkout")


def normalize_arch_list(arch_list: str) -> str:
    """'9.0a;8.0' -> '9.0;8.0': DeepSpeed parses each entry as int.int(+PTX) and fails on the arch-specific 'a'/'f'
    suffix (e.g. TORCH_CUDA_ARCH_LIST=9.0a). The kernels use no sm_90a-only instruction."""
    return re.sub(r"(\d+\.\d+)[a-zA-Z]+", r"\1", arch_list)


class CoatAdamWBuilder(CUDAOpBuilder):
    BUILD_VAR = "DS_BUILD_MEGACOAT_COAT_ADAMW"
    NAME = "megacoat_coat_adamw"

    def __init__(self):
        super().__init__(name=self.NAME)

    def absolute_name(self):
        return f"megacoat.ops.{self.NAME}_op"

    def sources(self):
        d = kernels_dir()
        return [str(d / "coat_adamw.cpp"), str(d / "coat_adamw.cu")]

    def include_paths(self):
        return [str(kernels_dir())]

    def cxx_args(self):
        return super().cxx_args() + self.version_dependent_macros()

    def nvcc_args(self):
        # No --use_fast_math: the kernel picks its approximations (ex2/lg2) explicitly and keeps IEEE division and
        # sqrt, so its error against the reference stays what the tests state.
        return [a for a in super().nvcc_args() if a != "--use_fast_math"] + ["-lineinfo"]

    def filter_ccs(self, ccs):
        # DeepSpeed passes entries such as "9.0a" / "9.0+PTX" and expects [major, minor(+PTX)] back.
        return [normalize_arch_list(cc).split(".") for cc in ccs]

    def jit_load(self, verbose=True):
        key = "TORCH_CUDA_ARCH_LIST"
        saved = os.environ.get(key)
        if saved is not None:
            os.environ[key] = normalize_arch_list(saved)
        try:
            return super().jit_load(verbose)
        finally:
            if saved is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = saved
