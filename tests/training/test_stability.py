"""The stability guard: a NaN injected into the loss at one iteration (by tests/training/nan_injection.py, a
wrapper around pretrain_gpt.py) skips that step in every engine mode — the checkpoint after the skipped step
holds exactly the weights, optimizer state and LR schedule of the one before — the log counts it, training
goes on with finite losses; --max-skipped-steps skips in a row stop the run, leaving the last good checkpoint
as `latest`."""
import math
import os

import pytest
import torch

from megacoat.training.stability import StabilityGuard, NonFiniteTrainingError
from tests.training.checkpoint_runs import records, run

NAN_RUN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nan_injection.py")


def _state(ckpt, it):
    return torch.load(ckpt / f"iter_{it:07d}" / "mp_rank_00_model_states.pt", weights_only=False)


def _optim_state(ckpt, it):
    """AdamW moments: in the model-states file (ZeRO-0 fp32) or in ZeRO's partition file."""
    s = _state(ckpt, it)
    if s.get("optimizer") is not None:
        return s["optimizer"]
    return torch.load(ckpt / f"iter_{it:07d}" / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                      weights_only=False)["optimizer_state_dict"]


def _flat(obj):
    """All tensors in a nested state, in order (for exact comparison)."""
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in _flat(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _flat(v)]
    return []


@pytest.mark.parametrize("mode", [["--zero-stage", "0", "--fp32"],   # megacoat's own skip
                                  ["--zero-stage", "1", "--fp32"],   # DeepSpeed ZeRO's overflow skip
                                  ["--zero-stage", "0", "--bf16"]],  # DeepSpeed's bf16 optimizer skip
                         ids=["zero0-fp32", "zero1-fp32", "zero0-bf16"])
def test_a_nan_step_is_skipped_and_changes_nothing(tmp_path, mode):
    ckpt = tmp_path / "ckpt"
    log = tmp_path / "log.json"
    proc = run(tmp_path, mode + ["--train-iters", "5", "--save", str(ckpt), "--save-interval", "1"], log,
               script=(NAN_RUN, "3"))
    train = {r["iteration"]: r for r in records(log)}
    assert math.isnan(train[3]["loss"]) and train[3]["skipped_steps"] == 1
    assert all(math.isfinite(train[i]["loss"]) and train[i]["skipped_steps"] == 0 for i in (1, 2, 4, 5))
    assert train[4]["lr"] == train[3]["lr"]  # the LR schedule held still over the skipped step
    assert "iter 3: non-finite loss or gradient, step skipped" in proc.stdout
    before, after, later = _state(ckpt, 2), _state(ckpt, 3), _state(ckpt, 4)
    for name, w in before["module"].items():
        assert torch.equal(w, after["module"][name]), name
    assert any(not torch.equal(w, later["module"][n]) for n, w in before["module"].items())
    assert before["lr_scheduler"] == after["lr_scheduler"]
    for a, b in zip(_flat(_optim_state(ckpt, 2)), _flat(_optim_state(ckpt, 3))):
        assert torch.equal(a, b)


def test_max_skipped_steps_in_a_row_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = run(tmp_path, ["--zero-stage", "0", "--fp32", "--train-iters", "10", "--save", str(ckpt),
                          "--save-interval", "2", "--max-skipped-steps", "3"], tmp_path / "log.json", check=False,
               script=(NAN_RUN, "3,5,6,7,8"))
    assert proc.returncode != 0
    assert "3 steps in a row skipped" in proc.stderr and "--max-skipped-steps 3" in proc.stderr
    # iteration 4 was good and saved; 6 was skipped but --save-interval saved it: the newest *good* state
    # is still what it holds (a skipped step changes nothing). The run stopped at 7, before saving 8.
    assert (ckpt / "latest").read_text() == "iter_0000006"
    last = [r for r in records(tmp_path / "log.json") if "loss" in r][-1]
    assert last["iteration"] == 7 and math.isnan(last["loss"])


def test_guard_counts_in_a_row_and_resets_on_a_good_step():
    guard = StabilityGuard(max_skipped_steps=2)
    guard.record(True, 1, float("nan"), None)
    guard.record(False, 2, 1.0, 1.0)
    guard.record(True, 3, float("nan"), None)
    guard.check()
    assert guard.pop_since_log() == 2 and guard.pop_since_log() == 0
    guard.record(True, 4, float("nan"), float("inf"))
    with pytest.raises(NonFiniteTrainingError, match="iteration 4: 2 steps in a row"):
        guard.check()
