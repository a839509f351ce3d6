"""SentencePiece: training a model from documents and the tokenizer the rest of megacoat uses."""
from __future__ import annotations

import hashlib
import io
import os
import random
from collections.abc import Iterable

import sentencepiece as spm

MODEL_TYPES = ("bpe", "unigram")


class SentencePieceTokenizer:
    """A sentencepiece model with the ids a GPT pipeline needs: `eod` ends every document, `pad` may be None."""

    def __init__(self, model_path: str):
        if not os.path.isfile(model_path):
            raise FileNotFoundError(f"sentencepiece model not found: {model_path}")
        self.model_path = model_path
        self._sp = spm.SentencePieceProcessor(model_file=model_path)
        self.vocab_size = self._sp.get_piece_size()
        self.eod = self._sp.eos_id()
        if self.eod < 0:
            raise ValueError(f"{model_path}: the sentencepiece model has no EOS piece, which megacoat appends "
                             f"after each document as EOD; retrain it with an eos_id (tools/train_tokenizer.py does)")
        pad = self._sp.pad_id()
        self.pad = pad if pad >= 0 else None

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        """Many documents in one call; one thread by default, since preprocessing runs one process per core."""
        return self._sp.encode(texts, num_threads=num_threads)

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])

    def identity(self) -> str:
        """A hash of the model's contents: checkpoints record it to catch a resume with a different tokenizer."""
        return hashlib.sha256(self._sp.serialized_model_proto()).hexdigest()[:16]

    def __getstate__(self):  # picklable for data-loader workers: reload from the file
        return self.model_path

    def __setstate__(self, model_path):
        self.__init__(model_path)

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({self.model_path!r}, vocab_size={self.vocab_size})"


def train_sentencepiece(documents: Iterable[str], output_model: str, vocab_size: int, *,
                        model_type: str = "bpe", byte_fallback: bool = True,
                        user_defined_symbols: list[str] = (), max_sentences: int = 200_000,
                        max_sentence_length: int = 4192, num_threads: int | None = None, seed: int = 0) -> str:
    """Train a sentencepiece model on `documents` and write it to `output_model` (atomically). Returns the path.

    Settings suit source code and prose alike: text is not normalized and whitespace is kept, so
    decode(encode(text)) == text for any text; byte fallback covers characters outside the vocabulary.
    Documents are cut into lines (sentencepiece trains on sentences); a uniform sample of at most
    `max_sentences` lines, seeded, bounds the time on large inputs.
    """
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {model_type!r}")
    if vocab_size < 260 and byte_fallback:
        raise ValueError(f"vocab_size {vocab_size} is too small: byte fallback alone needs 256 pieces + specials")
    lines = sample_lines(documents, max_sentences, max_sentence_length, seed)
    if not lines:
        raise ValueError("no text to train the tokenizer on (all documents were empty)")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size,
        model_type=model_type, byte_fallback=byte_fallback, user_defined_symbols=list(user_defined_symbols),
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
        split_digits=True, allow_whitespace_only_pieces=True, split_by_whitespace=True,
        character_coverage=0.9995 if byte_fallback else 1.0, max_sentence_length=max_sentence_length,
        input_sentence_size=max_sentences, shuffle_input_sentence=False, hard_vocab_limit=False,
        unk_id=0, bos_id=1, eos_id=2, pad_id=3, num_threads=num_threads or os.cpu_count() or 1,
        minloglevel=2)
    tmp = f"{output_model}.tmp-{os.getpid()}"
    os.makedirs(os.path.dirname(os.path.abspath(output_model)), exist_ok=True)
    with open(tmp, "wb") as f:
        f.write(model.getvalue())
    os.replace(tmp, output_model)
    return output_model


def sample_lines(documents: Iterable[str], k: int, max_length: int, seed: int = 0) -> list[str]:
    """A uniform, seeded sample of k non-blank lines (reservoir sampling: one pass, k lines in memory)."""
    rng = random.Random(seed)
    reservoir: list[str] = []
    seen = 0
    for doc in documents:
        for line in doc.split("\n"):
            if not line.strip():
                continue
            if seen < k:
                reservoir.append(line[:max_length])
            else:
                j = rng.randrange(seen + 1)
                if j < k:
                    reservoir[j] = line[:max_length]
            seen += 1
    return reservoir
