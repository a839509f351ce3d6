"""megacoat/parallel/stage_graphs.py: a pipeline stage's blocks captured per micro-batch slot, driven on one GPU in
the order DeepSpeed's 1F1B schedule drives a stage (several forwards before their backwards), against the same
compiled blocks run without graphs. A replay runs the compiled call's kernels on the same inputs, so inputs'
gradients, parameters' gradients and amax histories must be equal bit for bit. The multi-GPU test runs the trainer
with PP=2 (tests/parallel/test_pipeline_fp8.py)."""
import pytest
import torch

from megacoat.coat.convert import after_optimizer_step, convert_to_coat
from megacoat.coat.recipe import RECIPES
from megacoat.model import GPT
from megacoat.model.config import ModelConfig
from megacoat.parallel.pipeline import BlockPipe
from megacoat.parallel.stage_graphs import SlotBusyError, StageGraphs

CFG = ModelConfig(num_layers=3, hidden_size=256, ffn_hidden_size=512, num_attention_heads=4, seq_length=128,
                  vocab_size=512)
MB = 2

pytestmark = pytest.mark.gpu


def stage(recipe: str, slots: int | None):
    """CFG's blocks as one pipeline stage (BlockPipe, compiled as the trainer compiles them under PP), through
    per-slot graphs when slots is given; the same weights for every call."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(CFG)
    if recipe != "bf16":
        model = convert_to_coat(model, RECIPES[recipe].for_layout(1, 2, CFG.vocab_size, CFG.hidden_size))
    model = model.cuda().to(torch.bfloat16)
    after_optimizer_step(model)  # the FP8 weight copies
    for block in model.layers:
        block.compile()
    graphs = None
    if slots is not None:
        graphs = StageGraphs()
        graphs.set_slots(slots)
    pipes = [BlockPipe(block, model._rope_cpu, graphs) for block in model.layers]

    def forward(x):
        for pipe in pipes:
            x = pipe(x)
        return x
    forward.pipes = pipes
    return forward, model


def one_f_one_b(micro_batches: int, ahead: int) -> list[tuple[str, int]]:
    """A stage's order of forwards (F) and backwards (B) of micro-batches under 1F1B with `ahead` in flight."""
    order, f = [("F", i) for i in range(min(ahead, micro_batches))], min(ahead, micro_batches)
    for b in range(micro_batches):
        order.append(("B", b))
        if f < micro_batches:
            order.append(("F", f))
            f += 1
    return order


def step(forward, model, xs, gys, ahead):
    """One step: every micro-batch through the stage in 1F1B order; returns the inputs' gradients and the
    parameters' (accumulated over the micro-batches), then clears them as an optimizer step does."""
    live, dxs = {}, {}
    for kind, i in one_f_one_b(len(xs), ahead):
        if kind == "F":
            x = xs[i].detach().requires_grad_()
            live[i] = (x, forward(x))
        else:
            x, y = live.pop(i)
            torch.autograd.backward(y, gys[i])
            dxs[i] = x.grad.clone()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return [dxs[i] for i in range(len(xs))], grads


def histories(model):
    return [b.clone() for name, b in model.named_buffers() if name.endswith("amax_history")]


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch._dynamo.reset()


@pytest.mark.parametrize("recipe,micro_batches,ahead", [("coat", 5, 3), ("coat", 4, 1), ("bf16", 5, 2)])
def test_graphed_stage_equals_the_compiled_stage_bit_for_bit(recipe, micro_batches, ahead):
    torch.manual_seed(1)
    xs = [torch.randn(MB, CFG.seq_length, CFG.hidden_size, device="cuda", dtype=torch.bfloat16)
          for _ in range(micro_batches)]
    gys = [torch.randn_like(x) * 1e-2 for x in xs]
    plain, plain_model = stage(recipe, None)
    graphed, graphed_model = stage(recipe, ahead)
    for s in range(4):  # step 0 warms up (3 calls a block), later ones replay the captured slots
        a, b = step(plain, plain_model, xs, gys, ahead), step(graphed, graphed_model, xs, gys, ahead)
        for u, v in zip(a[0] + a[1], b[0] + b[1], strict=True):
            assert torch.equal(u, v), f"step {s}: max difference {(u.float() - v.float()).abs().max()}"
        for u, v in zip(histories(plain_model), histories(graphed_model), strict=True):
            assert torch.equal(u, v), s
    captured = sum(e.fwd is not None and e.bwd is not None for pipe in graphed.pipes
                   for e in pipe._graphed[0]._entries)
    assert captured == CFG.num_layers * ahead  # every block, every slot: the graphs did run
    if recipe == "coat":
        assert histories(graphed_model)[0].gt(0).sum() > 1  # delayed scaling advanced through the replays


def test_no_host_sync_inside_a_graphed_stage():
    """Once captured, a whole 1F1B step of the stage runs without a device synchronization."""
    torch.manual_seed(1)
    xs = [torch.randn(MB, CFG.seq_length, CFG.hidden_size, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    gys = [torch.randn_like(x) * 1e-2 for x in xs]
    graphed, model = stage("coat", 2)
    for _ in range(3):
        step(graphed, model, xs, gys, 2)
    torch.cuda.synchronize()
    live = {}
    torch.cuda.set_sync_debug_mode("error")
    try:
        for kind, i in one_f_one_b(len(xs), 2):
            if kind == "F":
                x = xs[i].detach().requires_grad_()
                live[i] = (x, graphed(x))
            else:
                x, y = live.pop(i)
                torch.autograd.backward(y, gys[i])
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_more_forwards_in_flight_than_slots_is_one_error():
    torch.manual_seed(1)
    xs = [torch.randn(MB, CFG.seq_length, CFG.hidden_size, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    gys = [torch.randn_like(x) * 1e-2 for x in xs]
    graphed, model = stage("coat", 1)
    step(graphed, model, xs, gys, 1)  # warm-up and capture with one in flight
    with pytest.raises(SlotBusyError, match="--enable-cuda-graph under pipeline parallelism"):
        step(graphed, model, xs, gys, 2)
