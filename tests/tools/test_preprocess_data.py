"""tools/preprocess_data.py: shards, the --data-path line, malformed-line reports, --strict."""
import os

from megacoat.data.indexed_dataset import IndexedDataset
from megacoat.data.tokenizer import SentencePieceTokenizer
from tests.data.conftest import write_jsonl


def test_shards_and_data_path_line(tmp_path, preprocess_data, tokenizer_model, documents, capsys):
    write_jsonl(tmp_path / "a.jsonl", documents)
    prefix = str(tmp_path / "out" / "web")
    assert preprocess_data.main(["--input", str(tmp_path / "*.jsonl"), "--output-prefix", prefix,
                                 "--tokenizer-model", tokenizer_model, "--workers", "2", "--shard-tokens", "4000",
                                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    data_path = out.strip().splitlines()[-1].split()[1:]
    prefixes = data_path[1::2]
    assert len(prefixes) > 1 and all(p.startswith(prefix + "_") for p in prefixes)
    tok = SentencePieceTokenizer(tokenizer_model)
    decoded = [tok.decode(IndexedDataset(p)[i][:-1]) for p in prefixes for i in range(len(IndexedDataset(p)))]
    assert decoded == documents
    assert not [n for n in os.listdir(tmp_path / "out") if ".tmp-" in n]


def test_malformed_report_and_strict(tmp_path, preprocess_data, tokenizer_model, capsys):
    src = tmp_path / "a.jsonl"
    src.write_text('{"text": "alpha"}\n{"text": null}\nnot json\n{"text": "beta"}\n')
    args = ["--input", str(src), "--output-prefix", str(tmp_path / "o"), "--tokenizer-model", tokenizer_model,
            "--no-progress"]
    assert preprocess_data.main(args) == 0
    err = capsys.readouterr().err
    assert "2 malformed record(s)" in err
    assert f"{src}:2: key 'text' holds NoneType" in err and f"{src}:3: bad JSON" in err
    assert len(IndexedDataset(str(tmp_path / "o"))) == 2
    assert preprocess_data.main(args[:3] + [str(tmp_path / "s")] + args[4:] + ["--strict"]) == 1
    assert f"{src}:2:" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "s.idx")
