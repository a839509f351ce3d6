"""bf16 + int16 remainder as an exact fp32 (megacoat/ops/param_remainder.py): every fp32 bit pattern round-trips,
the bf16 half is the nearest bf16 (ties away from zero), a NaN never turns finite."""
import pytest
import torch

from megacoat.ops.param_remainder import join_fp32, split_fp32

SPECIAL = [0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), 3.3895313892515355e38, -3.4028234663852886e38,
           1e-45, -1e-45, 1.1754943508222875e-38, 2.0 ** -133]


def every_kind_of_fp32(n=1 << 20, seed=0):
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-2**31, 2**31, (n,), generator=g, dtype=torch.int64).to(torch.int32)
    # exact ties (low half 0x8000) with odd and even high halves: where rounding rules differ
    ties = (torch.randint(-2**15, 2**15, (4096,), generator=g, dtype=torch.int64) * 65536 + 0x8000).to(torch.int32)
    return torch.cat([bits.view(torch.float32), ties.view(torch.float32), torch.tensor(SPECIAL)])


def test_every_non_nan_fp32_round_trips_bit_for_bit():
    x = every_kind_of_fp32()
    p, r = split_fp32(x)
    assert p.dtype == torch.bfloat16 and r.dtype == torch.int16
    y = join_fp32(p, r)
    keep = ~torch.isnan(x)
    assert torch.equal(y.view(torch.int32)[keep], x.view(torch.int32)[keep])
    assert torch.isnan(y[~keep]).all()  # NaN comes back NaN ...
    assert not torch.isfinite(p.float()[~keep]).any()  # ... and its bf16 half is never a finite number


def test_bf16_half_is_the_nearest_bf16_ties_away_from_zero():
    x = every_kind_of_fp32()
    x = x[torch.isfinite(x)]
    p, _ = split_fp32(x)
    rne = x.to(torch.bfloat16)
    differ = p.view(torch.int16) != rne.view(torch.int16)
    low = x.view(torch.int32) & 0xFFFF
    assert bool((low[differ] == 0x8000).all())  # only at exact ties ...
    assert bool((p.float()[differ].abs() > rne.float()[differ].abs()).all())  # ... and then away from zero
    assert int(differ.sum()) > 0  # the tie cases above do occur
    # nearest: no bf16 lies strictly closer to x than p
    err = (p.double() - x.double()).abs()
    assert bool((err <= (rne.double() - x.double()).abs()).all())


def test_values_exactly_representable_in_bf16_have_zero_remainder():
    x = torch.randn(10000).to(torch.bfloat16)
    p, r = split_fp32(x.float())
    assert torch.equal(p.view(torch.int16), x.view(torch.int16)) and not r.any()


def test_dtype_errors():
    with pytest.raises(TypeError, match="float32"):
        split_fp32(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="bfloat16 and int16"):
        join_fp32(torch.zeros(3), torch.zeros(3, dtype=torch.int16))
