"""megacoat/parallel/stage_graphs.py: a pipeline stage's blocks captured per micro-batch slot, driven on one GPU in
the order DeepSpeed's 1F1B schedule drives a stage (several forwards before their backwards), against the same
compiled blocks run without graphs. A replay runs the compiled call's kernels on the same inputs, so inputs'
gradients, parameters' gradients and amax histories must be equal bit for bit. The multi-GPU test runs the trainer
with PP=2 (tests/parallel/test_pipeline_fp8.py)."""
import pytest
import torch

from benchmarks.parallel.pipeline_stage import build_stage, step as stage_step
from megacoat.model.config import ModelConfig
from megacoat.parallel.stage_graphs import SlotBusyError

CFG = ModelConfig(num_layers=3, hidden_size=256, ffn_hidden_size=512, num_attention_heads=4, seq_length=128,
                  vocab_size=512)
MB = 2

pytestmark = pytest.mark.gpu


def stage(recipe: str, slots: int | None):
    """CFG's blocks as one compiled stage, through per-slot graphs when slots is given (benchmarks/parallel/
    pipeline_stage.py builds and drives the stage the same way)."""
    return build_stage(CFG, recipe, torch.device("cuda"), compiled=True, slots=slots)


def inputs(micro_batches: int):
    torch.manual_seed(1)
    xs = [torch.randn(MB, CFG.seq_length, CFG.hidden_size, device="cuda", dtype=torch.bfloat16)
          for _ in range(micro_batches)]
    return xs, [torch.randn_like(x) * 1e-2 for x in xs]


def step(forward, model, xs, gys, ahead):
    """One 1F1B step: the inputs' gradients and the blocks' parameters' (accumulated over the micro-batches)."""
    params = list(model.layers.parameters())
    dxs = stage_step(forward, params, xs, gys, ahead)
    return [dx.clone() for dx in dxs], [p.grad.clone() for p in params]


def histories(model):
    return [b.clone() for name, b in model.named_buffers() if name.endswith("amax_history")]


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch._dynamo.reset()


@pytest.mark.parametrize("recipe,micro_batches,ahead", [("coat", 5, 3), ("coat", 4, 1), ("bf16", 5, 2)])
def test_graphed_stage_equals_the_compiled_stage_bit_for_bit(recipe, micro_batches, ahead):
    xs, gys = inputs(micro_batches)
    plain, plain_model, _ = stage(recipe, None)
    graphed, graphed_model, pipes = stage(recipe, ahead)
    for s in range(4):  # step 0 warms up (3 calls a block), later ones replay the captured slots
        a, b = step(plain, plain_model, xs, gys, ahead), step(graphed, graphed_model, xs, gys, ahead)
        for u, v in zip(a[0] + a[1], b[0] + b[1], strict=True):
            assert torch.equal(u, v), f"step {s}: max difference {(u.float() - v.float()).abs().max()}"
        for u, v in zip(histories(plain_model), histories(graphed_model), strict=True):
            assert torch.equal(u, v), s
    captured = sum(e.fwd is not None and e.bwd is not None for pipe in pipes
                   for e in pipe._graphed[0]._entries)
    assert captured == CFG.num_layers * ahead  # every block, every slot: the graphs did run
    if recipe == "coat":
        assert histories(graphed_model)[0].gt(0).sum() > 1  # delayed scaling advanced through the replays


def test_no_host_sync_inside_a_graphed_stage():
    """Once captured, a whole 1F1B step of the stage runs without a device synchronization."""
    xs, gys = inputs(4)
    graphed, model, _ = stage("coat", 2)
    for _ in range(3):
        step(graphed, model, xs, gys, 2)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        stage_step(graphed, list(model.layers.parameters()), xs, gys, 2)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_more_forwards_in_flight_than_slots_is_one_error():
    xs, gys = inputs(4)
    graphed, model, _ = stage("coat", 1)
    step(graphed, model, xs, gys, 1)  # warm-up and capture with one in flight
    with pytest.raises(SlotBusyError, match="--enable-cuda-graph under pipeline parallelism"):
        step(graphed, model, xs, gys, 2)
