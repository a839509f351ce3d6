"""megacoat: FP8 GPT pretraining (COAT: FP8 optimizer states and FP8 activations) on DeepSpeed."""

__version__ = "0.1.0"
