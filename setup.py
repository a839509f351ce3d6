"""megacoat: FP8 GPT pretraining (COAT) on DeepSpeed."""
from setuptools import find_packages, setup

setup(
    name="megacoat",
    version="0.1.0",
    description="FP8 GPT pretraining with COAT (FP8 optimizer states and activations) on DeepSpeed",
    python_requires=">=3.10",
    packages=find_packages(include=["megacoat", "megacoat.*"]),
    install_requires=[
        "torch>=2.4",  # FP8 dtypes and torch._scaled_mm
        "deepspeed>=0.14",
        "triton; platform_system == 'Linux'",
        "sentencepiece",
        "numpy",
        "tqdm",
    ],
    extras_require={
        "dev": ["pytest", "pytest-timeout", "matplotlib", "tensorboard", "safetensors"],
        "wandb": ["wandb"],
    },
)
