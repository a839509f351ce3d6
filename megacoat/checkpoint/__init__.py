"""Layout-free checkpoints: full fp32 tensors per parameter (weights and optimizer moments) that any data-,
tensor- or pipeline-parallel layout and either optimizer (AdamW, CoatAdamW) can load, read from and written
to megacoat's DeepSpeed checkpoints, and the Hugging Face Llama mapping."""
from megacoat.checkpoint.layout_free import LAYOUT_FREE, LayoutFreeCheckpoint, is_layout_free, write_layout_free
from megacoat.checkpoint.sharding import merge_tensor_parallel, plain_name, tensor_parallel_dim, tp_shard

__all__ = ["LAYOUT_FREE", "LayoutFreeCheckpoint", "is_layout_free", "merge_tensor_parallel", "plain_name",
           "tensor_parallel_dim", "tp_shard", "write_layout_free"]
