"""The layout-free format: written atomically, read whole or one tensor-parallel slice at a time."""
import json
import os

import pytest
import torch

from megacoat.checkpoint.layout_free import LayoutFreeCheckpoint, write_layout_free
from megacoat.checkpoint.sharding import tp_shard

META = {"iteration": 3, "consumed_samples": 24, "megacoat_config": {"model": {"tie_embeddings": True}},
        "optimizer": {"kind": "adamw", "step": 3, "keys": ["exp_avg", "exp_avg_sq"]}}


def tensors(seed):
    g = torch.Generator().manual_seed(seed)
    return {"tok_embeddings.weight": torch.randn(16, 8, generator=g),
            "layers.0.attention.wo.weight": torch.randn(8, 8, generator=g), "norm.weight": torch.randn(8, generator=g)}


def test_written_tensors_read_back_whole_and_sliced(tmp_path):
    weights = {**tensors(0), "output.weight": tensors(0)["tok_embeddings.weight"]}
    state = {"exp_avg": tensors(1), "exp_avg_sq": tensors(2)}
    write_layout_free(str(tmp_path / "iter_0000003"), META, weights, state, tied=True)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000003"]  # no temporary left
    ck = LayoutFreeCheckpoint(str(tmp_path / "iter_0000003"))
    assert sorted(ck.names()) == sorted(tensors(0))  # the tied head is not stored twice
    assert ck.state_keys == ["exp_avg", "exp_avg_sq"] and ck.meta["format"] == "layout-free"
    for name, w in tensors(0).items():
        assert torch.equal(ck.tensor(name), w)
        for r in range(2):
            assert torch.equal(ck.tensor(name, None, r, 2), tp_shard(w, name, r, 2))
            assert torch.equal(ck.tensor(name, "exp_avg_sq", r, 2), tp_shard(tensors(2)[name], name, r, 2))
    assert torch.equal(ck.tensor("output.weight", None, 1, 2), tp_shard(weights["output.weight"], "output.weight", 1, 2))


def test_state_must_cover_every_parameter(tmp_path):
    with pytest.raises(ValueError, match="lacks parameters"):
        write_layout_free(str(tmp_path / "t"), META, tensors(0), {"exp_avg": {"norm.weight": torch.zeros(8)}})


def test_a_deepspeed_checkpoint_is_not_read_as_layout_free(tmp_path):
    (tmp_path / "megacoat.json").write_text(json.dumps({"iteration": 1}))
    with pytest.raises(ValueError, match="not a layout-free checkpoint"):
        LayoutFreeCheckpoint(str(tmp_path))
