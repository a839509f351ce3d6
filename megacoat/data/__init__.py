"""Data: sentencepiece tokenizer, Megatron .bin/.idx token shards, GPT datasets, blending and resumable sampling."""
import importlib

# Imported on first use, so that preprocessing worker processes (which need only the tokenizer and the
# writer) do not pay for importing torch.
_EXPORTS = {
    "SentencePieceTokenizer": "tokenizer",
    "train_sentencepiece": "tokenizer",
    "IndexedDataset": "indexed_dataset",
    "IndexedDatasetWriter": "indexed_dataset",
    "IndexFormatError": "indexed_dataset",
    "preprocess": "preprocessing",
    "GPTDataset": "gpt_dataset",
    "MockGPTDataset": "gpt_dataset",
    "BlendedDataset": "blended_dataset",
    "build_train_valid_test_datasets": "builders",
    "build_pretraining_data_loader": "sampler",
    "MegatronPretrainingSampler": "sampler",
    "DefaultCorpus": "default_corpus",
    "prepare_default_corpus": "default_corpus",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megacoat.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"megacoat.data.{_EXPORTS[name]}"), name)
