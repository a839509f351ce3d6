"""Data: sentencepiece tokenizer, Megatron .bin/.idx token shards, GPT datasets, blending and resumable sampling."""
