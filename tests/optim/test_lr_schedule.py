import math

import pytest
import torch

from megacoat.optim import OptimizerConfig, WarmupDecayLR, lr_at


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_warmup_then_decay_to_min_lr(style):
    cfg = OptimizerConfig(lr=1.0, min_lr=0.1, lr_warmup_iters=10, lr_decay_style=style)
    assert lr_at(0, cfg, 110) == pytest.approx(0.1)
    assert lr_at(9, cfg, 110) == pytest.approx(1.0)
    assert lr_at(10, cfg, 110) == pytest.approx(1.0)
    end = 1.0 if style == "constant" else 0.1
    assert lr_at(110, cfg, 110) == pytest.approx(end)
    assert lr_at(500, cfg, 110) == pytest.approx(end)
    mid = {"constant": 1.0, "linear": 0.55, "cosine": 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2))}[style]
    assert lr_at(60, cfg, 110) == pytest.approx(mid)


def test_scheduler_state_round_trips():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    cfg = OptimizerConfig(lr=1.0, min_lr=0.0, lr_warmup_iters=0, lr_decay_style="linear")
    sched = WarmupDecayLR(opt, cfg, train_iters=10)
    for _ in range(4):
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.6)
    other = WarmupDecayLR(torch.optim.SGD([p], lr=0.0), cfg, train_iters=10)
    other.load_state_dict(sched.state_dict())
    assert other.get_last_lr() == sched.get_last_lr()


def test_resume_takes_the_schedule_from_the_flags_and_names_what_changed():
    """A ZeRO optimizer's saved state brings back the rate it was saved with after the scheduler was loaded;
    resume() sets the rate of the new flags at the loaded step, and says which schedule flags changed."""
    cfg = OptimizerConfig(lr=1e-3, min_lr=1e-4, lr_warmup_iters=2, lr_decay_style="cosine")
    p = torch.nn.Parameter(torch.zeros(1))
    short = WarmupDecayLR(torch.optim.SGD([p], lr=0.0), cfg, train_iters=4)
    for _ in range(4):
        short.step()
    assert short.get_last_lr()[0] == pytest.approx(1e-4)  # the end of the 4-iteration schedule

    opt = torch.optim.SGD([p], lr=0.0)
    longer = WarmupDecayLR(opt, cfg, train_iters=8)
    longer.load_state_dict(short.state_dict())
    opt.param_groups[0]["lr"] = short.get_last_lr()[0]  # what loading the optimizer's state does
    note = longer.resume()
    assert opt.param_groups[0]["lr"] == pytest.approx(lr_at(4, cfg, 8)) and lr_at(4, cfg, 8) > 2e-4
    assert note.startswith("LR schedule rebuilt from the flags at step 4 (--lr-decay-iters 4 -> 8, --train-iters 4 "
                           "-> 8)"), note

    same = WarmupDecayLR(torch.optim.SGD([p], lr=0.0), cfg, train_iters=4)
    same.load_state_dict(short.state_dict())
    assert same.resume() is None  # nothing changed: nothing said
    old_format = WarmupDecayLR(torch.optim.SGD([p], lr=0.0), cfg, train_iters=8)
    old_format.load_state_dict({"num_steps": 4})  # a checkpoint from before the settings were saved
    assert old_format.resume() is None and old_format.get_last_lr()[0] == pytest.approx(lr_at(4, cfg, 8))
