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
