"""CoatRecipe: auto resolved once by for_layout, named recipes, the CLI's --fp8-recipe; after_optimizer_step."""
import pytest
import torch

from megacoat.arguments import parse_config
from megacoat.coat import RECIPES, CoatRecipe, after_optimizer_step, convert_to_coat
from megacoat.model import GPT, ModelConfig

CFG = dict(num_layers=1, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, seq_length=32, vocab_size=128)


def test_for_layout_resolves_auto_as_the_trainer_did():
    one = RECIPES["coat"].for_layout(1, 1, 128, 64)
    assert (one.grad_scaling, one.activation_scaling, one.output_layer) == ("delayed", "delayed", True)
    pipelined = RECIPES["coat"].for_layout(1, 2, 128, 64)  # a stage's histories are the one-stage run's
    assert (pipelined.grad_scaling, pipelined.activation_scaling) == ("delayed", "delayed") and pipelined.output_layer
    tp = RECIPES["coat"].for_layout(2, 2, 128, 64)  # the vocabulary-parallel FP8 head
    assert (tp.grad_scaling, tp.output_layer) == ("delayed", True)
    assert RECIPES["coat"].for_layout(16, 1, 128, 64).output_layer is False  # 8 rows a rank: off the GEMM alignment
    assert RECIPES["coat"].for_layout(1, 1, 120, 64).output_layer is False  # off the GEMM alignment
    plain = CoatRecipe().for_layout()
    assert (plain.grad_scaling, plain.output_layer, plain.resolved) == ("current", False, True)
    current = RECIPES["coat-current"].for_layout(1, 1, 128, 64)
    assert (current.grad_scaling, current.activation_scaling, current.output_layer) == ("current", "current", False)


def test_for_layout_refuses_explicit_choices_the_layout_cannot_run():
    with pytest.raises(ValueError, match="--fp8-output-layer on"):
        CoatRecipe(mode="coat", output_layer=True).for_layout(1, 1, 120, 64)
    with pytest.raises(ValueError, match="--fp8-output-layer on: the FP8 head needs each tensor-parallel rank's"):
        CoatRecipe(mode="coat", output_layer=True).for_layout(16, 2, 128, 64)
    explicit = CoatRecipe(mode="coat", grad_scaling="delayed", activation_scaling="delayed", output_layer=True)
    assert explicit.for_layout(1, 4, 128, 64) == explicit  # pipeline parallelism takes every FP8 choice
    with pytest.raises(ValueError, match="--fp8-activation-scaling delayed applies"):
        CoatRecipe(mode="fp8-linear", activation_scaling="delayed")


def test_micro_batches_the_fp8_gemms_cannot_take_are_refused_by_both_flags():
    with pytest.raises(ValueError, match=r"--micro-batch-size 1 x --seq-length 30 = 30 tokens .* multiple of 16"):
        RECIPES["coat"].check_micro_batch(1, 30)
    RECIPES["coat"].check_micro_batch(2, 8)  # 16 tokens
    RECIPES["bf16"].check_micro_batch(1, 30)  # no FP8 GEMM


def test_convert_takes_resolved_recipes_only():
    with pytest.raises(ValueError, match="for_layout"):
        convert_to_coat(GPT(ModelConfig(**CFG)), RECIPES["coat"])


def test_the_cli_starts_from_the_named_recipe_and_overrides_it():
    cfg = parse_config(["--fp8-recipe", "coat-current", "--fp8-grad-scaling", "delayed"])
    assert (cfg.fp8.mode, cfg.fp8.grad_scaling, cfg.fp8.activation_scaling) == ("coat", "delayed", "current")
    assert cfg.optim.fp8_optimizer and cfg.fp8.optimizer
    assert parse_config(["--coat-fp8", "--fp8-m-dtype", "e5m2"]).optim.fp8_m_dtype == "e5m2"
    assert parse_config([]).fp8 == CoatRecipe().for_layout()


def test_after_optimizer_step_rewrites_the_weight_copies_in_place():
    model = convert_to_coat(GPT(ModelConfig(**CFG)), RECIPES["coat-current"])
    after_optimizer_step(model)
    cache = model.layers[0].w2_cache
    before = cache.w8
    w8 = before.clone()
    model.layers[0].feed_forward.w2.weight.data.mul_(-1)  # behind autograd's back, as DeepSpeed writes
    after_optimizer_step(model)
    assert cache.w8 is before and not torch.equal(cache.w8, w8)
