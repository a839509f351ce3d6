"""convert_to_coat: same parameters in every mode; coat vs bf16 numerics and saved bytes on a tiny model."""
import copy

import pytest
import torch
import torch.nn.functional as F

from megacoat.coat.flow import CoatTransformerBlock
from tests.coat.recipes import recipe_of
from megacoat.coat.convert import convert_to_coat
from megacoat.coat.linear import Fp8Linear, persistent_weight_caches
from tests.coat.saved_memory import saved_activation_bytes
from megacoat.model.config import ModelConfig
from megacoat.model.gpt import GPT

CFG = dict(num_layers=2, hidden_size=128, ffn_hidden_size=352, num_attention_heads=4, num_query_groups=2,
           seq_length=64, vocab_size=512)


def _model(**kw):
    torch.manual_seed(0)
    return GPT(ModelConfig(**{**CFG, **kw}))


@pytest.mark.parametrize("mode", ["fp8-linear", "coat"])
def test_parameters_are_the_same_objects_and_names(mode):
    model = _model()
    before = dict(model.named_parameters())
    convert_to_coat(model, recipe_of(mode=mode, group_size=64))
    after = dict(model.named_parameters())
    assert list(before) == list(after) and all(before[n] is after[n] for n in before)
    assert model.output.weight is model.tok_embeddings.weight and type(model.output) is torch.nn.Linear
    if mode == "coat":
        assert all(isinstance(b, CoatTransformerBlock) for b in model.layers)
    else:
        assert all(isinstance(m, Fp8Linear) for n, m in model.layers.named_modules() if n.endswith(("wq", "w2")))
    model.load_state_dict(_model().state_dict())  # checkpoints of the plain model load unchanged


def test_bf16_is_a_no_op_and_bad_dims_are_named():
    model = _model()
    assert convert_to_coat(model, recipe_of(mode="bf16")) is model
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())
    with pytest.raises(ValueError, match="multiples of 16"):
        convert_to_coat(_model(ffn_hidden_size=360), recipe_of(mode="coat", group_size=64))


@pytest.mark.parametrize("tie", [True, False])
def test_the_output_layer_in_fp8_shares_its_weight(tie):
    """--fp8-output-layer: the head becomes an Fp8Linear on the same Parameter (the embedding's, where tied), its
    FP8 copy among the caches the trainer refreshes after each step; checkpoints of the plain model still load."""
    model = _model(tie_embeddings=tie)
    before = dict(model.named_parameters())
    caches = len(list(persistent_weight_caches(convert_to_coat(_model(tie_embeddings=tie), recipe_of(mode="coat",
                                                                                                   group_size=64)))))
    convert_to_coat(model, recipe_of(mode="coat", group_size=64, output_layer=True))
    after = dict(model.named_parameters())
    assert list(before) == list(after) and all(before[n] is after[n] for n in before)
    assert isinstance(model.output, Fp8Linear) and (model.output.weight is model.tok_embeddings.weight) == tie
    assert len(list(persistent_weight_caches(model))) == caches + 1
    model.load_state_dict(_model(tie_embeddings=tie).state_dict())


def test_the_output_layer_is_refused_off_the_gemm_alignment_and_without_fp8():
    with pytest.raises(ValueError, match="--fp8-output-layer: .*multiple of 16"):
        convert_to_coat(_model(vocab_size=520), recipe_of(mode="coat", group_size=64, output_layer=True))
    with pytest.raises(ValueError, match="--fp8-output-layer needs FP8 GEMMs"):
        recipe_of(mode="bf16", output_layer=True)


@pytest.mark.parametrize("mode, output_layer", [("fp8-linear", False), ("coat", False), ("coat", True)])
def test_loss_and_gradients_match_bf16(mode, output_layer):
    """Issue 6's bar: relative loss difference <= 2e-2 and per-parameter gradient cosine >= 0.98; with the head in
    FP8 too, the tied embedding's gradient (the head's weight gradient plus the embedding's) under the same bar."""
    base = _model()
    tokens = torch.randint(0, CFG["vocab_size"], (2, 64))
    labels = torch.randint(0, CFG["vocab_size"], (2, 64))

    def run(model):
        loss = model(tokens, labels)
        loss.backward()
        return loss.item(), {n: p.grad for n, p in model.named_parameters()}

    ref_loss, ref_grads = run(copy.deepcopy(base))
    loss, grads = run(convert_to_coat(copy.deepcopy(base), recipe_of(mode=mode, group_size=64,
                                                                     output_layer=output_layer)))
    assert abs(loss - ref_loss) / ref_loss <= 2e-2
    for name, g in ref_grads.items():
        assert F.cosine_similarity(grads[name].flatten(), g.flatten(), dim=0) >= 0.98, name


@pytest.mark.parametrize("mode", ["fp8-linear", "coat"])
def test_activation_checkpointing_gives_the_same_gradients(mode):
    model = convert_to_coat(_model(), recipe_of(mode=mode, group_size=64))
    x = torch.randn(2, 64, CFG["hidden_size"], requires_grad=True)
    cos, sin = model._rope(x.device)
    block = model.layers[0]
    block(x, cos, sin).square().sum().backward()
    want = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad()
    torch.utils.checkpoint.checkpoint(block, x, cos, sin, use_reentrant=False).square().sum().backward()
    for n, p in block.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=0, atol=0)


def test_coat_saves_at_most_055_of_bf16_per_layer():
    """Saved bytes of one layer in bf16 (unique storages, parameters left out): coat <= 0.55x bf16."""
    base = _model(hidden_size=256, ffn_hidden_size=704, num_attention_heads=4, num_query_groups=4).bfloat16()
    x = torch.randn(2, 64, 256, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = base._rope(x.device)
    saved = {}
    for mode in ("bf16", "fp8-linear", "coat"):
        layer = convert_to_coat(copy.deepcopy(base), recipe_of(mode=mode, group_size=64)).layers[0]
        saved[mode], _ = saved_activation_bytes(lambda: layer(x, cos, sin), list(layer.parameters()))
    assert saved["coat"] <= 0.55 * saved["bf16"], saved
    assert saved["coat"] < saved["fp8-linear"] < saved["bf16"], saved


def test_fp8_linear_block_quantizes_each_input_once():
    """wq/wk/wv share the normed x, w1/w3 the other: 4 quantizations of 7 linears' inputs per forward."""
    model = convert_to_coat(_model(), recipe_of(mode="fp8-linear"))
    block = model.layers[0]
    cache = block.attention.wq.input_cache
    assert all(m.input_cache is cache for m in block.modules() if isinstance(m, Fp8Linear))
    x = torch.randn(2, 64, CFG["hidden_size"], requires_grad=True)
    block(x, *model._rope(x.device)).sum().backward()
    assert cache.hits == 3


def test_converting_a_sharded_model_is_refused():
    """FP8 is applied to the full model, before apply_tp: a sharded linear in a block stops the conversion."""
    from megacoat.parallel.layers import ColumnParallelLinear, TPRegion

    model = _model()
    model.layers[0].attention.wq = ColumnParallelLinear(model.layers[0].attention.wq, TPRegion(None, 2, 0))
    with pytest.raises(TypeError, match="before apply_tp: layers.0.attention.wq is a ColumnParallelLinear"):
        convert_to_coat(model, recipe_of(mode="fp8-linear"))


def test_a_coat_block_runs_in_the_identity_region_until_apply_tp_sets_one():
    from megacoat.coat.tensor_parallel import NO_REGION

    model = convert_to_coat(_model(), recipe_of(mode="coat", group_size=64))
    assert type(model) is GPT and all(b.region is NO_REGION for b in model.layers)
