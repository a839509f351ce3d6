"""--fp8-grad-scaling delayed (megacoat/fp8/grad_scaling.py): SwiGLU's gradient in a coat block scaled by the amax
history of earlier backward calls.

The tests use what makes the two scalings meet exactly: the first backward scales by its own amax (bootstrap), and
a backward of the same input as the previous one has the same amax as the one recorded, so its delayed scale is the
current scale and its gradients equal current scaling's bit for bit. A larger input overflows the recorded amax
and must then differ (saturation), which shows the history is what the cast used."""
import pytest
import torch

from megacoat.fp8.config import FP8Config
from megacoat.fp8.convert import convert_to_fp8
from megacoat.fp8.grad_scaling import DelayedGradScale
from megacoat.fp8.linear import refresh_fp8_weights
from megacoat.model.config import ModelConfig
from megacoat.model.gpt import GPT
from tests.fp8.test_blocks import CFG, _run

KEY = "swiglu_grad_scale.amax_history"


def _model(grad_scaling, history_len=4, dtype=torch.float32, device="cpu"):
    torch.manual_seed(0)
    fp8 = FP8Config(mode="coat", group_size=32, grad_scaling=grad_scaling, amax_history_len=history_len)
    model = convert_to_fp8(GPT(ModelConfig(**CFG)), fp8).to(device=device, dtype=dtype)
    refresh_fp8_weights(model)
    return model


def _inputs(model, dtype=torch.float32, device="cpu"):
    cos, sin = model._rope(torch.device(device))
    x = torch.randn(2, CFG["seq_length"], CFG["hidden_size"], dtype=dtype, device=device,
                    generator=torch.Generator(device).manual_seed(1))
    return x, cos, sin


def _step(fn, block, x, cos, sin):
    return _run(fn, block, x.clone().requires_grad_(), cos, sin)


def _equal(a, b):
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and all(torch.equal(a[2][n], g)
                                                                      for n, g in b[2].items())


def test_history_meets_current_scaling_exactly_where_the_amax_repeats():
    current, delayed = _model("current"), _model("delayed")
    x, cos, sin = _inputs(current)
    cb, db = current.layers[0], delayed.layers[0]
    history = db.swiglu_grad_scale.amax_history
    assert not db.swiglu_grad_scale.ready and cb.swiglu_grad_scale is None
    # 1st backward: nothing recorded, so it scales by its own amax, as current scaling does, and records it
    assert _equal(_step(db, db, x, cos, sin), _step(cb, cb, x, cos, sin))
    first = history[0].item()
    assert first > 0 and history[1:].eq(0).all() and db.swiglu_grad_scale.ready
    # 2nd, the same input: the recorded amax is this call's own, so one pass gives the two passes' bytes
    assert _equal(_step(db, db, x, cos, sin), _step(cb, cb, x, cos, sin))
    assert history[:2].tolist() == [first, first]
    # 3rd, a larger gradient: the scale is the history's, values beyond it saturate, results differ
    big = _step(db, db, 4 * x, cos, sin)
    assert not _equal(big, _step(cb, cb, 4 * x, cos, sin))
    assert history[0].item() > first and history[1:3].tolist() == [first, first]
    assert all(torch.isfinite(g).all() for g in big[2].values())


def test_evaluation_forwards_leave_the_history_alone():
    model = _model("delayed")
    block = model.layers[0]
    x, cos, sin = _inputs(model)
    with torch.no_grad():
        block(x, cos, sin)
    assert not block.swiglu_grad_scale.ready and block.swiglu_grad_scale.amax_history.eq(0).all()


def test_compiled_block_equals_eager_with_its_history():
    """fullgraph (AOTAutograd): the history's in-place roll is part of the backward graph; the one-time flag
    (bootstrap) costs one retrace, and then the graph stays."""
    torch._dynamo.reset()
    eager_model, compiled_model = _model("delayed"), _model("delayed")
    x, cos, sin = _inputs(eager_model)
    eb, cb = eager_model.layers[0], compiled_model.layers[0]
    explained = torch._dynamo.explain(_model("delayed").layers[0])(x, cos, sin)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(cb, fullgraph=True, backend="aot_eager")
    for scale in (1.0, 1.0, 3.0, 0.5):
        assert _equal(_step(compiled, cb, scale * x, cos, sin), _step(eb, eb, scale * x, cos, sin))
        assert torch.equal(cb.swiglu_grad_scale.amax_history, eb.swiglu_grad_scale.amax_history)


def test_checkpoints_carry_the_history_and_switching_the_flag_loads():
    trained = _model("delayed")
    x, cos, sin = _inputs(trained)
    for _ in range(2):
        _step(trained.layers[0], trained.layers[0], x, cos, sin)
    state = trained.state_dict()
    saved = state[f"layers.0.{KEY}"].clone()
    resumed = _model("delayed")
    resumed.load_state_dict(state)  # strict
    assert resumed.layers[0].swiglu_grad_scale.ready
    assert torch.equal(resumed.layers[0].swiglu_grad_scale.amax_history, saved)
    assert _equal(_step(resumed.layers[0], resumed.layers[0], x, cos, sin),
                  _step(trained.layers[0], trained.layers[0], x, cos, sin))  # resume continues exactly
    # a checkpoint without the history (current scaling) starts delayed scaling afresh
    fresh = _model("delayed")
    fresh.load_state_dict(_model("current").state_dict())
    assert not fresh.layers[0].swiglu_grad_scale.ready and fresh.layers[0].swiglu_grad_scale.amax_history.eq(0).all()
    # current scaling resumes a delayed checkpoint (the history is dropped)
    _model("current").load_state_dict(state)
    # another history length keeps the most recent entries
    short = _model("delayed", history_len=2)
    short.load_state_dict(state)
    assert torch.equal(short.layers[0].swiglu_grad_scale.amax_history, saved[:2])


def test_a_bf16_model_keeps_its_history_in_float32():
    model = _model("delayed", dtype=torch.bfloat16)
    history = model.layers[0].swiglu_grad_scale.amax_history
    assert history.dtype == torch.float32
    x, cos, sin = _inputs(model, torch.bfloat16)
    for _ in range(2):
        _step(model.layers[0], model.layers[0], x, cos, sin)
    assert history.dtype == torch.float32 and history[:2].gt(0).all()
    assert model.half().layers[0].swiglu_grad_scale.amax_history.dtype == torch.float32


def test_history_length_is_checked():
    with pytest.raises(ValueError, match="--fp8-amax-history-len"):
        DelayedGradScale(0)
    with pytest.raises(ValueError, match="--fp8-grad-scaling"):
        FP8Config(mode="fp8-linear", grad_scaling="delayed")


@pytest.mark.gpu
def test_gpu_delayed_block_under_cuda_graphs():
    """CUDA, bf16, compiled as the trainer's --enable-cuda-graph compiles a block (cudagraph trees): the backward's
    history roll is captured (no graph is skipped for its in-place write) and the replayed history follows the
    eager one: with eager's bf16 roundings (tests/fp8/test_blocks.py's gpu test) the FP8 inputs are the same and
    the amaxes differ by fp32 reassociation only; 2^-6 leaves room for a rare flipped bf16 rounding at the max."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager_model, graph_model = (_model("delayed", dtype=torch.bfloat16, device="cuda") for _ in range(2))
    x, cos, sin = _inputs(eager_model, torch.bfloat16, "cuda")
    eb, gb = eager_model.layers[0], graph_model.layers[0]
    import torch._inductor.config as inductor_config

    graphed = torch.compile(gb, mode="reduce-overhead")
    with inductor_config.patch(emulate_precision_casts=True):  # eager's bf16 roundings: the same FP8 inputs
        for _ in range(6):
            _step(eb, eb, x, cos, sin)
            _step(graphed, gb, x, cos, sin)
    torch.cuda.synchronize()
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    he, hg = eb.swiglu_grad_scale.amax_history.float(), gb.swiglu_grad_scale.amax_history.float()
    assert hg.gt(0).all() and ((hg - he).abs() / he).max().item() <= 2 ** -6
