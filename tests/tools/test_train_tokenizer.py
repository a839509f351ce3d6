"""tools/train_tokenizer.py from text files, directories and JSONL."""
import pytest

from megacoat.data.tokenizer import SentencePieceTokenizer
from tests.data.conftest import write_jsonl


def test_from_jsonl_with_options(tmp_path, train_tokenizer, documents, capsys):
    src = write_jsonl(tmp_path / "a.jsonl", documents, key="content")
    out = tmp_path / "tok.model"
    assert train_tokenizer.main([src, "--json-key", "content", "--vocab-size", "400", "--output", str(out),
                                 "--user-defined-symbols", "<|end|>", "--max-sentences", "500"]) == 0
    tok = SentencePieceTokenizer(str(out))
    assert tok.vocab_size == 400 and "identity" in capsys.readouterr().out
    assert tok.decode(tok.encode("gamma <|end|> 🙂")) == "gamma <|end|> 🙂"
    assert tok._sp.piece_to_id("<|end|>") in tok.encode("<|end|>")


def test_from_text_directory_unigram(tmp_path, train_tokenizer, documents):
    d = tmp_path / "texts"
    d.mkdir()
    for i, text in enumerate(documents[:100]):
        (d / f"{i}.txt").write_text(text)
    out = tmp_path / "u.model"
    assert train_tokenizer.main([str(d), "--vocab-size", "300", "--model-type", "unigram", "--output", str(out)]) == 0
    assert SentencePieceTokenizer(str(out)).vocab_size == 300


def test_bad_arguments(tmp_path, train_tokenizer):
    with pytest.raises(SystemExit):
        train_tokenizer.main([str(tmp_path), "--output", str(tmp_path / "x.model"), "--model-type", "wordpiece"])
    with pytest.raises(FileNotFoundError, match="no input files"):
        train_tokenizer.main([str(tmp_path), "--output", str(tmp_path / "x.model")])
