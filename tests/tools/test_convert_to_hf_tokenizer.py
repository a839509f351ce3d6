"""tools/convert_to_hf.py's tokenizer: with the tokenizer_config.json it writes, transformers' Llama tokenizers
encode every text to exactly the ids megacoat's tokenizer gives (the ids its shards hold): no dummy prefix piece,
no BOS/EOS, special-token text taken as characters."""
import json

import pytest

from megacoat.data.tokenizer import SentencePieceTokenizer
from tests.tools.conftest import load_tool
from tests.tools.test_convert_to_hf import CONFIGS, _model, write_checkpoint

transformers = pytest.importorskip("transformers")

TEXTS = ["hello world", " leading space", "  two leading spaces", "\nnewline first", "\n\n  indented\n",
         "def f(x):\n    return x + 1\n", "tab\there 12345", "trailing  ", "héllo wörld — 世界 🙂", "<s> and </s> text",
         "<unk><pad>", "", " "]


def _loaders():
    names = ("LlamaTokenizer", "LlamaTokenizerFast", "AutoTokenizer")
    return [getattr(transformers, n) for n in names if hasattr(transformers, n)]


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tokenizer_model):
    tmp = tmp_path_factory.mktemp("hf_tok")
    cfg = CONFIGS["tied-mha"]
    write_checkpoint(tmp / "ckpt", _model(cfg))
    meta_path = tmp / "ckpt" / "iter_0000007" / "megacoat.json"
    meta = json.loads(meta_path.read_text())
    meta["tokenizer"] = {"path": tokenizer_model}
    meta_path.write_text(json.dumps(meta))
    return load_tool("convert_to_hf").convert(str(tmp / "ckpt"), str(tmp / "hf"))


@pytest.mark.parametrize("loader", _loaders(), ids=lambda c: c.__name__)
def test_hf_tokenizers_encode_the_ids_of_the_shards(exported, tokenizer_model, loader):
    ours = SentencePieceTokenizer(tokenizer_model)
    tok = loader.from_pretrained(exported)
    for text in TEXTS:
        want = ours.encode(text)
        assert tok.encode(text) == want, (text, tok.encode(text), want)
        assert tok(text)["input_ids"] == want, text
        assert tok.encode(text, add_special_tokens=False) == want, text
    assert tok.eos_token_id == ours.eod
    assert tok.decode(ours.encode("  indented\nlines\n")) == "  indented\nlines\n"


def test_without_the_config_hf_defaults_differ(exported, tokenizer_model, tmp_path):
    """What the config fixes: HF's Llama defaults (BOS, a dummy prefix piece) give other ids."""
    import shutil

    shutil.copyfile(f"{exported}/tokenizer.model", tmp_path / "tokenizer.model")
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = SentencePieceTokenizer(tokenizer_model)
    assert any(tok.encode(text) != ours.encode(text) for text in TEXTS)
