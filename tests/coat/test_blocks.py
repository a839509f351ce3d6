"""torch.compile(fullgraph=True) of one transformer block in every activation mode: no graph break, forward and
backward, and the compiled block computes what the eager one does.

On CPU the megacoat:: operators trace into their torch references, the functions eager runs on CPU. With the
aot_eager backend the traced graph runs those very aten ops in the same order, so compiled == eager bit for bit.
With Inductor the same graph becomes fused C++ loops that reorder fp32 arithmetic: a few fp32 ulps on the
O(1) values (see the tolerances there). Tensor parallelism (TP=2 on gloo, with and without sequence
parallelism): the same, with the TP region's collectives in the graph. The CUDA path (the megacoat:: operators'
Triton and CUDA kernels inside Inductor's graph) is checked by the gpu-marked test.
"""
import collections

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd

from tests.coat.recipes import recipe_of
from megacoat.coat.convert import convert_to_coat
from megacoat.coat.linear import refresh_fp8_weights
from megacoat.model.config import ModelConfig
from megacoat.model.gpt import GPT
from megacoat.ops.fp8_gemm import gemm_op

CFG = dict(num_layers=1, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
           seq_length=32, vocab_size=256)
MODES = ["bf16", "fp8-linear", "coat"]


def _block(mode, weight_cache="step", dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    model = convert_to_coat(GPT(ModelConfig(**CFG)), recipe_of(mode=mode, group_size=32, weight_cache=weight_cache))
    model = model.to(device=device, dtype=dtype)
    refresh_fp8_weights(model)
    cos, sin = model._rope(torch.device(device))
    x = torch.randn(2, CFG["seq_length"], CFG["hidden_size"], dtype=dtype, device=device, requires_grad=True)
    return model.layers[0], x, cos, sin


def _run(fn, block, x, cos, sin):
    """Output, input gradient and parameter gradients of one forward and backward."""
    x.grad = None
    block.zero_grad(set_to_none=True)
    y = fn(x, cos, sin)
    y.float().square().sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in block.named_parameters()}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("weight_cache", ["step", "rowwise", "none"])
def test_block_traces_as_one_graph(mode, weight_cache):
    block, x, cos, sin = _block(mode, weight_cache)
    explained = torch._dynamo.explain(block)(x, cos, sin)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("weight_cache", ["step", "rowwise", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fullgraph_block_equals_eager_bit_for_bit(mode, weight_cache, dtype):
    torch._dynamo.reset()
    block, x, cos, sin = _block(mode, weight_cache, dtype)
    eager = _run(block, block, x, cos, sin)
    compiled = _run(torch.compile(block, fullgraph=True, backend="aot_eager"), block, x, cos, sin)
    assert torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])
    for name, g in eager[2].items():
        assert torch.equal(compiled[2][name], g), name


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_inductor_block_matches_eager(mode):
    """fp32: Inductor reorders fp32 arithmetic (a few ulps of O(1) values). An FP8 code could flip where a
    pre-cast value lies within those ulps of a rounding midpoint (about 2^-20 of the elements for E4M3's 3
    mantissa bits against fp32's 23); with this seed none does, so agreement stays at the fp32 level."""
    torch._dynamo.reset()
    block, x, cos, sin = _block(mode)
    eager = _run(block, block, x, cos, sin)
    compiled = _run(torch.compile(block, fullgraph=True), block, x, cos, sin)
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled[1], eager[1], rtol=1e-4, atol=1e-5)
    for name, g in eager[2].items():
        torch.testing.assert_close(compiled[2][name], g, rtol=1e-4, atol=1e-5, msg=f"gradient of {name}")


def _model_grads(model, tokens):
    model.zero_grad(set_to_none=True)
    loss = model(tokens, tokens)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compiled", [False, True])
def test_deferred_block_outputs_give_the_bytes_of_the_blocks_one_by_one(dtype, compiled):
    """CoatLayers (the coat model's block sequence): each block's output addition is made by the next block's
    norm and w2's output gradient is cast from the amax that norm's backward folds in. Loss and every gradient are
    the bytes of the blocks run one by one (the sum rounded as torch's addition; a max in any order is the same
    max), eager and compiled (each block fullgraph, aot_eager: three graphs, first, middle and last)."""
    from megacoat.coat.flow import CoatLayers
    from megacoat.model.gpt import Layers

    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = ModelConfig(**{**CFG, "num_layers": 3})
    model = convert_to_coat(GPT(cfg), recipe_of(mode="coat", group_size=32)).to(dtype)
    assert type(model.layers) is CoatLayers
    refresh_fp8_weights(model)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
    if compiled:
        for block in model.layers:
            block.compile(fullgraph=True, backend="aot_eager")
    deferred = _model_grads(model, tokens)
    model.layers = Layers(model.layers)
    one_by_one = _model_grads(model, tokens)
    assert torch.equal(deferred[0], one_by_one[0])
    for name, g in one_by_one[1].items():
        assert torch.equal(deferred[1][name], g), name


def test_a_deferred_output_needs_the_one_rank_block():
    block, x, cos, sin = _block("coat")
    block.region = type("Region", (), {"enter": lambda s, t: t, "exit": lambda s, t: t,
                                       "replicated": lambda s, w: w})()
    assert not block.takes_deferred_output()
    with pytest.raises(ValueError, match="one-rank block"):
        block(x, cos, sin, defer=True)


def _aot_op_counts(block, x, cos, sin):
    """aten op counts of the forward and backward graphs AOTAutograd hands to the backend."""
    graphs = []

    def keep(gm, _):
        graphs.append(collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function"))
        return gm

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    compiled(x, cos, sin).sum().backward()
    return graphs


def test_compiled_fp8_linear_quantizes_each_input_once():
    """wq/wk/wv and w1/w3 read one tensor each: one quantization per distinct input in the forward graph (4:
    attention input, wo's, FFN input, w2's; weights come from the cache), one per output gradient (7) in the
    backward."""
    block, x, cos, sin = _block("fp8-linear")
    fwd, bwd = _aot_op_counts(block, x, cos, sin)
    gemm = str(gemm_op("cpu"))
    assert fwd[gemm] == 7 and fwd["megacoat.cast_transpose_from_amax.default"] == 4
    assert bwd[gemm] == 14 and bwd["megacoat.cast_transpose_from_amax.default"] == 7
    # each cast's amax is a torch reduction in the graph, where Inductor can fuse it into the tensor's producer
    assert fwd["aten.linalg_vector_norm.default"] == 4 and bwd["aten.linalg_vector_norm.default"] == 7
    assert block.attention.wq.input_cache._traced_x is None  # the block's hook dropped the traced entry


def test_compiled_forward_reads_refreshed_weight_copies_in_place():
    """A compiled forward only reads the FP8 weight copies: after an optimizer step, refresh_fp8_weights rewrites
    them in place (same tensors, so the graph needs no recompile) and compiled == eager again."""
    torch._dynamo.reset()
    block, x, cos, sin = _block("coat")
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    _run(compiled, block, x, cos, sin)
    copies = [t for c, _ in block.fp8_weight_caches() for t in (c.w8, c.w8t, c.scale)]
    before = [t.clone() for t in copies]
    torch.optim.SGD(block.parameters(), lr=0.5).step()
    assert refresh_fp8_weights(block) == 4  # wq|wk|wv, w1|w3, w2 and wo
    after = [t for c, _ in block.fp8_weight_caches() for t in (c.w8, c.w8t, c.scale)]
    assert all(a is b for a, b in zip(after, copies)) and not torch.equal(before[0].float(), after[0].float())
    eager = _run(block, block, x, cos, sin)
    again = _run(compiled, block, x, cos, sin)
    assert torch.equal(again[0], eager[0]) and torch.equal(again[1], eager[1])


def test_compiled_forward_without_refreshed_copies_is_refused():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = convert_to_coat(GPT(ModelConfig(**CFG)), recipe_of(mode="coat", group_size=32))
    cos, sin = model._rope(torch.device("cpu"))
    x = torch.randn(2, CFG["seq_length"], CFG["hidden_size"])
    with pytest.raises(Exception, match="refresh_fp8_weights"):
        torch.compile(model.layers[0], fullgraph=True, backend="aot_eager")(x, cos, sin)


def _tp_block_equal(mode: str, sequence_parallel: bool) -> bool:
    """On each rank of a TP group: block 0 of the tensor-parallel model, compiled fullgraph (AOTAutograd), equals
    its eager run bit for bit, forward and backward (the TP region's collectives are traced into the graph)."""
    import torch.distributed as dist

    from megacoat.parallel.config import ParallelConfig
    from megacoat.parallel.state import initialize_parallel_state
    from megacoat.parallel.tensor_parallel import apply_tp

    cfg = ModelConfig(**dict(CFG, hidden_size=128, ffn_hidden_size=256))  # shards stay multiples of 16
    torch.manual_seed(0)
    model = convert_to_coat(GPT(cfg), recipe_of(mode=mode, group_size=64))
    state = initialize_parallel_state(ParallelConfig(tensor_model_parallel_size=dist.get_world_size(),
                                                     sequence_parallel=sequence_parallel), cfg)
    apply_tp(model, state)
    refresh_fp8_weights(model)
    cos, sin = model._rope(torch.device("cpu"))
    seq = cfg.seq_length // (dist.get_world_size() if sequence_parallel else 1)
    x = torch.randn(2, seq, cfg.hidden_size, generator=torch.Generator().manual_seed(1), requires_grad=True)
    block = model.layers[0]
    eager = _run(block, block, x, cos, sin)
    torch._dynamo.reset()
    compiled = _run(torch.compile(block, fullgraph=True, backend="aot_eager"), block, x, cos, sin)
    return (torch.equal(compiled[0], eager[0]) and torch.equal(compiled[1], eager[1])
            and all(torch.equal(compiled[2][n], g) for n, g in eager[2].items()))


def _tp_cases(cases):
    return [_tp_block_equal(*case) for case in cases]


@pytest.mark.slow
def test_tp2_blocks_compile_fullgraph():
    from tests.parallel.dist_helpers import run_ranks

    cases = [(mode, sp) for mode in MODES for sp in (False, True)]
    per_rank = run_ranks(2, _tp_cases, cases, timeout=900)
    assert per_rank == [[True] * len(cases)] * 2, dict(zip(cases, zip(*per_rank)))


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fp8-linear", "coat"])
def test_gpu_fullgraph_block_matches_eager(mode):
    """CUDA: the megacoat:: kernels run inside Inductor's graph as in eager. Inductor by default keeps the bf16 glue
    (residual adds, RoPE, gradient sums) in fp32 registers instead of rounding each op to bf16 as eager does; a
    value that moves by up to a bf16 half-step can cross an FP8 rounding midpoint, and one E5M2 gradient code is a
    2^-3..2^-2 relative step, so default-compiled and eager are two equally valid FP8 roundings that differ by the
    FP8 error itself (weight gradients of this block: 3-6% apart, each 8-10% from the fp32 reference).
    With emulate_precision_casts Inductor rounds every intermediate to bf16 as eager does, so the FP8 inputs are
    the same; what remains is fp32 reassociation inside fused reductions (ulps of fp32, which may flip a rare bf16
    rounding). Bound: 2^-8 relative (norm-wise) on the output and every gradient, 16 times below E4M3's step
    (2^-4), which a wrong scale, layout or stale weight copy would show."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _assert_bf16_inductor_matches_eager(mode, "cuda")


def _assert_bf16_inductor_matches_eager(mode, device):
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    block, x, cos, sin = _block(mode, dtype=torch.bfloat16, device=device)
    eager = _run(block, block, x, cos, sin)
    with inductor_config.patch(emulate_precision_casts=True):
        compiled = _run(torch.compile(block, fullgraph=True), block, x, cos, sin)
    assert _rel(compiled[0], eager[0]) <= 2 ** -8 and _rel(compiled[1], eager[1]) <= 2 ** -8
    for name, g in eager[2].items():
        assert _rel(compiled[2][name], g) <= 2 ** -8, name


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_inductor_bf16_block_with_eager_rounding_matches_eager(mode):
    """The CPU twin of the gpu test above (the torch references in Inductor's C++ kernels), same bound and reason."""
    _assert_bf16_inductor_matches_eager(mode, "cpu")
