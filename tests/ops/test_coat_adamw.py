"""The fused CoatAdamW step: the torch reference against the contract and float64 AdamW, the CUDA kernel against the
reference (GPU).

Tolerances, from the formats: E4M3 unit roundoff u = 2^-4 (E5M2 2^-3). A moment mapped to a normal FP8 value
round-trips with relative error <= (1+u)^(1/k) - 1 (~u/k) plus float32 log2/exp2 error; one mapped into the
sub-normal range has absolute error <= F.min_subnormal/2 in f = (|x|/amax)^k space.

The kernel's quantizer contract (test_gpu_quantizer_contract): from the same float32 moments, k and scale are
bit-exact (both sides form them with the same IEEE float32 operations, once per group: log2f, divisions, bf16
rounding), and every FP8 code equals the reference's or is its neighbour, the latter only where the exact value
lies within DELTA (relative) of the rounding midpoint between the two. DELTA follows from the kernel's hardware
approximations in f = exp2(k * log2(r)), r = |x| / amax: lg2.approx has absolute error <= 2^-22 * max(1, |log2 r|),
times k <= K_MAX = 64 that is <= 2^-16 in the exponent; the rounding of k * log2(r) adds 2^-24 * k|log2 r| <=
2^-24 * 32.1 (k|log2 r| <= log2(R_F) (1 + 2^-8) for every r >= amin / amax); ex2.approx adds 2^-21 relative; the
reference's own log2f/exp2f add < 2^-18. Together ln2 * (2^-16 + 2^-19) + 2^-21 + 2^-18 < 2^-15.5: DELTA = 2^-15.
With plain scaling (k = 1) no approximation is involved: codes are bit-exact.
"""
import pytest
import torch

from megacoat.ops.formats import get_format
from megacoat.ops.coat_adamw import coat_adamw_step, resolve_backend
from megacoat.ops.coat_adamw_ref import adam_scalars, coat_adamw_step_ref, dequantize_moment_ref, quantize_moment_ref
from megacoat.ops.numerics import AMAX_FLOOR, K_MAX, K_MIN, num_groups

HP = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def wide_range(n, lo=-6.0, hi=1.0, device="cpu"):
    """Random signs and magnitudes spread over 10^lo..10^hi: the ranges Adam moments really have."""
    return torch.randn(n, device=device) * 10 ** torch.empty(n, device=device).uniform_(lo, hi)


def make_state(sizes, group_size, m_fmt="e4m3", v_fmt="e4m3", device="cpu", p_dtype=torch.float32,
               g_dtype=torch.float32, warm=True, expand=True):
    """Params, grads and a non-trivial FP8 state (quantized from wide-range moments, or zeros)."""
    params = [torch.randn(n, device=device).to(p_dtype) for n in sizes]
    grads = [wide_range(n, device=device).to(g_dtype) for n in sizes]
    state = [[] for _ in range(6)]
    for n in sizes:
        ng = num_groups(n, group_size)
        for j, fmt in enumerate((m_fmt, v_fmt)):
            x = wide_range(n, device=device)
            if j == 1:
                x = x.abs() * 1e-3
            if warm:
                q, s, k, _ = quantize_moment_ref(x, get_format(fmt).dtype, group_size, expand)
            else:
                q = torch.zeros(n, dtype=get_format(fmt).dtype, device=device)
                s = torch.zeros(ng, device=device)
                k = torch.ones(ng, dtype=torch.bfloat16, device=device)
            state[3 * j].append(q)
            state[3 * j + 1].append(s)
            state[3 * j + 2].append(k)
    return params, grads, state


def clone_all(params, state):
    return [p.clone() for p in params], [[t.clone() for t in col] for col in state]


def fp8_steps_apart(a, b):
    """How many representable FP8 values lie between a and b (same dtype), elementwise."""
    ia = a.view(torch.uint8).to(torch.int32)
    ib = b.view(torch.uint8).to(torch.int32)
    # sign-magnitude to a monotone integer line
    ia = torch.where(ia >= 128, 128 - ia, ia)
    ib = torch.where(ib >= 128, 128 - ib, ib)
    return (ia - ib).abs()


def assert_state_close(state_a, state_b):
    """After a full step: the kernel's moments differ from the reference's by its dequantization approximations
    (~1e-5 relative, see update_error_bounds), far below one FP8 step, so codes agree within one step; scales and
    exponents, formed once per group from moments that agree to float32 rounding at the group's largest element
    (|q| = F.max dequantizes exactly), agree to float32 rounding (k: within one bf16 step at a rounding tie)."""
    for col in (0, 3):  # codes
        for a, b in zip(state_a[col], state_b[col]):
            if a.numel() == 0:
                continue
            steps = fp8_steps_apart(a, b)
            assert int(steps.max()) <= 1, f"FP8 codes differ by {int(steps.max())} steps"
    for col in (1, 4):  # scales
        for a, b in zip(state_a[col], state_b[col]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=0, equal_nan=True)
    for col in (2, 5):  # exponents: equal, or one bf16 step apart at a rounding tie
        for a, b in zip(state_a[col], state_b[col]):
            torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=0)


def run_backend(backend, params, grads, state, **kw):
    """backend: "torch" (the reference) or "cuda" (the kernel)."""
    nf = torch.zeros(1, dtype=torch.int32, device=params[0].device)
    coat_adamw_step(params, grads, *state, nonfinite=nf, backend=backend, **{**HP, **kw})
    return nf


# ---------------------------------------------------------------- the reference against the contract

def assert_roundtrip_bound(x, q, scale, k, G):
    """The contract's bound for every element: normal-mapped relative error <= (1+u)^(1/k) - 1 (+ 1e-5 for
    float32 log2/exp2 and x's own float32 rounding); subnormal-mapped absolute f-space error <= min_subnormal/2."""
    F = get_format(q.dtype)
    x = x.double()
    xh = dequantize_moment_ref(q, scale, k, G).double()
    kf = k.double().repeat_interleave(G)[: x.numel()]
    amax = (scale.double() * F.max).repeat_interleave(G)[: x.numel()]
    f = (x.abs() / amax) ** kf  # the element's place in f-space
    normal = f * F.max >= F.smallest_normal
    rel = (xh - x).abs() / x.abs()
    bound = (1 + F.unit_roundoff) ** (1 / kf) - 1 + 1e-5
    assert (rel[normal] <= bound[normal]).all(), float((rel - bound)[normal].max())
    fh = (xh.abs() / amax) ** kf
    sub = ~normal & (x != 0)
    assert ((fh - f).abs()[sub] * F.max <= F.min_subnormal / 2 * (1 + 1e-3) + 1e-12).all()
    return xh


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("expand", [True, False])
def test_reference_roundtrip_error_bound(fmt, expand):
    F = get_format(fmt)
    G = 128
    x = wide_range(50 * G + 37, lo=-8, hi=2)
    q, scale, k, bad = quantize_moment_ref(x, F.dtype, G, expand)
    assert bad == 0 and q.dtype == F.dtype and scale.dtype == torch.float32 and k.dtype == torch.bfloat16
    assert_roundtrip_bound(x, q, scale, k, G)
    if expand:
        assert ((k.float() >= K_MIN) & (k.float() <= K_MAX)).all() and (k.float() != 1).all()
    else:
        assert (k.float() == 1).all()


def test_expansion_reduces_error():
    """The point of expansion (E4M3, groups spanning 10^5): plain per-group scaling flushes the smallest moments
    to zero (relative error 1), expansion keeps every element and lowers the mean error."""
    x = wide_range(200 * 128, lo=-5, hi=0)
    err = {}
    for expand in (True, False):
        q, s, k, _ = quantize_moment_ref(x, torch.float8_e4m3fn, 128, expand)
        err[expand] = (dequantize_moment_ref(q, s, k, 128) - x).abs() / x.abs()
    assert err[False].max() == 1.0 and err[True].max() < 0.5
    assert err[True].mean() < 0.75 * err[False].mean()


def test_reference_step_is_adamw_on_the_dequantized_state():
    """p follows AdamW (float64) from the moments the state holds; the new state holds the new moments."""
    G = 128
    params, grads, state = make_state([1000, 3 * G], G)
    p0 = [p.double() for p in params]
    m0 = [dequantize_moment_ref(q, s, k, G).double() for q, s, k in zip(*state[:3])]
    v0 = [dequantize_moment_ref(q, s, k, G).double() for q, s, k in zip(*state[3:])]
    step = 7
    coat_adamw_step_ref(params, grads, *state, step=step, group_size=G, expand=True, **HP)
    step_size, bc2_sqrt = adam_scalars(HP["lr"], HP["beta1"], HP["beta2"], step)
    for i, p in enumerate(params):
        g = grads[i].double()
        m = HP["beta1"] * m0[i] + (1 - HP["beta1"]) * g
        v = HP["beta2"] * v0[i] + (1 - HP["beta2"]) * g * g
        want = p0[i] * (1 - HP["lr"] * HP["weight_decay"]) - step_size * m / (v.sqrt() / bc2_sqrt + HP["eps"])
        torch.testing.assert_close(p.double(), want, rtol=1e-5, atol=1e-6)  # float32 arithmetic
        for x, (q, s, k) in ((m, (state[0][i], state[1][i], state[2][i])), (v, (state[3][i], state[4][i], state[5][i]))):
            assert_roundtrip_bound(x, q, s, k, G)


def test_reference_nonfinite_group_is_visible_and_contained():
    G = 64
    params, grads, state = make_state([5 * G + 3], G)
    grads[0][2 * G + 5] = float("nan")
    grads[0][4 * G] = float("inf")
    nf = run_backend("torch", params, grads, state, step=3, group_size=G, expand=True)
    assert int(nf) == 4  # groups 2 and 4, m and v each
    for col in (1, 4):
        s = state[col][0]
        assert torch.isnan(s[[2, 4]]).all() and torch.isfinite(s[[0, 1, 3, 5]]).all()
    m = dequantize_moment_ref(state[0][0], state[1][0], state[2][0], G)
    assert torch.isnan(m[2 * G: 3 * G]).all() and torch.isfinite(m[: 2 * G]).all()


def test_reference_checks_its_inputs():
    params, grads, state = make_state([100], 128)
    with pytest.raises(ValueError, match="group size"):
        coat_adamw_step_ref(params, grads, *state, step=1, group_size=100, expand=True, **HP)
    bad = [list(c) for c in state]
    bad[1] = [torch.zeros(5)]
    with pytest.raises(ValueError, match="m_scale must have 1 entries"):
        coat_adamw_step_ref(params, grads, *bad, step=1, group_size=128, expand=True, **HP)
    with pytest.raises(ValueError, match="step must be >= 1"):
        coat_adamw_step_ref(params, grads, *state, step=0, group_size=128, expand=True, **HP)


# ---------------------------------------------------------------- backend choice

def test_auto_is_the_reference_on_cpu_and_cuda_needs_cuda_tensors():
    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        resolve_backend("cuda", torch.device("cpu"))
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("triton", torch.device("cpu"))


def test_auto_on_a_gpu_without_the_extension_stops_with_the_reason(monkeypatch):
    """No silent fallback to the (slow) reference: the error names the build failure and the way out."""
    import megacoat.ops.coat_adamw as ops

    def no_build(verbose=False):
        raise FileNotFoundError("nvcc not found")

    monkeypatch.setattr(ops, "load_extension", no_build)
    with pytest.raises(RuntimeError,
                       match=r"could not be built \(FileNotFoundError: nvcc not found\).*backend='torch'"):
        resolve_backend("auto", torch.device("cuda"))
    assert resolve_backend("torch", torch.device("cuda")) == "torch"


# ---------------------------------------------------------------- GPU: the CUDA kernel against the reference

def update_error_bounds(params, grads, state, G, step, p_dtype):
    """Per-element bound on |p_kernel - p_ref|. The kernels' ex2/lg2 approximations (relative error <= 2^-22,
    absolute <= 2^-22 on log2, times 1/k <= 1/K_MIN = 16: ~3e-6) perturb each dequantized moment by < 1e-5
    relatively; m = b1*m_prev + (1-b1)*g can cancel, so the bound is taken on the terms' magnitudes, not on m:
    step_size * 2e-5 * (|b1 m_prev| + |(1-b1) g|) / denom, plus float32 rounding of p (and one bf16 ulp, 2^-7
    relative, for bf16 parameters)."""
    step_size, bc2_sqrt = adam_scalars(HP["lr"], HP["beta1"], HP["beta2"], step)
    out = []
    for i, p in enumerate(params):
        g = grads[i].float()
        m0 = dequantize_moment_ref(state[0][i], state[1][i], state[2][i], G)
        v0 = dequantize_moment_ref(state[3][i], state[4][i], state[5][i], G)
        v = HP["beta2"] * v0 + (1 - HP["beta2"]) * g * g
        denom = v.sqrt() / bc2_sqrt + HP["eps"]
        terms = step_size * ((HP["beta1"] * m0).abs() + ((1 - HP["beta1"]) * g).abs()) / denom
        out.append(2e-5 * terms + 1e-6 * p.float().abs() + 1e-7)
    return out


GPU_CASES = [
    dict(G=128, m="e4m3", v="e4m3", expand=True, p=torch.float32, g=torch.float32),
    dict(G=128, m="e4m3", v="e5m2", expand=True, p=torch.float32, g=torch.bfloat16),
    dict(G=16, m="e4m3", v="e4m3", expand=True, p=torch.bfloat16, g=torch.bfloat16),
    dict(G=64, m="e5m2", v="e5m2", expand=True, p=torch.float32, g=torch.float32),
    dict(G=256, m="e4m3", v="e4m3", expand=True, p=torch.float32, g=torch.float32),
    dict(G=128, m="e4m3", v="e4m3", expand=False, p=torch.float32, g=torch.float32),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"G{c['G']}-{c['m']}-{c['v']}-x{int(c['expand'])}-"
                                                         f"{str(c['p'])[6:]}-{str(c['g'])[6:]}")
def test_gpu_kernel_matches_reference(case):
    G = case["G"]
    torch.manual_seed(1)
    sizes = [1 << 20, 5 * 4096 + 3, 999, 7]
    params, grads, state = make_state(sizes, G, case["m"], case["v"], device="cuda", p_dtype=case["p"],
                                      g_dtype=case["g"], expand=case["expand"])
    p2, s2 = clone_all(params, state)
    kw = dict(step=11, group_size=G, expand=case["expand"])
    bounds = update_error_bounds(params, grads, state, G, kw["step"], case["p"])
    run_backend("torch", params, grads, state, **kw)
    nf = run_backend("cuda", p2, grads, s2, **kw)
    torch.cuda.synchronize()
    assert int(nf) == 0
    for a, b, bound in zip(params, p2, bounds):
        err = (b.float() - a.float()).abs()
        if case["p"] == torch.bfloat16:
            bound = bound + 2 ** -7 * a.float().abs()  # one bf16 rounding flip
        assert (err <= bound).all(), float((err - bound).max())
    assert_state_close(s2, state)


@pytest.mark.gpu
def test_gpu_kernel_first_step_and_nonfinite():
    G = 128
    params, grads, state = make_state([10 * G + 1], G, device="cuda", warm=False)
    grads[0][3 * G + 2] = float("inf")
    p2, s2 = clone_all(params, state)
    run_backend("torch", params, grads, state, step=1, group_size=G, expand=True)
    nf = run_backend("cuda", p2, grads, s2, step=1, group_size=G, expand=True)
    assert int(nf) == 2
    assert torch.isnan(s2[1][0][3]) and torch.isnan(s2[4][0][3])
    ok = torch.ones(11, dtype=torch.bool, device="cuda")
    ok[3] = False
    torch.testing.assert_close(s2[1][0][ok], state[1][0][ok], rtol=1e-6, atol=0)


@pytest.mark.gpu
def test_gpu_unaligned_views():
    """Views at odd offsets: the kernel takes its scalar path."""
    G = 128
    n = 3 * 4096 + 1000  # whole chunks and a tail
    base_p = torch.randn(n + 8, device="cuda")
    base_g = wide_range(n + 8, device="cuda")
    base_p2 = base_p.clone()
    params, p2, grads = [base_p[3:3 + n]], [base_p2[3:3 + n]], [base_g[1:1 + n]]
    _, _, state = make_state([n], G, device="cuda")
    _, s2 = clone_all([], state)
    bounds = update_error_bounds(params, grads, state, G, 2, torch.float32)
    run_backend("torch", params, grads, state, step=2, group_size=G, expand=True)
    run_backend("cuda", p2, grads, s2, step=2, group_size=G, expand=True)
    assert ((p2[0] - params[0]).abs() <= bounds[0]).all()
    assert_state_close(s2, state)


def many_sizes(seed=0):
    """Sizes whose chunks outnumber the resident blocks several times over (each block strides over chunks of many
    tensors), with an empty tensor, one-element tensors and ragged tails among them."""
    g = torch.Generator().manual_seed(seed)
    sizes = [int(x) for x in torch.randint(1, 400_000, (40,), generator=g)]
    return sizes[:10] + [0, 1] + sizes[10:20] + [4096, 1] + sizes[20:]


@pytest.mark.gpu
def test_gpu_chunk_runs_cross_tensors():
    G = 128
    torch.manual_seed(2)
    sizes = many_sizes()
    n_chunks = sum(-(-n // 4096) for n in sizes)
    assert n_chunks > 4 * torch.cuda.get_device_properties(0).multi_processor_count  # more than one chunk a block
    params, grads, state = make_state(sizes, G, device="cuda")
    p2, s2 = clone_all(params, state)
    bounds = update_error_bounds(params, grads, state, G, 4, torch.float32)
    run_backend("torch", params, grads, state, step=4, group_size=G, expand=True)
    nf = run_backend("cuda", p2, grads, s2, step=4, group_size=G, expand=True)
    assert int(nf) == 0
    for a, b, bound in zip(params, p2, bounds):
        assert ((b - a).abs() <= bound).all()
    assert_state_close(s2, state)


# ---------------------------------------------------------------- the quantizer contract (GPU)

DELTA = 2.0 ** -15  # see the module docstring


def _fp8_neighbours_midpoint(a, b):
    """Midpoint of two FP8 code tensors' magnitudes (same dtype), float64."""
    return (a.double().abs() + b.double().abs()) / 2


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("G", [16, 128, 256])
def test_gpu_quantizer_contract(fmt, G):
    """beta1 = beta2 = 0: the new moments are g and g*g on both sides, bit for bit (0 * m + 1 * g is exact), so the
    kernel's quantizer is compared with the reference's on the same float32 input: k and scale bit-exact, codes
    equal or, within DELTA of a rounding midpoint, neighbours."""
    torch.manual_seed(3)
    sizes = [1 << 20, 3 * 4096 + 77]
    params, grads, state = make_state(sizes, G, fmt, fmt, device="cuda")
    p2, s2 = clone_all(params, state)
    kw = dict(step=3, group_size=G, expand=True, beta1=0.0, beta2=0.0)
    run_backend("torch", params, grads, state, **kw)
    run_backend("cuda", p2, grads, s2, **kw)
    F = get_format(fmt)
    for i, g in enumerate(grads):
        for col, x in ((0, g.float()), (3, g.float() * g.float())):
            q_ref, q_ker, scale, k = state[col][i], s2[col][i], state[col + 1][i], state[col + 2][i]
            assert torch.equal(s2[col + 1][i], scale) and torch.equal(s2[col + 2][i], k)
            steps = fp8_steps_apart(q_ker, q_ref)
            assert int(steps.max()) <= 1, f"FP8 codes differ by {int(steps.max())} steps"
            diff = steps > 0
            # the exact value both sides round: F.max * r^k, r = |x| * fp32(1 / max(amax, floor)) as both form it
            n = x.numel()
            amax = torch.nn.functional.pad(x.abs(), (0, num_groups(n, G) * G - n)).view(-1, G).amax(1)
            inv = torch.ones_like(amax) / amax.clamp(min=AMAX_FLOOR)
            r = x.abs() * inv.repeat_interleave(G)[:n]
            kk = k.double().repeat_interleave(G)[:n]
            y = F.max * r.double()[diff] ** kk[diff]
            mid = _fp8_neighbours_midpoint(q_ker[diff], q_ref[diff])
            near = (y - mid).abs() <= DELTA * y
            assert bool(near.all()), f"{int((~near).sum())} codes differ away from a rounding midpoint"


@pytest.mark.gpu
def test_gpu_plain_scaling_is_bit_exact():
    """k = 1 (expand=False) runs no approximation in the quantizer: bit-exact codes, scales and k."""
    G = 128
    params, grads, state = make_state([1 << 20, 999], G, device="cuda", expand=False)
    p2, s2 = clone_all(params, state)
    kw = dict(step=5, group_size=G, expand=False, beta1=0.0, beta2=0.0)
    run_backend("torch", params, grads, state, **kw)
    run_backend("cuda", p2, grads, s2, **kw)
    for col in range(6):
        for a, b in zip(state[col], s2[col]):
            assert torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                               b.view(torch.uint8) if b.dtype.itemsize == 1 else b)


# ---------------------------------------------------------------- moments below the amax floor

def _tiny_moment_case(device):
    """Group 1 of m (zeros among its values, gradients zero) decays below 2^-126 in one step (beta1 = 1e-3):
    what an embedding row of an unseen token does over a few hundred steps with beta1 = 0.9."""
    G = 64
    params, grads, state = make_state([4 * G], G, device=device)
    m = wide_range(4 * G, device=device)
    m[G: 2 * G] = 1e-37
    m[G: G + 8] = 0.0
    q, s, k, _ = quantize_moment_ref(m, torch.float8_e4m3fn, G, True)
    state[0][0], state[1][0], state[2][0] = q, s, k
    grads[0][G: 2 * G] = 0.0
    return G, params, grads, state


def _check_tiny_group(G, params, state, nf):
    """Scaled from the floor (scale = 2^-126 / F.max), not expanded, values kept: without the floor 1/amax
    overflows (the group's zeros became NaN codes and its other values F.max)."""
    assert int(nf) == 0  # a tiny group is not a non-finite one
    fmax = torch.finfo(torch.float8_e4m3fn).max
    floor_scale = torch.tensor(AMAX_FLOOR) / torch.tensor(fmax)
    assert state[1][0][1].cpu() == floor_scale and state[2][0][1] == 1
    m = dequantize_moment_ref(state[0][0], state[1][0], state[2][0], G)[G: 2 * G]
    assert (m[8:] != 0).all() and (m[:8] == 0).all() and (m.abs() < AMAX_FLOOR).all()
    assert torch.isfinite(state[1][0]).all() and torch.isfinite(params[0]).all()


def test_moment_group_below_the_amax_floor():
    G, params, grads, state = _tiny_moment_case("cpu")
    nf = run_backend("torch", params, grads, state, step=7, group_size=G, expand=True, beta1=1e-3)
    _check_tiny_group(G, params, state, nf)


@pytest.mark.gpu
def test_gpu_moment_group_below_the_amax_floor():
    G, params, grads, state = _tiny_moment_case("cuda")
    p2, s2 = clone_all(params, state)
    run_backend("torch", params, grads, state, step=7, group_size=G, expand=True, beta1=1e-3)
    nf = run_backend("cuda", p2, grads, s2, step=7, group_size=G, expand=True, beta1=1e-3)
    _check_tiny_group(G, p2, s2, nf)
    assert torch.equal(s2[0][0][G: 2 * G].view(torch.uint8), state[0][0][G: 2 * G].view(torch.uint8))


# ---------------------------------------------------------------- a step refused on a device flag (found_inf)

def _check_skip_flag(device, backend):
    """skip = 1 writes nothing (parameters, codes, scales, exponents, remainders); skip = 0 is the plain step."""
    G = 128
    sizes = [3 * G + 5, 2 * G]
    params, grads, state = make_state(sizes, G, device=device, p_dtype=torch.bfloat16)
    rems = [torch.randint(-2 ** 15, 2 ** 15, (n,), dtype=torch.int16, device=device) for n in sizes]
    before_p, before_s = clone_all(params, state)
    before_r = [r.clone() for r in rems]
    kw = dict(step=5, group_size=G, expand=True, remainders=rems)
    run_backend(backend, params, grads, state, skip=torch.ones(1, device=device), **kw)
    for a, b in zip(params + rems + [t for col in state for t in col], before_p + before_r +
                    [t for col in before_s for t in col]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    plain_p, plain_s = clone_all(params, state)
    plain_r = [r.clone() for r in rems]
    run_backend(backend, params, grads, state, skip=torch.zeros(1, device=device), **kw)
    run_backend(backend, plain_p, grads, plain_s, **{**kw, "remainders": plain_r})
    for a, b in zip(params + rems + [t for col in state for t in col], plain_p + plain_r +
                    [t for col in plain_s for t in col]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert not all(torch.equal(a, b) for a, b in zip(params, before_p))  # the unskipped step did move


def test_reference_skip_flag_refuses_the_whole_step():
    _check_skip_flag("cpu", "torch")


@pytest.mark.gpu
def test_gpu_kernel_skip_flag_refuses_the_whole_step():
    _check_skip_flag("cuda", "cuda")


# ---------------------------------------------------------------- the clipping factor read in the step (grad_scale)

def _check_grad_scale(device, backend, g_dtype):
    """grad_scale = s gives the step on gradients clipped in place by `g.mul_(1.0 / s)` (DeepSpeed's clip), bit for
    bit, and leaves the gradients themselves unchanged."""
    G = 128
    sizes = [3 * G + 5, 2 * G]
    params, grads, state = make_state(sizes, G, device=device, p_dtype=torch.bfloat16, g_dtype=g_dtype)
    rems = [torch.randint(-2 ** 15, 2 ** 15, (n,), dtype=torch.int16, device=device) for n in sizes]
    clipped_p, clipped_s = clone_all(params, state)
    clipped_r = [r.clone() for r in rems]
    s = torch.tensor(3.7, device=device)  # a clip factor (norm / max norm) whose reciprocal is inexact
    kw = dict(step=5, group_size=G, expand=True)
    before_g = [g.clone() for g in grads]
    run_backend(backend, params, grads, state, grad_scale=s, remainders=rems, **kw)
    assert all(torch.equal(a, b) for a, b in zip(grads, before_g))
    clipped_g = [g.clone().mul_(1.0 / s) for g in grads]
    run_backend(backend, clipped_p, clipped_g, clipped_s, remainders=clipped_r, **kw)
    for a, b in zip(params + rems + [t for col in state for t in col], clipped_p + clipped_r +
                    [t for col in clipped_s for t in col]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("g_dtype", [torch.float32, torch.bfloat16])
def test_reference_grad_scale_is_the_in_place_clip(g_dtype):
    _check_grad_scale("cpu", "torch", g_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("g_dtype", [torch.float32, torch.bfloat16])
def test_gpu_kernel_grad_scale_is_the_in_place_clip(g_dtype):
    """On the GPU the kernel's rounding is checked against the same product written out in fp32 and rounded to
    the gradient's dtype (which `mul_` on the GPU may round differently: its 0-dim operand is cast first)."""
    G = 128
    sizes = [3 * G + 5, 2 * G]
    params, grads, state = make_state(sizes, G, device="cuda", p_dtype=torch.bfloat16, g_dtype=g_dtype)
    p2, s2 = clone_all(params, state)
    s = torch.tensor(3.7, device="cuda")
    kw = dict(step=5, group_size=G, expand=True)
    run_backend("cuda", params, grads, state, grad_scale=s, **kw)
    clipped = [(g.float() * torch.reciprocal(s)).to(g_dtype) for g in grads]
    run_backend("cuda", p2, clipped, s2, **kw)
    for a, b in zip(params + [t for col in state for t in col], p2 + [t for col in s2 for t in col]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
