"""End to end: text -> shards -> datasets -> data-parallel batches, and an interrupted run resumed exactly."""
import numpy as np
import torch

from megacoat.data import (SentencePieceTokenizer, build_pretraining_data_loader, build_train_valid_test_datasets,
                           preprocess)
from megacoat.data.config import DataConfig
from tests.data.conftest import write_jsonl


def test_text_to_batches_and_exact_resume(tmp_path, tokenizer_model, documents):
    src = write_jsonl(tmp_path / "in.jsonl", documents)
    r = preprocess([src], str(tmp_path / "shards/web"), tokenizer_model, shard_tokens=3000, progress=False)
    cfg = DataConfig(data_path=r.data_path_args().split(), split="95,5,0", cache_dir=str(tmp_path / "cache"))
    seq, mbs, dp, steps = 32, 2, 2, 10
    train, valid, _ = build_train_valid_test_datasets(cfg, seq, steps * mbs * dp, 8, 0, seed=7)

    def run(consumed, n):
        its = [iter(build_pretraining_data_loader(train, consumed, mbs, r, dp)) for r in range(dp)]
        return [torch.cat([next(it) for it in its]) for _ in range(n)]

    full = run(0, steps)
    assert full[0].shape == (mbs * dp, seq + 1)
    resumed = run(4 * mbs * dp, steps - 4)  # as after a checkpoint at step 4
    assert all(torch.equal(a, b) for a, b in zip(full[4:], resumed))
    # The batches are real text: every sample decodes to a piece of the corpus.
    tok = SentencePieceTokenizer(tokenizer_model)
    sample = full[3][0].tolist()
    piece = tok.decode([t for t in sample if t != tok.eod][1:-1])
    assert any(line and line in "".join(documents) for line in piece.split("\n")[1:-1]) or len(piece) < 40
    assert len(valid) == 8 and np.all(valid[0] < tok.vocab_size)
