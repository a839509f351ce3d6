"""The COAT block with its FP8 settings and delayed-scaling state passed as objects (FlowSettings, FlowScales): the
checkpoint keys of the block that took them one by one, the same bytes as that block, and one graph when compiled.
"""
import pathlib
import subprocess
import types
from dataclasses import replace

import pytest
import torch

import megacoat.coat.convert as convert
from tests.coat.recipes import recipe_of
from tests.coat.test_blocks import CFG
from megacoat.coat.convert import convert_to_coat
from megacoat.coat.linear import refresh_fp8_weights
from megacoat.coat.recipe import RECIPES
from megacoat.model.config import ModelConfig
from megacoat.model.gpt import GPT

ROOT = pathlib.Path(__file__).resolve().parents[2]
# the last commit whose fused functions took the settings and the histories one by one
BEFORE_OBJECTS = "6ed01a2"
LAYER_PARAMS = ("attention_norm.weight", "attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
                "attention.wo.weight", "ffn_norm.weight", "feed_forward.w1.weight", "feed_forward.w3.weight",
                "feed_forward.w2.weight")
# in registration order, as the block before the objects saved them
LAYER_SITES = ("swiglu_grad_scale", "qkv_grad_scale", "qkv_norm_out_scale", "mlp_norm_out_scale", "swiglu_out_scale",
               "wo_in_scale")


def _delayed_recipe():
    return RECIPES["coat"].for_layout(vocab_size=CFG["vocab_size"], hidden_size=CFG["hidden_size"])


def _keys(sites: bool, layers: int = 2) -> list[str]:
    per_layer = [*LAYER_PARAMS, *(f"{s}.amax_history" for s in LAYER_SITES if sites)]
    return (["tok_embeddings.weight"] + [f"layers.{i}.{k}" for i in range(layers) for k in per_layer]
            + ["norm.weight", "output.weight"])


@pytest.mark.parametrize("delayed", [False, True])
def test_checkpoint_keys_are_those_before_the_objects(delayed):
    """The delayed-scaling sites stay submodules of the block: a checkpoint written before loads (strict)."""
    recipe = _delayed_recipe() if delayed else recipe_of(mode="coat")
    model = convert_to_coat(GPT(ModelConfig(**{**CFG, "num_layers": 2})), recipe)
    assert list(model.state_dict()) == _keys(delayed)
    model.load_state_dict(model.state_dict())


def _flow_before_objects():
    """megacoat/coat/flow.py as it was before the objects, loaded from the repository's history."""
    try:
        source = subprocess.run(["git", "show", f"{BEFORE_OBJECTS}:megacoat/coat/flow.py"], cwd=ROOT, check=True,
                                capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("needs the repository's history")
    module = types.ModuleType("flow_before_objects")
    exec(compile(source, "flow_before_objects.py", "exec"), module.__dict__)
    return module


def _steps(model, steps=2):
    """Losses, gradients and state of a few SGD steps, then a forward without gradients (the histories alone)."""
    refresh_fp8_weights(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen, out = torch.Generator().manual_seed(1), []
    for _ in range(steps):
        tokens = torch.randint(0, CFG["vocab_size"], (2, CFG["seq_length"]), generator=gen)
        loss = model(tokens, tokens)
        loss.backward()
        out += [loss.detach(), *(p.grad.clone() for p in model.parameters())]
        opt.step()
        opt.zero_grad(set_to_none=True)
        refresh_fp8_weights(model)
    with torch.no_grad():
        out.append(model(tokens, tokens))
    return out + list(model.state_dict().values())


@pytest.mark.parametrize("delayed,weight_cache", [(True, "rowwise"), (True, "none"), (False, "step")])
def test_same_bytes_as_the_block_before_the_objects(monkeypatch, delayed, weight_cache):
    """Three blocks (CoatLayers: the deferred additions and carriers), bf16: every loss, gradient and history equal
    to those of the same model converted with the block that took its settings one by one."""
    old = _flow_before_objects()
    recipe = _delayed_recipe() if delayed else recipe_of(mode="coat")
    recipe = replace(recipe, group_size=32, weight_cache=weight_cache, amax_history_len=4)

    def run(flow):
        monkeypatch.setattr(convert, "CoatTransformerBlock", flow.CoatTransformerBlock)
        monkeypatch.setattr(convert, "CoatLayers", flow.CoatLayers)
        torch.manual_seed(0)
        model = convert_to_coat(GPT(ModelConfig(**{**CFG, "num_layers": 3})), recipe).to(torch.bfloat16)
        assert type(model.layers[0]) is flow.CoatTransformerBlock
        return _steps(model)

    import megacoat.coat.flow as new
    before, after = run(old), run(new)
    assert len(before) == len(after)
    for i, (a, b) in enumerate(zip(before, after)):
        assert a.dtype == b.dtype and torch.equal(a, b), i


@pytest.mark.parametrize("delayed", [False, True])
@pytest.mark.parametrize("deferred", [False, True])
def test_block_with_the_objects_traces_as_one_graph(delayed, deferred):
    """Frozen settings and a NamedTuple of histories and flags cross the autograd functions: no graph break, with
    delayed scaling and in CoatLayers' deferred form (the previous block's output and carrier in, its own out)."""
    torch.manual_seed(0)
    recipe = _delayed_recipe() if delayed else recipe_of(mode="coat")
    model = convert_to_coat(GPT(ModelConfig(**CFG)), recipe)
    refresh_fp8_weights(model)
    cos, sin = model._rope(torch.device("cpu"))
    x = torch.randn(2, CFG["seq_length"], CFG["hidden_size"], requires_grad=True)
    extra = (torch.randn_like(x, requires_grad=True), torch.zeros(1, requires_grad=True), True) if deferred else ()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model.layers[0])(x, cos, sin, *extra)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons


@pytest.mark.gpu
def test_gpu_graphed_block_with_the_objects_has_no_graph_break():
    """CUDA, the default coat recipe (delayed scaling): the block traces as one graph, and compiled fullgraph in
    mode reduce-overhead (--enable-cuda-graph) it trains a few steps with its histories advancing."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")

    def block_and_inputs():
        torch.manual_seed(0)
        model = convert_to_coat(GPT(ModelConfig(**CFG)), _delayed_recipe()).cuda().to(torch.bfloat16)
        refresh_fp8_weights(model)
        cos, sin = model._rope(torch.device("cuda"))
        x = torch.randn(2, CFG["seq_length"], CFG["hidden_size"], device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
        return model.layers[0], x, cos, sin

    block, *inputs = block_and_inputs()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(block)(*inputs)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    block, *inputs = block_and_inputs()  # explain's forward took the first call's bootstrap
    torch._dynamo.reset()
    graphed = torch.compile(block, fullgraph=True, mode="reduce-overhead")
    for _ in range(4):
        torch.compiler.cudagraph_mark_step_begin()
        # the last step's gradients are outputs of the graph's pool, which this replay overwrites: no accumulation
        inputs[0].grad = None
        block.zero_grad(set_to_none=True)
        graphed(*inputs).float().square().sum().backward()
    for site in LAYER_SITES:  # four forwards and backwards recorded at every site
        assert bool(block.get_submodule(site).amax_history[:4].gt(0).all()), site
    assert torch.isfinite(inputs[0].grad).all()
