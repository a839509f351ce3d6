"""Sentencepiece training and the tokenizer wrapper: lossless round trip, special ids, identity."""
import pickle

import pytest
import sentencepiece as spm

from megacoat.data.tokenizer import SentencePieceTokenizer, sample_sentences, split_sentences, train_sentencepiece


def test_round_trip_is_lossless(tokenizer_model, documents):
    tok = SentencePieceTokenizer(tokenizer_model)
    assert tok.vocab_size == 512 and tok.eod == 2 and tok.pad == 3
    extra = ["  leading and trailing spaces  \n\n\n", "\t\ttabs\r\nwindows", "😀 ünïcödé 中文"]
    for text in documents[:20] + extra:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode_batch(documents[:3]) == [tok.encode(d) for d in documents[:3]]


def test_identity_is_a_content_hash(tmp_path, tokenizer_model, documents):
    tok = SentencePieceTokenizer(tokenizer_model)
    copy = tmp_path / "copy.model"
    copy.write_bytes(open(tokenizer_model, "rb").read())
    assert SentencePieceTokenizer(str(copy)).identity() == tok.identity()
    other = train_sentencepiece(documents, str(tmp_path / "other.model"), vocab_size=400)
    assert SentencePieceTokenizer(other).identity() != tok.identity()
    assert pickle.loads(pickle.dumps(tok)).encode("alpha beta") == tok.encode("alpha beta")


def test_user_symbols_and_unigram(tmp_path, documents):
    path = train_sentencepiece(documents, str(tmp_path / "u.model"), 400, model_type="unigram",
                               user_defined_symbols=["<|sep|>"])
    tok = SentencePieceTokenizer(path)
    ids = tok.encode("alpha<|sep|>beta")
    assert tok._sp.piece_to_id("<|sep|>") in ids
    assert tok.decode(ids) == "alpha<|sep|>beta"


def test_bad_inputs(tmp_path, documents):
    with pytest.raises(FileNotFoundError, match="nope.model"):
        SentencePieceTokenizer(str(tmp_path / "nope.model"))
    with pytest.raises(ValueError, match="model_type"):
        train_sentencepiece(documents, str(tmp_path / "x.model"), 400, model_type="wordpiece")
    with pytest.raises(ValueError, match="no text"):
        train_sentencepiece(["", "  \n"], str(tmp_path / "x.model"), 400)


def test_model_without_eos_is_refused(tmp_path, documents):
    prefix = str(tmp_path / "noeos")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(documents), model_prefix=prefix, vocab_size=100,
                                   hard_vocab_limit=False, eos_id=-1, minloglevel=2)
    with pytest.raises(ValueError, match="no EOS"):
        SentencePieceTokenizer(prefix + ".model")


def test_sentences_are_line_runs_with_newlines():
    text = "".join(f"line number {i}\n" for i in range(100)) + "\n\n"
    sentences = list(split_sentences(text, block_chars=50))
    assert "".join(sentences) == text.rstrip("\n") + "\n"  # whole lines, in order; the blank tail dropped
    assert all(len(s) >= 50 and s.endswith("\n") for s in sentences[:-1])


def test_sentence_sample_is_seeded_and_capped():
    docs = [f"doc {i}\n" for i in range(1000)]
    a = sample_sentences(docs, 50, 100, seed=1)
    assert len(a) == 50 and a == sample_sentences(docs, 50, 100, seed=1) and a != sample_sentences(docs, 50, 100, seed=2)
    # A uniform sample reaches the end of the input, unlike taking the first sentences.
    assert max(int(x.split()[1]) for x in a) > 500
    assert len(sample_sentences(docs, 5000, 100)) == 1000


@pytest.mark.parametrize("damage", ["empty", "truncated", "flipped", "text", "directory"])
def test_a_bad_model_file_is_one_error_naming_it(tmp_path, tokenizer_model, damage):
    data = open(tokenizer_model, "rb").read()
    bad = tmp_path / "tokenizer.model"
    if damage == "empty":
        bad.write_bytes(b"")
    elif damage == "truncated":
        bad.write_bytes(data[: len(data) // 3])
    elif damage == "flipped":
        bad.write_bytes(data[:100] + bytes(b ^ 0xFF for b in data[100:116]) + data[116:])
    elif damage == "text":
        bad.write_text("this is not a sentencepiece model\n")
    else:
        bad.mkdir()
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        SentencePieceTokenizer(str(bad))
    assert str(bad) in str(e.value) and "\n" not in str(e.value)


def test_pretrain_gpt_says_so_in_one_line(tmp_path, tokenizer_model):
    import subprocess
    import sys

    from tests.training.checkpoint_runs import PRETRAIN, TINY, env

    bad = tmp_path / "tokenizer.model"
    bad.write_bytes(open(tokenizer_model, "rb").read()[:500])
    proc = subprocess.run([sys.executable, PRETRAIN] + TINY + ["--train-iters", "1", "--tokenizer-model", str(bad)],
                          cwd=tmp_path, env=env(tmp_path), capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if "[real_accelerator.py" not in line]
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"error: {bad}: not a sentencepiece model, or a truncated or corrupted one")
