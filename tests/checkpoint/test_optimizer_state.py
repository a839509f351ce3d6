"""Adam state <-> layout-free fp32 moments (megacoat/checkpoint/optimizer_state.py), on real moments of a short
training run.

Bounds (from the formats and megacoat.ops.coat_adamw_ref's quantizer contract): the same groups give the same fp32 moments bit for
bit; other groups or settings cost one FP8 quantization per element, i.e. with the element's new group scale
amax / F.max and exponent k, f = F.max * (|x| / amax)^k is rounded once: relative error (1 + u)^(1/k) - 1
(u = F.eps / 2) where f is in FP8's normal range, and the width of half a subnormal step of f mapped back
through the power below it; a few float32 ulps for log2/exp2 on top (FP32_SLACK)."""
import pytest
import torch

from megacoat.checkpoint.optimizer_state import optimizer_kind, state_from_fp32, state_to_fp32
from megacoat.ops.formats import get_format
from megacoat.ops.coat_adamw_ref import dequantize_moment_ref, quantize_moment_ref
from megacoat.coat.adamw import CoatAdamW

pytestmark = pytest.mark.usefixtures("one_thread")
FP32_SLACK = 32 * 2.0 ** -24  # float32 log2/exp2 and scale arithmetic around the one FP8 rounding
HP = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def trained(opt_factory, steps=12):
    """A small MLP after `steps` optimizer steps: (parameters, optimizer)."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(24, 300), torch.nn.GELU(), torch.nn.Linear(300, 5))
    opt = opt_factory(model.parameters())
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 24, generator=g), torch.randn(64, 5, generator=g)
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return list(model.parameters()), opt


def one_quantization_bound(x: torch.Tensor, group_size: int, fmt, expand: bool) -> torch.Tensor:
    """Per-element bound on |dequantize(quantize(x)) - x| over the groups of flat x (see the module docstring)."""
    fmt = get_format(fmt)
    _, scale, k, _ = quantize_moment_ref(x, fmt.dtype, group_size, expand)
    per = lambda t: t.double().repeat_interleave(group_size)[: x.numel()]  # noqa: E731
    amax, kk, a = per(scale) * fmt.max, per(k.float()), x.double().abs()
    f = fmt.max * torch.where(amax > 0, a / amax, torch.zeros_like(a)) ** kk
    normal = (1 + fmt.unit_roundoff) ** (1 / kk) - 1
    h = fmt.min_subnormal / 2
    up = amax * ((f + h) / fmt.max) ** (1 / kk) - a
    down = a - amax * ((f - h).clamp(min=0) / fmt.max) ** (1 / kk)
    bound = torch.where(f >= fmt.smallest_normal, a * normal, torch.maximum(up, down))
    return bound + a * FP32_SLACK + 1e-45


def check_one_quantization(got: torch.Tensor, x: torch.Tensor, group_size: int, fmt, expand: bool) -> None:
    err = (got.double() - x.double()).abs()
    bound = one_quantization_bound(x, group_size, fmt, expand)
    assert (err <= bound).all(), f"worst excess {(err - bound).max():.3g} at {int((err - bound).argmax())}"


COAT = [dict(), dict(v_dtype="e5m2"), dict(expand=False), dict(group_size=32)]


@pytest.mark.parametrize("kw", COAT, ids=["default", "v-e5m2", "no-expansion", "g32"])
def test_coat_state_round_trip_is_exact_on_the_same_groups(kw):
    params, opt = trained(lambda p: CoatAdamW(p, backend="torch", **HP, **kw))
    group = opt.param_groups[0]
    for p in params:
        st = opt.state[p]
        fp32 = state_to_fp32(st, group)
        again = state_from_fp32(fp32, 12, group, p, like=st)
        assert int(again["step"]) == 12 and again["step"].device == st["step"].device
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(again[key + "_scale"], st[key + "_scale"]) and torch.equal(again[key + "_k"], st[key + "_k"])
            assert torch.equal(again[key].float(), st[key].float())  # a zero code may change sign only
        back = state_to_fp32(again, group)
        assert all(torch.equal(back[k], fp32[k]) for k in fp32)


@pytest.mark.parametrize("kw", COAT, ids=["default", "v-e5m2", "no-expansion", "g32"])
@pytest.mark.parametrize("offset", [1, 77])
def test_other_group_boundaries_cost_one_quantization(kw, offset):
    """A ZeRO partition or TP shard that starts `offset` elements into the old groups regroups every moment."""
    params, opt = trained(lambda p: CoatAdamW(p, backend="torch", **HP, **kw))
    group = opt.param_groups[0]
    fp32 = state_to_fp32(opt.state[params[0]], group)
    for key, fmt in (("exp_avg", group["m_dtype"]), ("exp_avg_sq", group["v_dtype"])):
        x = fp32[key][offset:]
        q, s, k, _ = quantize_moment_ref(x, get_format(fmt).dtype, group["group_size"], group["expand"])
        got = dequantize_moment_ref(q, s, k, group["group_size"])
        check_one_quantization(got, x, group["group_size"], fmt, group["expand"])
        assert not torch.equal(got, x)  # the regrouping did change something: the bound is what holds


def test_adamw_to_coat_to_adamw_keeps_the_step_and_costs_one_quantization():
    params, adamw = trained(lambda p: torch.optim.AdamW(p, **HP))
    coat = CoatAdamW(params, backend="torch", **HP)
    assert optimizer_kind(adamw.param_groups[0]) == "adamw" and optimizer_kind(coat.param_groups[0]) == "coat"
    for p in params:
        fp32 = state_to_fp32(adamw.state[p], adamw.param_groups[0])
        assert torch.equal(fp32["exp_avg"], adamw.state[p]["exp_avg"].reshape(-1))  # AdamW's own fp32, as is
        as_coat = state_from_fp32(fp32, 12, coat.param_groups[0], p, source_kind="adamw")
        assert as_coat["exp_avg"].dtype == torch.float8_e4m3fn and int(as_coat["step"]) == 12
        back = state_from_fp32(state_to_fp32(as_coat, coat.param_groups[0]), 12, adamw.param_groups[0], p,
                               like=adamw.state[p], source_kind="coat")
        assert back["exp_avg"].shape == p.shape and back["step"].dtype == adamw.state[p]["step"].dtype
        for key in ("exp_avg", "exp_avg_sq"):
            check_one_quantization(back[key].reshape(-1), fp32[key], 128, "e4m3", True)


def test_coat_to_adamw_to_coat_is_exact():
    """AdamW holds the dequantized moments exactly (fp32): coming back lands on the same groups' codes."""
    params, coat = trained(lambda p: CoatAdamW(p, backend="torch", **HP))
    adamw = torch.optim.AdamW(params, **HP)
    for p in params:
        fp32 = state_to_fp32(coat.state[p], coat.param_groups[0])
        as_adamw = state_from_fp32(fp32, 12, adamw.param_groups[0], p, source_kind="coat")
        again = state_from_fp32(state_to_fp32(as_adamw, adamw.param_groups[0]), 12, coat.param_groups[0], p)
        assert all(torch.equal(again[k].float(), coat.state[p][k].float()) for k in coat.state[p] if k != "step")


def test_adamw_resumes_as_coat_with_live_state():
    """Converted state is the state CoatAdamW steps from: its next step equals AdamW's step from the same
    (dequantized) moments, up to float32 rounding of the update; with moments lost (zeros) it would not."""
    params, adamw = trained(lambda p: torch.optim.AdamW(p, **HP))
    before = [p.detach().clone() for p in params]
    grads = [torch.randn_like(p) for p in params]
    coat = CoatAdamW(params, backend="torch", **HP)
    reference = torch.optim.AdamW(params, **HP)
    for p, g in zip(params, grads):
        coat.state[p] = state_from_fp32(state_to_fp32(adamw.state[p], adamw.param_groups[0]), 12,
                                        coat.param_groups[0], p, source_kind="adamw")
        reference.state[p] = state_from_fp32(state_to_fp32(coat.state[p], coat.param_groups[0]), 12,
                                             reference.param_groups[0], p, like=adamw.state[p], source_kind="coat")
        p.grad = g.clone()
    coat.step()
    after_coat = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, b, g in zip(params, before, grads):
            p.copy_(b)
            p.grad = g.clone()
    reference.step()
    for p, b, c in zip(params, before, after_coat):
        torch.testing.assert_close(c - b, p.detach() - b, rtol=1e-4, atol=1e-9)


def test_state_that_does_not_fit_the_parameter_is_refused():
    p = torch.nn.Parameter(torch.zeros(10))
    group = CoatAdamW([p]).param_groups[0]
    with pytest.raises(ValueError, match="9 elements for a parameter of 10"):
        state_from_fp32({"exp_avg": torch.zeros(9), "exp_avg_sq": torch.zeros(9)}, 1, group, p)
