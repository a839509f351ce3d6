"""The GPT model: a plain-PyTorch Llama-style decoder that knows nothing of parallelism, FP8, data or training loops."""
from megacoat.model.config import ModelConfig
from megacoat.model.gpt import GPT, IGNORE_INDEX, TransformerBlock, cross_entropy_loss, make_linear

__all__ = ["GPT", "IGNORE_INDEX", "ModelConfig", "TransformerBlock", "cross_entropy_loss", "make_linear"]
