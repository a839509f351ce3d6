"""benchmarks/fidelity/stats.py: Student's t quantiles against tables and the paired confidence interval on known
numbers."""
import importlib
import math

import pytest


stats = importlib.import_module("benchmarks.fidelity.stats")


@pytest.mark.parametrize("df, quantile", [(1, 12.706204736174707), (2, 4.302652729911275),
                                          (4, 2.7764451051977987), (30, 2.0422724563012373)])
def test_student_t_quantile_matches_tables(df, quantile):
    assert stats.student_t_quantile(0.975, df) == pytest.approx(quantile, rel=1e-9)


def test_paired_gap_on_known_numbers():
    base = {1: 2.0, 2: 4.0, 3: 5.0, 9: 1.0}          # seed 9 has no partner: not counted
    mode = {1: 2.02, 2: 4.0, 3: 4.95, 7: 3.0}        # +1%, 0%, -1%
    gap = stats.paired_gap(mode, base)
    assert gap["seeds"] == [1, 2, 3]
    assert gap["relative_gap_pct"] == pytest.approx([1.0, 0.0, -1.0])
    assert gap["mean_pct"] == pytest.approx(0.0, abs=1e-12) and gap["std_pct"] == pytest.approx(1.0)
    half = 4.302652729911275 / math.sqrt(3)           # t(0.975, 2) * std / sqrt(n)
    assert gap["ci95_pct"] == pytest.approx([-half, half])
    assert gap["meets_target"] is False               # the interval is wider than +-0.5%
    tight = stats.paired_gap({1: 1.001, 2: 1.002}, {1: 1.0, 2: 1.0})  # +0.1%, +0.2%: t(0.975, 1) = 12.71
    assert tight["ci95_pct"] == pytest.approx([0.15 - 12.706204736174707 * 0.05, 0.15 + 12.706204736174707 * 0.05])
    one = stats.paired_gap({1: 1.01}, {1: 1.0})
    assert one["mean_pct"] == pytest.approx(1.0) and one["ci95_pct"] is None
    assert stats.paired_gap({1: 1.0}, {2: 1.0}) is None


def test_seeds_for_interval_is_the_first_count_that_fits():
    # mean 0, std 1%: the first n with t(0.975, n-1) / sqrt(n) <= 0.5 (n=18: 2.110 / 4.243 = 0.497; n=17: 0.514)
    assert stats.seeds_for_interval(0.0, 1.0) == 18
    n = stats.seeds_for_interval(0.3, 0.5)             # room 0.2%: the bound holds at n and not at n - 1
    assert stats.student_t_quantile(0.975, n - 1) * 0.5 / math.sqrt(n) <= 0.2
    assert stats.student_t_quantile(0.975, n - 2) * 0.5 / math.sqrt(n - 1) > 0.2
    assert stats.seeds_for_interval(-0.5, 0.1) is None  # the mean is already at the bound
    assert stats.seeds_for_interval(0.49, 5.0, limit=50) is None
    gap = stats.paired_gap({1: 1.002, 2: 0.999, 3: 1.0}, {1: 1.0, 2: 1.0, 3: 1.0})
    assert gap["seeds_for_interval"] == stats.seeds_for_interval(gap["mean_pct"], gap["std_pct"])
