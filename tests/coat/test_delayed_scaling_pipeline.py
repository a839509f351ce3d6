"""Delayed scaling under a pipeline schedule (megacoat/coat/delayed_scaling.py): a stage's 1F1B warm-up runs several
forwards before the first backward. One history entry is one micro-batch's call (its forward at an activation site,
its backward at a gradient site), and which call bootstraps is fixed in its forward, so a stage that runs its
forwards in micro-batch order and its backwards too records what the one-stage loop (each forward's backward before
the next forward) records: histories, losses and gradients equal bit for bit, over steps, the FP8 head included."""
import pytest
import torch

from megacoat.coat import RECIPES, convert_to_coat
from megacoat.coat.delayed_scaling import HISTORY_KEY, DelayedScale
from megacoat.coat.head import Fp8Head
from megacoat.coat.linear import refresh_fp8_weights
from megacoat.model import GPT, ModelConfig

CFG = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, seq_length=32, vocab_size=256)
MICRO_BATCHES, STEPS = 4, 2


def one_f_one_b(micro_batches: int, warmup: int) -> list[tuple[str, int]]:
    """A 1F1B stage's order of forwards and backwards ("F"/"B", micro-batch): `warmup` forwards ahead (a stage
    of S with S - 1 - stage of them), then one forward and one backward in turn, then the remaining backwards."""
    warmup = min(warmup, micro_batches)
    order = [("F", i) for i in range(warmup)]
    for i in range(warmup, micro_batches):
        order += [("F", i), ("B", i - warmup)]
    return order + [("B", i) for i in range(micro_batches - warmup, micro_batches)]


def _train(warmup: int):
    torch.manual_seed(0)
    recipe = RECIPES["coat"].for_layout(1, 2, CFG["vocab_size"], CFG["hidden_size"])  # auto, resolved under PP
    model = convert_to_coat(GPT(ModelConfig(**CFG)), recipe)
    assert isinstance(model.head, Fp8Head)
    refresh_fp8_weights(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    data = torch.randint(0, CFG["vocab_size"], (STEPS, MICRO_BATCHES, 2, CFG["seq_length"] + 1),
                         generator=torch.Generator().manual_seed(1))
    losses, grads = [], []
    for step in range(STEPS):
        pending = {}
        for kind, i in one_f_one_b(MICRO_BATCHES, warmup):
            if kind == "F":
                batch = data[step, i]
                pending[i] = model(batch[:, :-1], batch[:, 1:])
            else:
                loss = pending.pop(i)
                (loss / MICRO_BATCHES).backward()
                losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
        refresh_fp8_weights(model)
    histories = {n: getattr(m, HISTORY_KEY).clone() for n, m in model.named_modules() if isinstance(m, DelayedScale)}
    return histories, torch.stack(losses), grads


def test_order_lists_every_micro_batch_once_each_way():
    assert one_f_one_b(4, 0) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3), ("B", 3)]
    assert one_f_one_b(4, 2) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)]
    assert one_f_one_b(2, 3) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


@pytest.mark.parametrize("warmup", [1, 3])
def test_a_pipeline_stage_records_the_one_stage_histories(warmup):
    """warmup 1 and 3: the first stage of PP=2 and of PP=4 (3 forwards in flight, of 4 micro-batches)."""
    one_hist, one_losses, one_grads = _train(warmup=0)
    hist, losses, grads = _train(warmup)
    assert len(one_hist) == 6 * CFG["num_layers"]  # every site delayed (auto under PP)
    entries = STEPS * MICRO_BATCHES
    for name, h in one_hist.items():
        assert h[:entries].gt(0).all() and h[entries:].eq(0).all(), name  # one entry per micro-batch and step
        assert torch.equal(hist[name], h), name
    assert torch.equal(losses, one_losses)
    for step, (a, b) in enumerate(zip(grads, one_grads)):
        assert all(torch.equal(a[n], b[n]) for n in b), step
