"""Resuming with a larger --train-iters (issue 60, point 12): the first resumed step uses the new schedule's rate,
as the uninterrupted run does, and the run says the schedule changed. ZeRO-1: DeepSpeed loads the optimizer's
state (its saved rate included) after the scheduler's."""
import pytest

from tests.training.checkpoint_runs import records, run

FLAGS = ["--zero-stage", "1", "--lr-decay-style", "cosine", "--min-lr", "1e-4"]


@pytest.mark.slow
def test_first_resumed_step_uses_the_new_schedule(tmp_path):
    run(tmp_path, FLAGS + ["--train-iters", "8"], tmp_path / "full.json")
    short = run(tmp_path, FLAGS + ["--train-iters", "4", "--save", str(tmp_path / "ckpt")], tmp_path / "short.json")
    assert f"  checkpoint: {tmp_path / 'ckpt' / 'iter_0000004'}" in short.stdout.splitlines()  # the run summary
    proc = run(tmp_path, FLAGS + ["--train-iters", "8", "--load", str(tmp_path / "ckpt")], tmp_path / "resumed.json")
    full = {r["iteration"]: r["lr"] for r in records(tmp_path / "full.json") if "lr" in r}
    resumed = {r["iteration"]: r["lr"] for r in records(tmp_path / "resumed.json") if "lr" in r}
    assert sorted(resumed) == [5, 6, 7, 8]
    for it in resumed:
        assert resumed[it] == pytest.approx(full[it], rel=1e-12), (it, resumed, full)
    assert "LR schedule rebuilt from the flags at step 4 (--lr-decay-iters 4 -> 8, --train-iters 4 -> 8)" \
        in proc.stdout
    assert "  trained: 4 iterations (4 -> 8), 1,024 tokens in " in proc.stdout  # this run's own work
