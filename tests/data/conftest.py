"""Shared data-test fixtures: a small corpus and a sentencepiece model trained on it (once per session)."""
import json
import random

import pytest

from megacoat.data.tokenizer import train_sentencepiece

WORDS = ("alpha beta gamma delta epsilon zeta theta lambda matrix tensor scale gradient optimizer moment "
         "def return class import for while if else print self value None True False").split()


def make_documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))) for _ in range(rng.randint(1, 6))]
        docs.append(f"# doc {i}\n" + "\n".join("    " * rng.randint(0, 2) + line for line in lines) + "\n")
    return docs


@pytest.fixture(scope="session")
def documents():
    docs = make_documents(300)
    docs[7] += "unicode: héllo wörld — 世界 🙂\ttab\n"  # bytes outside the vocabulary: byte fallback
    return docs


@pytest.fixture(scope="session")
def tokenizer_model(tmp_path_factory, documents):
    path = tmp_path_factory.mktemp("tok") / "tok.model"
    return train_sentencepiece(documents, str(path), vocab_size=512)


def write_jsonl(path, docs, key="text"):
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps({key: d}) + "\n")
    return str(path)
