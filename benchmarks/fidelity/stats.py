"""Statistics of the fidelity benchmark: Student's t quantiles (no scipy on the GPU machine) and the gap of a
mode to the baseline with a 95% confidence interval from seed-paired differences."""
from __future__ import annotations

import math
import statistics

# The issue's bar: |mean gap| <= 0.25% (DeepSeek-V3's FP8 report) with the 95% interval inside +-0.5%; every block
# parameter's gradient cosine to bf16 >= 0.98.
TARGET_MEAN_PCT, TARGET_CI_PCT, TARGET_GRAD_COSINE = 0.25, 0.5, 0.98
Z_975 = 1.959963984540054  # the normal 0.975-quantile, the limit of t(0.975, df) as df grows


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularized incomplete beta function (Lentz's method)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def student_t_cdf(t: float, df: float) -> float:
    x = df / (df + t * t)
    front = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - math.lgamma(0.5)
                     + (df / 2) * math.log(x) + 0.5 * math.log1p(-x)) if 0 < x < 1 else 0.0
    ib = front * _betacf(df / 2, 0.5, x) / (df / 2) if x < (df / 2 + 1) / (df / 2 + 2.5) else \
        1.0 - front * _betacf(0.5, df / 2, 1 - x) / 0.5
    return 1.0 - 0.5 * ib if t >= 0 else 0.5 * ib


def student_t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t with df degrees of freedom (bisection on the CDF; p in (0.5, 1))."""
    lo, hi = 0.0, 1.0
    while student_t_cdf(hi, df) < p:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if student_t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def paired_gap(mode_losses: dict, base_losses: dict) -> dict | None:
    """Relative gap (%) of a mode to the baseline over the keys both finished (a seed, or a (seed, card) pair): mean,
    std and the 95% t-interval of the per-key differences 100 * (mode - base) / base. None without a common key; no
    interval with one."""
    seeds = sorted(set(mode_losses) & set(base_losses))
    if not seeds:
        return None
    diffs = [100.0 * (mode_losses[s] - base_losses[s]) / base_losses[s] for s in seeds]
    mean = statistics.fmean(diffs)
    out = {"seeds": seeds, "relative_gap_pct": diffs, "mean_pct": mean, "std_pct": None, "ci95_pct": None}
    if len(diffs) >= 2:
        std = statistics.stdev(diffs)
        half = student_t_quantile(0.975, len(diffs) - 1) * std / math.sqrt(len(diffs))
        out.update(std_pct=std, ci95_pct=[mean - half, mean + half],
                   meets_target=abs(mean) <= TARGET_MEAN_PCT and -TARGET_CI_PCT <= mean - half
                   and mean + half <= TARGET_CI_PCT,
                   seeds_for_interval=seeds_for_interval(mean, std))
    return out


def seeds_for_interval(mean: float, std: float, limit: int = 1000) -> int | None:
    """For planning device calls: the fewest paired seeds whose 95% interval, mean +- t(0.975, n-1) std / sqrt(n),
    would lie inside +-TARGET_CI_PCT if the observed mean and spread held. None where no count does (|mean| at or
    beyond the bound, or more than `limit` seeds). An estimate: both the mean and the spread move as seeds come."""
    room = TARGET_CI_PCT - abs(mean)
    if room <= 0:
        return None
    # t(0.975, n-1) > z(0.975) for every n: no count below (z std / room)^2 can fit, so the search starts there
    first = max(2, math.floor((Z_975 * std / room) ** 2))
    for n in range(first, limit + 1):
        if student_t_quantile(0.975, n - 1) * std / math.sqrt(n) <= room:
            return n
    return None
