"""The GPT model: a plain-PyTorch Llama-style decoder that knows nothing of parallelism, FP8, data or training loops."""
