"""megacoat: FP8 GPT pretraining (COAT) on DeepSpeed."""
import glob
import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


class BuildPyWithKernels(build_py):
    """Ship the top-level kernels/ CUDA sources inside the package (megacoat/ops/kernels/), where the op builders
    look for them in an installed copy; a source checkout and `pip install -e .` read kernels/ in place."""

    def run(self):
        super().run()
        dest = os.path.join(self.build_lib, "megacoat", "ops", "kernels")
        os.makedirs(dest, exist_ok=True)
        for pattern in ("*.cu", "*.cuh", "*.cpp", "*.h"):
            for src in glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels", pattern)):
                shutil.copy2(src, dest)

setup(
    name="megacoat",
    version="0.1.0",
    description="FP8 GPT pretraining with COAT (FP8 optimizer states and activations) on DeepSpeed",
    python_requires=">=3.10",
    packages=find_packages(include=["megacoat", "megacoat.*"]),
    cmdclass={"build_py": BuildPyWithKernels},
    install_requires=[
        "torch>=2.4",  # FP8 dtypes and torch._scaled_mm
        "deepspeed>=0.14",
        "triton; platform_system == 'Linux'",
        "sentencepiece",
        "numpy",
        "tqdm",
    ],
    extras_require={
        # transformers: tests/tools/test_convert_to_hf.py loads the export with LlamaForCausalLM (CPU is enough).
        "dev": ["pytest", "pytest-timeout", "matplotlib", "tensorboard", "safetensors", "transformers"],
        "wandb": ["wandb"],
        # benchmark-only: the torchao float8 peers (benchmarks/e2e/torchao_pretrain.py, benchmarks/parallel/torchtitan_peer.py)
        "bench": ["torchao>=0.18"],
    },
)
