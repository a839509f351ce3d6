"""Switching optimizers on --load (one rank, ZeRO-1, fp32): AdamW -> CoatAdamW -> CoatAdamW with other formats
and groups -> AdamW, each with --override-optimizer-state convert. Without the flag the mismatch is an error. The
step count continues (Adam's bias correction), and the losses follow the uninterrupted AdamW run within the FP8
moment tolerance of tests/training/test_checkpoint_reshard.py (E5M2 moments: u = 2^-3)."""
import pytest
import torch

from tests.training.checkpoint_runs import losses, run

ITERS = 12
BASE = ["--train-iters", str(ITERS), "--fp32"]
CONVERT = ["--override-optimizer-state", "convert"]
# (flags of the segment, iteration it stops at)
# The third segment also moves to ZeRO-0, where the optimizer's state is per model parameter, not per partition.
SEGMENTS = [([], 4), (["--fp8-optimizer"], 8),
            (["--fp8-optimizer", "--fp8-group-size", "32", "--fp8-v-dtype", "e5m2", "--zero-stage", "0"], 10), ([], 12)]


def saved_step(ckpt, iteration) -> int:
    tag = ckpt / f"iter_{iteration:07d}"
    if (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").is_file():
        sd = torch.load(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
        return int(sd["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["step"])
    sd = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)  # ZeRO-0: the client optimizer's
    return int(sd["optimizer"]["state"][0]["step"])


@pytest.mark.slow
def test_adamw_to_coat_to_other_coat_to_adamw(tmp_path):
    run(tmp_path, BASE + ["--zero-stage", "1"], tmp_path / "ref.json")
    ref = losses(tmp_path / "ref.json")
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.json"
    run(tmp_path, BASE + ["--zero-stage", "1", "--save", str(ckpt), "--exit-interval", "4"], log)
    refused = run(tmp_path, BASE + ["--zero-stage", "1", "--fp8-optimizer", "--load", str(ckpt)], tmp_path / "bad.json",
                  check=False)
    assert refused.returncode != 0
    assert ("optimizer state is not this run's: fp8_optimizer: saved False, now True. Pass "
            "--override-optimizer-state convert") in refused.stderr
    for (flags, stop), (_, start) in zip(SEGMENTS[1:], SEGMENTS[:-1]):
        exit_at = ["--exit-interval", str(stop)] if stop < ITERS else []
        zero = [] if "--zero-stage" in flags else ["--zero-stage", "1"]
        proc = run(tmp_path, BASE + zero + flags + CONVERT + ["--save", str(ckpt), "--load", str(ckpt)] + exit_at, log)
        assert "optimizer state converted: " in proc.stdout and f"at iteration {start}" in proc.stdout
        assert saved_step(ckpt, stop) == stop  # the step count carried over every conversion
    got = losses(log)
    assert [i for i, _ in got] == list(range(1, ITERS + 1))
    assert got[:4] == ref[:4]
    moved = 0.0
    for (i, x), (_, y), (_, prev) in zip(got[1:], ref[1:], ref[:-1]):
        moved += abs(y - prev)
        assert abs(x - y) <= 1.5 * 2.0 ** -3 * moved + 1e-5 * abs(y), (i, x, y, moved)
