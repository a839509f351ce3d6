"""Delayed scaling (megacoat/coat/delayed_scaling.py) in a coat block, at both of its sites: SwiGLU's gradient scaled by
the amax history of earlier backward calls (--fp8-grad-scaling delayed), and the FP8 outputs of the two RMSNorms and
SwiGLU and wo's input (attention's output) scaled by the histories of earlier forwards (--fp8-activation-scaling
delayed).

The tests use what makes the two scalings meet exactly: the first call scales by its own amax (bootstrap), and a
call on the same input as the previous one has the same amax as the one recorded, so its delayed scale is the
current scale and its results equal current scaling's bit for bit. A larger input overflows the recorded amax and
must then differ (saturation), which shows the history is what the cast used."""
import pytest
import torch

from tests.coat.recipes import recipe_of
from megacoat.coat.convert import convert_to_coat
from megacoat.coat.delayed_scaling import AmaxHistorySync, DelayedScale
from megacoat.coat.linear import refresh_fp8_weights
from megacoat.model.config import ModelConfig
from megacoat.model.gpt import GPT
from tests.coat.test_blocks import CFG, _run
from tests.parallel.dist_helpers import run_ranks

# the block's delayed-scaling modules per site
SITES = {"grad": ("swiglu_grad_scale", "qkv_grad_scale"),
         "activation": ("qkv_norm_out_scale", "mlp_norm_out_scale", "swiglu_out_scale", "wo_in_scale")}


def _model(scaling, history_len=4, dtype=torch.float32, device="cpu", site="grad"):
    """scaling "delayed" at `site` (the other site current), or "current" everywhere."""
    torch.manual_seed(0)
    delayed = {f"{s}_scaling": scaling if s == site else "current" for s in SITES}
    fp8 = recipe_of(mode="coat", group_size=32, amax_history_len=history_len, **delayed)
    model = convert_to_coat(GPT(ModelConfig(**CFG)), fp8).to(device=device, dtype=dtype)
    refresh_fp8_weights(model)
    return model


def _inputs(model, dtype=torch.float32, device="cpu"):
    cos, sin = model._rope(torch.device(device))
    x = torch.randn(2, CFG["seq_length"], CFG["hidden_size"], dtype=dtype, device=device,
                    generator=torch.Generator(device).manual_seed(1))
    return x, cos, sin


def _step(fn, block, x, cos, sin):
    return _run(fn, block, x.clone().requires_grad_(), cos, sin)


def _larger(x, site):
    """An input whose amax at `site` exceeds x's: a larger gradient (4x: the loss is quadratic), or one outlier
    feature 8x (RMSNorm undoes a uniform scale, so the normed outputs only grow with an outlier)."""
    if site == "grad":
        return 4 * x
    y = x.clone()
    y[..., 3] *= 8
    return y


def _enlarge_attention_output(block, site):
    """wo's input, attention's output, mixes v's rows, which the outlier of _larger does not enlarge (RMSNorm
    spreads it): wv scaled 8x does, for the activation site (an in-place update: the FP8 weight copies follow)."""
    if site == "activation":
        with torch.no_grad():
            block.attention.wv.weight.mul_(8)


def _histories(block, site):
    return [getattr(block, name).amax_history for name in SITES[site]]


def _scales(block, site):
    return [getattr(block, name) for name in SITES[site]]


def _equal(a, b):
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and all(torch.equal(a[2][n], g)
                                                                      for n, g in b[2].items())


@pytest.mark.parametrize("site", SITES)
def test_history_meets_current_scaling_exactly_where_the_amax_repeats(site):
    current, delayed = _model("current", site=site), _model("delayed", site=site)
    x, cos, sin = _inputs(current)
    cb, db = current.layers[0], delayed.layers[0]
    assert not any(s.ready for s in _scales(db, site)) and all(getattr(cb, n) is None for n in SITES[site])
    # 1st call: nothing recorded, so it scales by its own amax, as current scaling does, and records it
    assert _equal(_step(db, db, x, cos, sin), _step(cb, cb, x, cos, sin))
    first = [h[0].item() for h in _histories(db, site)]
    assert all(f > 0 for f in first) and all(h[1:].eq(0).all() for h in _histories(db, site))
    assert all(s.ready for s in _scales(db, site))
    # 2nd, the same input: the recorded amax is this call's own, so one pass gives the two passes' bytes
    assert _equal(_step(db, db, x, cos, sin), _step(cb, cb, x, cos, sin))
    assert all(h[:2].tolist() == [f, f] for h, f in zip(_histories(db, site), first))
    # 3rd, a larger amax: the scale is the history's, values beyond it saturate, results differ
    for block in (cb, db):
        _enlarge_attention_output(block, site)
    big = _step(db, db, _larger(x, site), cos, sin)
    assert not _equal(big, _step(cb, cb, _larger(x, site), cos, sin))
    assert all(h[0].item() > f and h[1:3].tolist() == [f, f] for h, f in zip(_histories(db, site), first))
    assert all(torch.isfinite(g).all() for g in big[2].values())


@pytest.mark.parametrize("site", SITES)
def test_evaluation_forwards_leave_the_history_alone(site):
    model = _model("delayed", site=site)
    block = model.layers[0]
    x, cos, sin = _inputs(model)
    with torch.no_grad():
        block(x, cos, sin)
    assert not any(s.ready for s in _scales(block, site)) and all(h.eq(0).all() for h in _histories(block, site))


@pytest.mark.parametrize("site", SITES)
def test_compiled_block_equals_eager_with_its_history(site):
    """fullgraph (AOTAutograd): the history's in-place roll is part of the graph; the one-time flag (bootstrap)
    costs one retrace, and then the graph stays."""
    torch._dynamo.reset()
    eager_model, compiled_model = _model("delayed", site=site), _model("delayed", site=site)
    x, cos, sin = _inputs(eager_model)
    eb, cb = eager_model.layers[0], compiled_model.layers[0]
    explained = torch._dynamo.explain(_model("delayed", site=site).layers[0])(x, cos, sin)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(cb, fullgraph=True, backend="aot_eager")
    for xi in (x, x, _larger(x, site), 0.5 * x):
        assert _equal(_step(compiled, cb, xi, cos, sin), _step(eb, eb, xi, cos, sin))
        assert all(torch.equal(a, b) for a, b in zip(_histories(cb, site), _histories(eb, site)))


@pytest.mark.parametrize("site", SITES)
def test_checkpoints_carry_the_history_and_switching_the_flag_loads(site):
    trained = _model("delayed", site=site)
    x, cos, sin = _inputs(trained)
    for xi in (x, _larger(x, site)):
        _step(trained.layers[0], trained.layers[0], xi, cos, sin)
    state = {k: v.clone() for k, v in trained.state_dict().items()}  # the buffers roll on when trained goes on
    keys = [f"layers.0.{name}.amax_history" for name in SITES[site]]
    saved = [state[k].clone() for k in keys]
    resumed = _model("delayed", site=site)
    resumed.load_state_dict(state)  # strict
    assert all(s.ready for s in _scales(resumed.layers[0], site))
    assert all(torch.equal(h, w) for h, w in zip(_histories(resumed.layers[0], site), saved))
    assert _equal(_step(resumed.layers[0], resumed.layers[0], x, cos, sin),
                  _step(trained.layers[0], trained.layers[0], x, cos, sin))  # resume continues exactly
    # a checkpoint without the history (current scaling) starts delayed scaling afresh
    fresh = _model("delayed", site=site)
    fresh.load_state_dict(_model("current").state_dict())
    assert not any(s.ready for s in _scales(fresh.layers[0], site))
    assert all(h.eq(0).all() for h in _histories(fresh.layers[0], site))
    # current scaling resumes a delayed checkpoint (the history is dropped)
    _model("current").load_state_dict(state)
    # another history length keeps the most recent entries
    short = _model("delayed", history_len=2, site=site)
    short.load_state_dict(state)
    assert all(torch.equal(h, w[:2]) for h, w in zip(_histories(short.layers[0], site), saved))


@pytest.mark.parametrize("site", SITES)
def test_a_bf16_model_keeps_its_history_in_float32(site):
    model = _model("delayed", dtype=torch.bfloat16, site=site)
    x, cos, sin = _inputs(model, torch.bfloat16)
    for _ in range(2):
        _step(model.layers[0], model.layers[0], x, cos, sin)
    assert all(h.dtype == torch.float32 and h[:2].gt(0).all() for h in _histories(model.layers[0], site))
    assert all(h.dtype == torch.float32 for h in _histories(model.half().layers[0], site))


def test_history_length_is_checked():
    with pytest.raises(ValueError, match="--fp8-amax-history-len"):
        DelayedScale(0)
    with pytest.raises(ValueError, match="--fp8-grad-scaling"):
        recipe_of(mode="fp8-linear", grad_scaling="delayed")
    with pytest.raises(ValueError, match="--fp8-activation-scaling"):
        recipe_of(mode="fp8-linear", activation_scaling="delayed")


@pytest.mark.gpu
@pytest.mark.parametrize("site", SITES)
def test_gpu_delayed_block_under_cuda_graphs(site):
    """CUDA, bf16, compiled as the trainer's --enable-cuda-graph compiles a block (cudagraph trees): the history roll
    (in backward or in forward) is captured (no graph is skipped for its in-place write) and the replayed history follows the
    eager one: with eager's bf16 roundings (tests/coat/test_blocks.py's gpu test) the FP8 inputs are the same and
    the amaxes differ by fp32 reassociation only; 2^-6 leaves room for a rare flipped bf16 rounding at the max."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager_model, graph_model = (_model("delayed", dtype=torch.bfloat16, device="cuda", site=site) for _ in range(2))
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
    for he, hg in zip(_histories(eb, site), _histories(gb, site)):
        assert hg.gt(0).all() and ((hg - he).abs() / he).max().item() <= 2 ** -6


def _synced_histories():
    """On each of 2 ranks: two sites with this rank's own histories, synced once."""
    import torch.distributed as dist

    rank = dist.get_rank()
    model = torch.nn.Sequential(DelayedScale(3), DelayedScale(2))
    model[0].amax_history.copy_(torch.tensor([1.0, 5.0, 2.0] if rank == 0 else [4.0, 3.0, 0.0]))
    model[1].amax_history.copy_(torch.tensor([7.0, 0.0] if rank == 0 else [1.0, 8.0]))
    buffers = [m.amax_history for m in model]
    AmaxHistorySync(model, None, dist.get_world_size())()
    assert all(m.amax_history is b for m, b in zip(model, buffers))  # in place: CUDA graphs read these addresses
    return [m.amax_history.tolist() for m in model]


def test_data_parallel_replicas_keep_the_groups_amax_histories():
    """Entry by entry, the maximum over the replicas (each history's i-th entry is every replica's i-th most
    recent call)."""
    assert run_ranks(2, _synced_histories) == [[[4.0, 5.0, 2.0], [7.0, 8.0]]] * 2


def test_history_sync_is_a_no_op_on_one_replica_or_without_delayed_scaling():
    assert not AmaxHistorySync(_model("delayed"), None, 1).active
    assert not AmaxHistorySync(_model("current"), None, 2).active
    assert AmaxHistorySync(_model("delayed"), None, 2).active
