"""Kernels: Triton kernels and DeepSpeed op_builder CUDA extensions, each beside a plain-torch reference."""
