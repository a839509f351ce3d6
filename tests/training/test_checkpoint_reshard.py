"""Resuming on another layout (CPU, gloo, fp32): checkpoints saved at DP=2 (ZeRO-2) and at TP=2 x PP=2 resume at
DP=1, DP=4, TP=1 and PP=1 through the layout-free form, with AdamW and with CoatAdamW, and the next 5 losses follow
the uninterrupted run.

Reference: one rank, uninterrupted, the same seed and data. Every layout trains the same model on the same global
batches (tests/parallel/test_pretrain_parallel.py): with AdamW in fp32 they differ only in summation order, so we
require 1e-5 relative on each loss (as there). CoatAdamW quantizes its moments in groups along each rank's
partition or shard, so layouts differ from the reference by FP8 rounding of the moments: each step's update by at
most ~1.5 u relative (u = 2^-4 for E4M3 moments: m and sqrt(v) each within u, minus second order), which moves
the loss by at most that fraction of how much the loss has moved so far. Hence for CoatAdamW
|loss - reference| <= 1.5 u * sum_j |reference_j - reference_{j-1}| (from the first logged loss) + 1e-5 relative.
"""
import pytest

from tests.parallel.test_pretrain_parallel import free_port
from tests.training.checkpoint_runs import losses, run

ITERS, SAVE_AT = 9, 4
BASE = ["--train-iters", str(ITERS), "--fp32"]
OPTIMIZERS = {"adamw": [], "coat": ["--fp8-optimizer"]}
SOURCES = {"dp2_zero2": (2, ["--zero-stage", "2"]),
           "tp2_pp2": (4, ["--zero-stage", "1", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"])}
RESUMES = {("dp2_zero2", "dp1"): (1, ["--zero-stage", "2"]),
           ("dp2_zero2", "dp4"): (4, ["--zero-stage", "2", "--micro-batch-size", "2"]),  # global batch 8
           ("tp2_pp2", "tp1"): (2, ["--zero-stage", "1", "--pipeline-model-parallel-size", "2"]),
           ("tp2_pp2", "pp1"): (2, ["--zero-stage", "1", "--tensor-model-parallel-size", "2"])}
U_E4M3 = 2.0 ** -4


def within_fp8_moment_error(got, ref):
    """The CoatAdamW tolerance of the module docstring, per logged loss of `got` (iterations after SAVE_AT)."""
    ref_by_it = dict(ref)
    moved = 0.0
    budget = {ref[0][0]: 0.0}  # the first loss comes before any update: the same initial weights
    for (i, x), (_, prev) in zip(ref[1:], ref[:-1]):
        moved += abs(x - prev)
        budget[i] = 1.5 * U_E4M3 * moved
    return all(abs(x - ref_by_it[i]) <= budget[i] + 1e-5 * abs(ref_by_it[i]) for i, x in got)


def report(got, ref):
    return [(i, x, dict(ref)[i], x - dict(ref)[i]) for i, x in got]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One rank, ZeRO-1, uninterrupted: the loss sequence per optimizer."""
    out = {}
    for name, flags in OPTIMIZERS.items():
        tmp = tmp_path_factory.mktemp(f"ref_{name}")
        run(tmp, BASE + ["--zero-stage", "1"] + flags, tmp / "log.json")
        out[name] = losses(tmp / "log.json")
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Checkpoints at iteration SAVE_AT of each source layout and optimizer, with their first losses."""
    out = {}
    for src, (ranks, flags) in SOURCES.items():
        for name, opt in OPTIMIZERS.items():
            tmp = tmp_path_factory.mktemp(f"{src}_{name}")
            run(tmp, BASE + flags + opt + ["--save", str(tmp / "ckpt"), "--exit-interval", str(SAVE_AT)],
                tmp / "log.json", ranks=ranks, port=free_port())
            out[src, name] = (tmp / "ckpt", losses(tmp / "log.json"))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("source, target", list(RESUMES), ids=[f"{s}-to-{t}" for s, t in RESUMES])
def test_resume_on_another_layout_follows_the_uninterrupted_run(tmp_path, reference, sources, source, target,
                                                                optimizer):
    ckpt, before = sources[source, optimizer]
    ranks, flags = RESUMES[source, target]
    log = tmp_path / "log.json"
    proc = run(tmp_path, BASE + flags + OPTIMIZERS[optimizer] + ["--load", str(ckpt)], log, ranks=ranks,
               port=free_port())
    assert "checkpoint layout changed" in proc.stdout, proc.stdout[-2000:]
    assert f"resumed from {ckpt / f'iter_{SAVE_AT:07d}' / 'layout_free'} at iteration {SAVE_AT}" in proc.stdout
    after = losses(log)
    assert [i for i, _ in after] == list(range(SAVE_AT + 1, ITERS + 1))  # data position and iteration continue
    ref = reference[optimizer]
    if optimizer == "adamw":
        for (i, x), (j, y) in zip(before + after, ref):
            assert i == j and x == pytest.approx(y, rel=1e-5), (i, x, y)
    else:
        assert within_fp8_moment_error(before + after, ref), report(before + after, ref)
