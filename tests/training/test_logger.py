"""The training log's backends: JSON lines, TensorBoard scalars read back from the event file, wandb as an
optional dependency (a clear error without it), and a resumed run's JSON trimmed to the checkpoint."""
import builtins
import json
import math

import pytest

from megacoat.training.logger import TrainingLogger


def _record(it, loss):
    return {"iteration": it, "loss": loss, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1000.0,
            "tflops_per_gpu": 0.1, "mfu": None, "max_memory_bytes": 2**20, "skipped_steps": 0}


def test_tensorboard_receives_the_logged_scalars(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TrainingLogger(str(tmp_path / "log.json"), enabled=True, tensorboard_dir=str(tmp_path / "tb"))
    for it, loss in ((1, 5.0), (2, 4.5), (3, float("nan"))):
        logger.log_train(_record(it, loss), train_iters=3)
    logger.log_eval(3, 4.2)
    logger.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "eval/loss"} <= tags
    assert "train/mfu" not in tags  # None (CPU) is not a number to plot
    # NaN (a skipped step) is left out of TensorBoard rather than breaking the plot's scale; JSON keeps it.
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 5.0), (2, 4.5)]
    assert [(e.step, e.value) for e in acc.Scalars("eval/loss")] == [(3, pytest.approx(4.2))]
    lines = [json.loads(x) for x in (tmp_path / "log.json").read_text().splitlines()]
    assert math.isnan(lines[2]["loss"]) and lines[3] == {"iteration": 3, "val_loss": 4.2}
    assert "iter      2/3 | loss 4.5000" in capsys.readouterr().out


def test_wandb_project_without_wandb_installed_is_a_clear_error(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(RuntimeError, match="--wandb-project needs the `wandb` package"):
        TrainingLogger(None, enabled=True, wandb_project="megacoat")


def test_wandb_goes_offline_without_an_api_key(tmp_path, monkeypatch):
    import sys
    import types

    calls = {}

    class FakeRun:
        def log(self, scalars, step):
            calls.setdefault("log", []).append((step, scalars))

        def finish(self):
            calls["finished"] = True

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.update(init=kw, mode=__import__("os").environ.get("WANDB_MODE")) or FakeRun()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    logger = TrainingLogger(None, enabled=True, wandb_project="p", wandb_run_name="r", run_config={"a": 1})
    logger.log_train(_record(1, 5.0), train_iters=1)
    logger.close()
    assert calls["mode"] == "offline" and calls["init"]["project"] == "p" and calls["init"]["name"] == "r"
    assert calls["log"][0][0] == 1 and calls["log"][0][1]["train/loss"] == 5.0 and calls["finished"]


def test_resume_keeps_the_log_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "log.json"
    first = TrainingLogger(str(path), enabled=True)
    for it in range(1, 7):
        first.log_train(_record(it, 6.0 - it / 10), train_iters=10)
    first.log_eval(5, 5.0)
    resumed = TrainingLogger(str(path), enabled=True, resume=True)
    resumed.truncate_after(4)  # the checkpoint was at 4; 5 and 6 were logged after it and will be redone
    assert [json.loads(x)["iteration"] for x in path.read_text().splitlines()] == [1, 2, 3, 4]
    fresh = TrainingLogger(str(path), enabled=True)  # a new run (no --load) starts a new log
    assert path.read_text() == "" and fresh.enabled


def test_disabled_logger_on_other_ranks_writes_nothing(tmp_path, capsys):
    logger = TrainingLogger(str(tmp_path / "log.json"), enabled=False, tensorboard_dir=str(tmp_path / "tb"))
    logger.log_train(_record(1, 5.0), train_iters=1)
    assert not (tmp_path / "log.json").exists() and not (tmp_path / "tb").exists()
    assert capsys.readouterr().out == ""


def test_reserved_memory_is_shown_beside_the_allocated_peak_when_recorded(tmp_path, capsys):
    """A GPU run's line names the allocator's reserved peak too (a CUDA graph's replays are visible only there);
    a CPU record (None) leaves the line as it was."""
    logger = TrainingLogger(str(tmp_path / "log.json"), enabled=True)
    logger.log_train({**_record(1, 5.0), "max_memory_reserved_bytes": 3 * 2**29}, train_iters=2)
    logger.log_train({**_record(2, 4.5), "max_memory_reserved_bytes": None}, train_iters=2)
    logger.close()
    first, second = [line for line in capsys.readouterr().out.splitlines() if line.startswith("iter")]
    assert first.endswith("mem 0.00 GiB (reserved 1.50)") and second.endswith("mem 0.00 GiB")
    lines = [json.loads(x) for x in (tmp_path / "log.json").read_text().splitlines()]
    assert [r["max_memory_reserved_bytes"] for r in lines] == [3 * 2**29, None]
