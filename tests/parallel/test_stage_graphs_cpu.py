"""megacoat/parallel/stage_graphs.py's plumbing on CPU, where CUDA graphs do not exist: a stand-in whose capture
runs the code eagerly and whose replay does nothing, so every capture call computes for real. What that checks:
the capture's parameter aliases hand their gradients to the parameters (a copy on the first accumulation, an
in-place add after), the dry run before a capture leaves the amax histories as they were, the stage's input
gradient, the slot rotation with several forwards in flight, and the two refusals. The replays themselves run on
a GPU (tests/parallel/test_stage_graphs.py)."""
import contextlib

import pytest
import torch

from benchmarks.parallel.pipeline_stage import build_stage
from megacoat.model.config import ModelConfig
from megacoat.parallel import stage_graphs
from megacoat.parallel.stage_graphs import SlotBusyError

CFG = ModelConfig(num_layers=2, hidden_size=256, ffn_hidden_size=512, num_attention_heads=4, seq_length=128,
                  vocab_size=512)


class EagerGraph:
    def replay(self):
        pass


@pytest.fixture(autouse=True)
def eager_capture(monkeypatch):
    monkeypatch.setattr(stage_graphs.torch.cuda, "CUDAGraph", EagerGraph)
    monkeypatch.setattr(stage_graphs, "_graph", lambda graph, pool: contextlib.nullcontext())
    monkeypatch.setattr(stage_graphs.torch.cuda, "graph_pool_handle", lambda: None)


def stage(slots: int | None, recipe: str = "coat"):
    """CFG's blocks as one eager stage, through the stand-in graphs when slots is given (one warm-up call)."""
    return build_stage(CFG, recipe, torch.device("cpu"), compiled=False, slots=slots, warmup=1)


def run(forward, xs, order):
    live, dxs = {}, {}
    for kind, i in order:
        if kind == "F":
            x = xs[i].detach().requires_grad_()
            live[i] = (x, forward(x))
        else:
            x, y = live.pop(i)
            y.backward(torch.full_like(y, 1e-2))
            dxs[i] = x.grad
    return dxs


@pytest.mark.parametrize("recipe", ["coat", "bf16"])
def test_capture_calls_give_the_plain_stage_results(recipe):
    """One warm-up call, then one capture per slot, two forwards in flight (1F1B warm-up of a 3-stage pipe's
    first stage): inputs' and parameters' gradients and amax histories equal the plain stage's bit for bit."""
    torch.manual_seed(1)
    xs = [torch.randn(2, CFG.seq_length, CFG.hidden_size, dtype=torch.bfloat16) for _ in range(3)]
    order = [("F", 0), ("B", 0), ("F", 1), ("F", 2), ("B", 1), ("B", 2)]  # calls 2 and 3 capture slots 0 and 1
    (plain, plain_model, _), (graphed, graphed_model, pipes) = stage(None, recipe), stage(2, recipe)
    a, b = run(plain, xs, order), run(graphed, xs, order)
    for i in range(3):
        assert torch.equal(a[i], b[i]), i
    for (name, p), q in zip(plain_model.layers.named_parameters(), graphed_model.layers.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    for (name, u), v in zip(plain_model.named_buffers(), graphed_model.buffers(), strict=True):
        assert torch.equal(u, v), name
    entries = [e for pipe in pipes for e in pipe._graphed[0]._entries]
    assert all(e.fwd is not None and e.bwd is not None and not e.busy for e in entries) and len(entries) == 4
    # the first block's input comes from outside the graphs, the second's is the first's static output
    assert [e.external_input for e in entries] == [True, True, False, False]
    # nothing that outlives a backward (parameters' and the stage input's gradients) is a graph's own memory,
    # which the slot's next replay overwrites
    static = {g.data_ptr() for e in entries for g in e.grads if g is not None}
    assert not static & {p.grad.data_ptr() for p in graphed_model.layers.parameters()}
    assert not static & {b[i].data_ptr() for i in range(3)}


def test_without_gradients_the_blocks_run_eagerly():
    graphed, _, pipes = stage(1)
    with torch.no_grad():
        graphed(torch.randn(2, CFG.seq_length, CFG.hidden_size, dtype=torch.bfloat16))
    assert all(pipe._graphed[0].calls == 0 for pipe in pipes)


def test_more_forwards_in_flight_than_slots_is_refused():
    graphed, _, _ = stage(1)
    xs = [torch.randn(2, CFG.seq_length, CFG.hidden_size, dtype=torch.bfloat16) for _ in range(3)]
    with pytest.raises(SlotBusyError, match="a stage holds 1 micro-batches in flight"):
        run(graphed, xs, [("F", 0), ("B", 0), ("F", 1), ("F", 2)])


def test_another_activation_shape_is_refused():
    graphed, _, _ = stage(1)
    run(graphed, [torch.randn(2, CFG.seq_length, CFG.hidden_size, dtype=torch.bfloat16)] * 2,
        [("F", 0), ("B", 0), ("F", 1), ("B", 1)])
    with pytest.raises(ValueError, match=r"one shape, captured \(2, 128, 256\), got \(1, 128, 256\)"):
        run(graphed, [torch.randn(1, CFG.seq_length, CFG.hidden_size, dtype=torch.bfloat16)], [("F", 0)])
