"""Which slice of a parameter each tensor-parallel rank holds, and the plain names of pipeline parameters."""
import pytest
import torch

from megacoat.checkpoint.sharding import merge_tensor_parallel, plain_name, tensor_parallel_dim, tp_shard
from megacoat.model import GPT
from megacoat.model.config import ModelConfig
from megacoat.parallel import tensor_parallel


def test_split_dimensions_follow_the_tensor_parallel_plan():
    assert tensor_parallel.COLUMN == ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
    assert tensor_parallel.ROW == ("attention.wo", "feed_forward.w2")
    dims = {n: tensor_parallel_dim(n) for n, _ in GPT(ModelConfig(num_layers=1, tie_embeddings=False)).named_parameters()}
    assert dims == {"tok_embeddings.weight": 0, "layers.0.attention_norm.weight": None,
                    "layers.0.attention.wq.weight": 0, "layers.0.attention.wk.weight": 0,
                    "layers.0.attention.wv.weight": 0, "layers.0.attention.wo.weight": 1,
                    "layers.0.ffn_norm.weight": None, "layers.0.feed_forward.w1.weight": 0,
                    "layers.0.feed_forward.w3.weight": 0, "layers.0.feed_forward.w2.weight": 1,
                    "norm.weight": None, "output.weight": 0}


@pytest.mark.parametrize("name", ["layers.3.attention.wq.weight", "layers.3.attention.wo.weight", "norm.weight"])
def test_shards_merge_back_to_the_full_tensor(name):
    full = torch.randn(8, 12) if "norm" not in name else torch.randn(12)
    shards = [{name: tp_shard(full, name, r, 4)} for r in range(4)]
    assert torch.equal(merge_tensor_parallel(shards)[name], full)
    if "norm" not in name:
        assert shards[1][name].shape[tensor_parallel_dim(name)] == full.shape[tensor_parallel_dim(name)] // 4


def test_differing_replicas_and_uneven_splits_are_errors():
    with pytest.raises(ValueError, match="replicated parameter differs"):
        merge_tensor_parallel([{"norm.weight": torch.ones(4)}, {"norm.weight": torch.zeros(4)}])
    with pytest.raises(ValueError, match="does not split over 3 ranks"):
        tp_shard(torch.zeros(4, 4), "output.weight", 0, 3)


@pytest.mark.parametrize("engine_name, plain", [
    ("tied_modules.embed.tok_embeddings.weight", "tok_embeddings.weight"),
    ("0.tok_embeddings.weight", "tok_embeddings.weight"),
    ("1.block.attention.wq.weight", "layers.0.attention.wq.weight"),
    ("4.block.ffn_norm.weight", "layers.3.ffn_norm.weight"),
    ("5.weight", "norm.weight"),
    ("6.output.weight", "output.weight"),
    ("layers.2.attention.wk.weight", "layers.2.attention.wk.weight"),
])
def test_pipeline_names_map_to_the_plain_gpt(engine_name, plain):
    assert plain_name(engine_name, num_layers=4) == plain


def test_unknown_pipeline_layer_is_an_error():
    with pytest.raises(ValueError, match="beyond a 4-layer GPT"):
        plain_name("7.weight", 4)
