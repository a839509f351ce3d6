"""CoatAdamW as a torch optimizer: AdamW semantics, state size, exact resume, config checks (CPU, torch backend)."""
import copy
import io

import pytest
import torch

from megacoat.coat.adamw import CoatAdamW

HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def mlp(seed=1):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 200), torch.nn.GELU(), torch.nn.Linear(200, 4))


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 32, generator=g)
    y = x[:, :4] * 2 + 0.1 * torch.randn(256, 4, generator=g)
    return x, y


def train(model, opt, steps, x, y):
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return loss.item()


def test_first_step_matches_adamw():
    """Step 1 of AdamW moves each weight by about lr * sign(g): FP8 moments change that by at most a few u = 2^-4."""
    x, y = data()
    a, b = mlp(), mlp()
    for m, opt in ((a, torch.optim.AdamW(a.parameters(), **HP)), (b, CoatAdamW(b.parameters(), **HP))):
        train(m, opt, 1, x, y)
    ref = mlp()
    for pa, pb, p0 in zip(a.parameters(), b.parameters(), ref.parameters()):
        da, db = pa - p0, pb - p0
        assert ((db - da).abs() <= 0.15 * da.abs() + 1e-7).all()


@pytest.mark.parametrize("kw", [dict(), dict(v_dtype="e5m2"), dict(expand=False), dict(group_size=32)])
def test_tracks_adamw_loss(kw):
    x, y = data()
    a, b = mlp(), mlp()
    la = train(a, torch.optim.AdamW(a.parameters(), **HP), 150, x, y)
    lb = train(b, CoatAdamW(b.parameters(), **HP, **kw), 150, x, y)
    start = torch.nn.functional.mse_loss(mlp()(x), y).item()
    assert lb < 0.1 * start  # it trains
    assert abs(lb - la) <= 0.15 * la + 1e-3, (la, lb)


def test_state_is_fp8_and_at_most_2_1_bytes_per_param():
    p = torch.nn.Parameter(torch.randn(1000, 1280))
    opt = CoatAdamW([p], **HP)
    p.grad = torch.randn_like(p)
    opt.step()
    st = opt.state[p]
    assert st["exp_avg"].dtype == torch.float8_e4m3fn and st["exp_avg_sq"].dtype == torch.float8_e4m3fn
    assert st["exp_avg_scale"].dtype == torch.float32 and st["exp_avg_k"].dtype == torch.bfloat16
    assert opt.state_bytes() / p.numel() == pytest.approx(2 + 12 / 128)
    assert opt.state_bytes() / p.numel() <= 2.1


def test_exact_resume_bitwise():
    x, y = data()
    a = mlp()
    oa = CoatAdamW(a.parameters(), **HP)
    train(a, oa, 4, x, y)
    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "optim": oa.state_dict()}, buf)
    train(a, oa, 5, x, y)

    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    b = mlp(seed=7)
    b.load_state_dict(ck["model"])
    ob = CoatAdamW(b.parameters(), **HP)
    ob.load_state_dict(ck["optim"])
    for st in ob.state.values():
        assert st["exp_avg"].dtype == torch.float8_e4m3fn and st["exp_avg_k"].dtype == torch.bfloat16
    train(b, ob, 5, x, y)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    for sa, sb in zip(oa.state.values(), ob.state.values()):
        for k in sa:
            assert torch.equal(sa[k].view(torch.uint8) if sa[k].dtype.itemsize == 1 else sa[k],
                               sb[k].view(torch.uint8) if sb[k].dtype.itemsize == 1 else sb[k])


@pytest.mark.parametrize("change", [dict(m_dtype="e5m2"), dict(v_dtype="e5m2"), dict(group_size=64),
                                    dict(expand=False)])
def test_loading_a_different_config_is_a_clear_error(change):
    x, y = data()
    a = mlp()
    oa = CoatAdamW(a.parameters(), **HP)
    train(a, oa, 2, x, y)
    sd = copy.deepcopy(oa.state_dict())
    ob = CoatAdamW(mlp().parameters(), **HP, **change)
    key = next(iter(change))
    with pytest.raises(ValueError, match=f"{key}="):
        ob.load_state_dict(sd)


def test_loading_torch_adamw_state_is_a_clear_error():
    x, y = data()
    a = mlp()
    oa = torch.optim.AdamW(a.parameters(), **HP)
    train(a, oa, 1, x, y)
    with pytest.raises(ValueError, match="not CoatAdamW"):
        CoatAdamW(mlp().parameters(), **HP).load_state_dict(oa.state_dict())


def test_bad_arguments():
    p = [torch.nn.Parameter(torch.randn(4))]
    with pytest.raises(ValueError, match="group size"):
        CoatAdamW(p, group_size=100)
    with pytest.raises(ValueError, match="unknown FP8 format"):
        CoatAdamW(p, m_dtype="e3m4")
    with pytest.raises(ValueError, match="backend"):
        CoatAdamW(p, backend="fast")
    h = torch.nn.Parameter(torch.randn(4, dtype=torch.float16))
    h.grad = torch.randn(4, dtype=torch.float16)
    with pytest.raises(TypeError, match="float16"):
        CoatAdamW([h]).step()


def test_bf16_params_and_missing_grads():
    p = torch.nn.Parameter(torch.randn(300, dtype=torch.bfloat16))
    q = torch.nn.Parameter(torch.randn(10))
    opt = CoatAdamW([p, q], **HP)
    p.grad = torch.randn_like(p)
    before = q.detach().clone()
    opt.step()
    assert torch.equal(q, before) and q not in opt.state
    assert p.dtype == torch.bfloat16 and torch.isfinite(p).all()


def test_nonfinite_gradient_is_reported():
    p = torch.nn.Parameter(torch.randn(512))
    opt = CoatAdamW([p], **HP, group_size=128)
    p.grad = torch.randn(512)
    p.grad[130] = float("nan")
    opt.step()
    assert opt.nonfinite_groups() == 2 and opt.nonfinite_groups() == 0
    assert torch.isnan(opt.state[p]["exp_avg_scale"][1])


# ------------------------------------------------ bf16 parameters with fp32-master remainders (param_remainders)

def _bf16_mlp(seed=1):
    return mlp(seed).to(torch.bfloat16)


def test_remainders_train_bit_for_bit_like_an_fp32_master():
    """A bf16 model trained with CoatAdamW(param_remainders=True) against the mixed-precision layout it replaces: an
    fp32 master copy updated by CoatAdamW from the bf16 gradients, then rounded into the bf16 model (with the same
    nearest-ties-away rounding the remainder format defines). Same losses, same master, same bf16 weights, bit for bit."""
    from megacoat.ops.param_remainder import join_fp32, split_fp32

    x, y = data()
    a = _bf16_mlp()
    oa = CoatAdamW(a.parameters(), **HP, param_remainders=True)
    b = _bf16_mlp()
    master = [torch.nn.Parameter(p.detach().float()) for p in b.parameters()]
    ob = CoatAdamW(master, **HP)
    for step in range(12):
        losses = []
        for model in (a, b):
            loss = torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y)
            model.zero_grad(set_to_none=True)
            loss.backward()
            losses.append(loss.item())
        assert losses[0] == losses[1], (step, losses)
        for mp, p in zip(master, b.parameters()):
            mp.grad = p.grad.float()
        oa.step()
        ob.step()
        with torch.no_grad():
            for mp, p in zip(master, b.parameters()):
                p.copy_(split_fp32(mp.detach())[0])
        for pa, mp in zip(a.parameters(), master):
            assert torch.equal(join_fp32(pa.detach(), oa.state[pa]["remainder"]).view(torch.int32),
                               mp.detach().view(torch.int32))
    assert losses[0] < 0.5 * torch.nn.functional.mse_loss(_bf16_mlp()(x.bfloat16()).float(), y).item()


def test_remainder_state_is_at_most_4_1_bytes_per_param():
    p = torch.nn.Parameter(torch.randn(1000, 1280, dtype=torch.bfloat16))
    opt = CoatAdamW([p], **HP, param_remainders=True)
    p.grad = torch.randn_like(p)
    opt.step()
    assert opt.state[p]["remainder"].dtype == torch.int16
    assert opt.state_bytes() / p.numel() == pytest.approx(2 + 2 + 12 / 128)
    assert opt.state_bytes() / p.numel() <= 4.1


def test_remainder_resume_bitwise_and_other_master_layout_is_a_clear_error():
    x, y = data()
    a = _bf16_mlp()
    oa = CoatAdamW(a.parameters(), **HP, param_remainders=True)
    xb = x.bfloat16()
    train(a, oa, 3, xb, y.bfloat16())
    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "optim": oa.state_dict()}, buf)
    train(a, oa, 4, xb, y.bfloat16())
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    b = _bf16_mlp(seed=7)
    b.load_state_dict(ck["model"])
    ob = CoatAdamW(b.parameters(), **HP, param_remainders=True)
    ob.load_state_dict(ck["optim"])
    train(b, ob, 4, xb, y.bfloat16())
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb) and torch.equal(oa.state[pa]["remainder"], ob.state[pb]["remainder"])
    with pytest.raises(ValueError, match="--main-params-dtype bf16-remainder .* but this run has --main-params-dtype fp32"):
        CoatAdamW(_bf16_mlp().parameters(), **HP).load_state_dict(ck["optim"])


def test_remainders_need_bf16_parameters():
    p = torch.nn.Parameter(torch.randn(10))
    p.grad = torch.randn(10)
    with pytest.raises(TypeError, match="bfloat16"):
        CoatAdamW([p], param_remainders=True).step()
