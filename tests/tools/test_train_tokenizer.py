"""tools/train_tokenizer.py from text files, directories and JSONL; its errors."""
import os

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


def test_bad_arguments(tmp_path, train_tokenizer, capsys):
    with pytest.raises(SystemExit) as e:
        train_tokenizer.main([str(tmp_path), "--output", str(tmp_path / "x.model"), "--model-type", "wordpiece"])
    assert e.value.code == 1
    assert capsys.readouterr().err.startswith("error: argument --model-type: invalid choice: 'wordpiece'")


def _error(train_tokenizer, capsys, argv) -> str:
    assert train_tokenizer.main(argv) == 1
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and not captured.out, captured
    return lines[0]


def test_every_error_is_one_line(tmp_path, train_tokenizer, capsys):
    """Missing, empty and unusable inputs, and an --output that cannot be written (found before training)."""
    good = tmp_path / "good.txt"
    good.write_text("alpha beta gamma\n" * 50)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("  \n\n")
    (tmp_path / "dir").mkdir()
    (tmp_path / "FILE").write_text("x")
    out = str(tmp_path / "t.model")
    assert "'missing.txt' is not a file or directory" in _error(train_tokenizer, capsys, ["missing.txt", "--output", out])
    assert "no input files found" in _error(train_tokenizer, capsys, [str(tmp_path / "dir"), "--output", out])
    line = _error(train_tokenizer, capsys, [str(tmp_path / "empty.txt"), str(tmp_path / "blank.txt"), "--output", out])
    assert line.startswith(f"error: {tmp_path / 'empty.txt'} and 1 more input files: no text to train")
    assert _error(train_tokenizer, capsys, [str(good), "--output", str(tmp_path / "dir")]) == \
        f"error: --output {tmp_path / 'dir'}: is a directory, not a .model file"
    assert _error(train_tokenizer, capsys, [str(good), "--output", str(tmp_path / "FILE" / "t.model")]) == \
        f"error: --output {tmp_path / 'FILE' / 't.model'}: {tmp_path / 'FILE'} is a file, not a directory"
    assert _error(train_tokenizer, capsys, [str(good), "--output", "/proc/t.model"]).startswith(
        "error: --output /proc/t.model: cannot write there")
    assert not os.path.exists(out)


def test_small_input_warns_and_prints_the_vocabulary_it_made(tmp_path, train_tokenizer, capsys):
    src = tmp_path / "tiny.txt"
    src.write_text("alpha beta gamma delta\n" * 20)
    out = tmp_path / "tiny.model"
    assert train_tokenizer.main([str(src), "--vocab-size", "32000", "--output", str(out)]) == 0
    produced = SentencePieceTokenizer(str(out)).vocab_size
    assert produced < 32000
    captured = capsys.readouterr()
    assert f"vocab {produced}," in captured.out
    assert (f"warning: produced a vocabulary of {produced} pieces, not the --vocab-size 32000 asked for"
            in captured.err)


def test_no_warning_when_the_vocabulary_is_as_asked(tmp_path, train_tokenizer, documents, capsys):
    src = write_jsonl(tmp_path / "a.jsonl", documents)
    assert train_tokenizer.main([src, "--vocab-size", "300", "--output", str(tmp_path / "t.model")]) == 0
    assert "warning" not in capsys.readouterr().err
