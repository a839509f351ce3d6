"""The GPT model: a plain-PyTorch Llama-style decoder that knows nothing of parallelism, FP8, data or training loops."""
from megacoat.model.config import ModelConfig
from megacoat.model.gpt import GPT, IGNORE_INDEX, Head, Layers, TransformerBlock, cross_entropy_loss, make_linear

__all__ = ["GPT", "Head", "IGNORE_INDEX", "Layers", "ModelConfig", "TransformerBlock", "cross_entropy_loss", "make_linear"]
