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
        if os.path.getsize(model_path) == 0:
            raise ValueError(f"{model_path}: the tokenizer model is empty")
        self.model_path = model_path
        try:
            self._sp = spm.SentencePieceProcessor(model_file=model_path)
        except RuntimeError as e:  # sentencepiece reports every unreadable model so ("could not parse ModelProto")
            raise ValueError(f"{model_path}: not a sentencepiece model, or a truncated or corrupted one "
                             f"({' '.join(str(e).split())})") from None
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
    sentencepiece trains on "sentences": here, runs of whole lines of about 256 characters with their newlines,
    so that pieces can span a newline and the indentation after it (fewer tokens on source code than
    training on single lines). A uniform, seeded sample of at most `max_sentences` of them bounds the time
    on large inputs.
    """
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {model_type!r}")
    if vocab_size < 260 and byte_fallback:
        raise ValueError(f"vocab_size {vocab_size} is too small: byte fallback alone needs 256 pieces + specials")
    sentences = sample_sentences(documents, max_sentences, max_sentence_length, seed)
    if not sentences:
        raise ValueError("no text to train the tokenizer on (all documents were empty)")
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences), model_writer=model, vocab_size=vocab_size,
            model_type=model_type, byte_fallback=byte_fallback, user_defined_symbols=list(user_defined_symbols),
            normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
            split_digits=True, allow_whitespace_only_pieces=True, split_by_whitespace=True,
            character_coverage=0.9995 if byte_fallback else 1.0, max_sentence_length=max_sentence_length,
            input_sentence_size=max_sentences, shuffle_input_sentence=False, hard_vocab_limit=False,
            unk_id=0, bos_id=1, eos_id=2, pad_id=3, num_threads=num_threads or os.cpu_count() or 1,
            minloglevel=2)
    except RuntimeError as e:  # sentencepiece's own refusals (a vocabulary too large for the text, say)
        raise ValueError(f"sentencepiece could not train a tokenizer: {' '.join(str(e).split())}") from None
    tmp = f"{output_model}.tmp-{os.getpid()}"
    os.makedirs(os.path.dirname(os.path.abspath(output_model)), exist_ok=True)
    with open(tmp, "wb") as f:
        f.write(model.getvalue())
    os.replace(tmp, output_model)
    return output_model


def split_sentences(text: str, block_chars: int = 256):
    """Runs of whole lines (newlines kept) of at least block_chars characters; blank-only runs are dropped."""
    block, size = [], 0
    for line in text.splitlines(keepends=True):
        block.append(line)
        size += len(line)
        if size >= block_chars:
            yield "".join(block)
            block, size = [], 0
    rest = "".join(block)
    if rest.strip():
        yield rest


def sample_sentences(documents: Iterable[str], k: int, max_length: int, seed: int = 0) -> list[str]:
    """A uniform, seeded sample of k training sentences (reservoir sampling: one pass, k in memory)."""
    rng = random.Random(seed)
    reservoir: list[str] = []
    seen = 0
    for doc in documents:
        for sentence in split_sentences(doc):
            if not sentence.strip():
                continue
            sentence = sentence[:max_length]
            if seen < k:
                reservoir.append(sentence)
            else:
                j = rng.randrange(seen + 1)
                if j < k:
                    reservoir[j] = sentence
            seen += 1
    return reservoir
