"""Input discovery and decoding: files, globs, directories, gzip JSONL, and precise malformed-record errors."""
import gzip

import pytest

from megacoat.data.sources import MalformedRecord, decode_record, expand_inputs, iter_documents, iter_records


def test_expand_inputs_is_deterministic(tmp_path):
    for name in ("b/2.txt", "b/1.txt", "a.jsonl", "b/.hidden", "c/d/3.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    assert expand_inputs([str(tmp_path / "b"), str(tmp_path / "c")]) == [
        str(tmp_path / "b/1.txt"), str(tmp_path / "b/2.txt"), str(tmp_path / "c/d/3.txt")]
    assert expand_inputs([str(tmp_path / "**/*.txt")]) == [
        str(tmp_path / "b/1.txt"), str(tmp_path / "b/2.txt"), str(tmp_path / "c/d/3.txt")]
    assert expand_inputs([str(tmp_path / "a.jsonl")]) == [str(tmp_path / "a.jsonl")]
    with pytest.raises(FileNotFoundError, match="nothing"):
        expand_inputs([str(tmp_path / "nothing*")])


def test_gzip_jsonl_and_format_override(tmp_path):
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.write('{"text": "one"}\n\n{"text": "two"}\n')
    assert list(iter_documents([str(tmp_path / "a.jsonl.gz")])) == ["one", "two"]
    (tmp_path / "notes.log").write_text('{"text": "three"}\n')
    assert list(iter_documents([str(tmp_path / "notes.log")])) == ['{"text": "three"}\n']  # plain text
    assert list(iter_documents([str(tmp_path / "notes.log")], input_format="jsonl")) == ["three"]
    with pytest.raises(ValueError, match="input format"):
        list(iter_documents([str(tmp_path / "notes.log")], input_format="csv"))


def test_records_keep_line_numbers(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(b'{"text": "a"}\n\n{"text": 1}\n{"t": "\xff"}\n')
    records = list(iter_records([str(tmp_path / "a.jsonl")]))
    assert [r.line for r in records] == [1, 3, 4]  # blank lines are skipped, not renumbered
    assert decode_record(records[0]) == "a"
    with pytest.raises(MalformedRecord, match=r"a\.jsonl:3: key 'text' holds int"):
        decode_record(records[1])
    with pytest.raises(MalformedRecord, match=r"a\.jsonl:4: not valid UTF-8"):
        decode_record(records[2])
    assert list(iter_documents([str(tmp_path / "a.jsonl")])) == ["a"]
    with pytest.raises(MalformedRecord, match=r"a\.jsonl:3:"):
        list(iter_documents([str(tmp_path / "a.jsonl")], skip_malformed=False))
