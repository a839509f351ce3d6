"""The sequence-parallel all-gather of a COAT block carrying E4M3 groups (--sequence-parallel-gather fp8) against
the same TP=2 + SP run gathering the block's input in the model's dtype, on 2 CPU ranks (gloo).

Numerics: the FP8 gather sends the 1xG E4M3 codes and float32 scales that the block's fused norm rounds its input
to anyway, and delivers their values. The norm rounds those values again: each group's largest value comes back
as itself (in bf16 exactly: the float32 error of code x scale is far below half a bf16 step), hence the same
scale, and every other value lands within 2^-9 of its code, far inside half an E4M3 step (2^-5 relative), hence
the same code. So the norm sees the very codes and scales it made from the bf16 input: the runs are bit for bit
equal (losses and gradients), which is what the test requires. (In fp32 the largest value could come back one
float32 step off; and on CUDA the gather's torch division and the norm kernel's may round a value at a code
midpoint apart: test_the_norm_of_the_gathered_rows_on_cuda bounds that.)

Wire: each gathered element costs 1 byte plus 4 / G bytes of its group's scale, against 2 in bf16.
"""
from dataclasses import replace

import pytest
import torch

from megacoat.coat.convert import convert_to_coat
from megacoat.coat.recipe import RECIPES
from megacoat.model import GPT
from megacoat.model.config import ModelConfig
from megacoat.parallel import mappings
from megacoat.parallel.config import ParallelConfig
from megacoat.parallel.state import initialize_parallel_state
from megacoat.parallel.tensor_parallel import apply_tp
from tests.parallel.dist_helpers import run_ranks

TINY = dict(num_layers=2, hidden_size=128, ffn_hidden_size=256, num_attention_heads=4, seq_length=32,
            vocab_size=256)
GROUP = 64
E4M3 = torch.float8_e4m3fn
STEPS = 2
BATCH = 2


def _batch(cfg: ModelConfig, step: int):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_length), generator=g)
    return tokens, torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_length), generator=g)


def _train(gather: str, dtype: torch.dtype):
    """STEPS SGD steps of the coat default (delayed scaling) under TP=2 + SP → (losses, gradients of the first
    step, [(dtype, bytes)] of each all-gather in the first forward)."""
    import torch.distributed as dist

    cfg = ModelConfig(**TINY)
    recipe = replace(RECIPES["coat"], group_size=GROUP).for_layout(tensor_model_parallel_size=2)
    torch.manual_seed(0)
    model = GPT(cfg).to(dtype)  # before the conversion: its amax histories stay float32
    convert_to_coat(model, recipe)
    state = initialize_parallel_state(ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True,
                                                     sequence_parallel_gather=gather), cfg)
    apply_tp(model, state)
    sent, gather_into = [], dist.all_gather_into_tensor

    def counted(out, x, group=None, **kw):
        sent.append((x.dtype, x.numel() * x.element_size()))
        return gather_into(out, x, group=group, **kw)

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], None
    for step in range(STEPS):
        mappings.dist.all_gather_into_tensor = counted if step == 0 else gather_into
        try:
            loss = model(*_batch(cfg, step))
        finally:
            mappings.dist.all_gather_into_tensor = gather_into
        loss.backward()
        if grads is None:
            # numpy arrays travel to the parent by value (torch tensors by a file descriptor the rank closes)
            grads = {n: p.grad.float().numpy().copy() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, grads, sent


def _compiled_gather():
    """gather_fp8_from_sp traced whole (fullgraph) against eager: (same output, same input gradient)."""
    x = torch.randn(BATCH, 16, 128, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    grads = []
    for fn in (_gather_twice, torch.compile(_gather_twice, fullgraph=True)):
        xi = x.clone().requires_grad_()
        out = fn(xi)
        out.float().square().sum().backward()
        grads.append((out.detach(), xi.grad))
    (eager, eager_grad), (compiled, compiled_grad) = grads
    assert eager.shape[1] == 2 * x.shape[1]  # gathered from both ranks
    return torch.equal(eager, compiled), torch.equal(eager_grad, compiled_grad)


def _gather_twice(x):
    import torch.distributed as dist

    return mappings.gather_fp8_from_sp(x, dist.group.WORLD, GROUP) * 2


def _runs_on_rank():
    runs = {gather: _train(gather, torch.bfloat16) for gather in ("fp8", "bf16")}
    return {**runs, "compiled": _compiled_gather()}


@pytest.fixture(scope="module")
def runs():
    return run_ranks(2, _runs_on_rank)


@pytest.mark.slow
def test_fp8_gather_is_bitwise_the_bf16_gather(runs):
    for rank in runs:
        (fp8_losses, fp8_grads, _), (losses, grads, _) = rank["fp8"], rank["bf16"]
        assert fp8_losses == losses
        assert fp8_grads.keys() == grads.keys()
        for name in grads:
            assert (fp8_grads[name] == grads[name]).all(), name


@pytest.mark.slow
def test_fp8_gather_sends_one_byte_an_element_plus_group_scales(runs):
    """Per rank and forward: each COAT block gathers twice (attention and MLP inputs), its shard of
    [batch, seq / 2, hidden]; the final norm (a plain ParallelRMSNorm) still gathers in the model's dtype."""
    shard = BATCH * TINY["seq_length"] // 2 * TINY["hidden_size"]
    blocks = 2 * TINY["num_layers"]
    for rank in runs:
        assert rank["bf16"][2] == [(torch.bfloat16, shard * 2)] * (blocks + 1)
        assert rank["fp8"][2] == ([(torch.uint8, shard), (torch.float32, shard // GROUP * 4)] * blocks
                                  + [(torch.bfloat16, shard * 2)])


@pytest.mark.slow
def test_fp8_gather_compiles_whole_to_the_eager_result(runs):
    """torch.compile(fullgraph=True) traces the autograd function, the byte view of the codes and the collectives."""
    assert all(rank["compiled"] == (True, True) for rank in runs)


def _norm_of_gathered_rows(device: str, dtype: torch.dtype, group: int):
    """The fused norm's forward (its saved codes and scales, rstd, output scale and codes) on x and on what the FP8
    gather delivers of x (quantized, then dequantized: the collectives move the codes and scales)."""
    from megacoat.ops.rmsnorm import rmsnorm_fp8_fwd

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(256, 512, generator=g) * torch.logspace(-4, 4, 256)[:, None]).to(device, dtype)
    x[7, :group] = 0  # an all-zero group (its scale from the amax floor)
    weight = torch.rand(512, generator=g).to(device, dtype) + 0.5
    delivered = mappings.dequantize_groups(*mappings.quantize_groups(x, group), group, dtype)
    return rmsnorm_fp8_fwd(x, weight, 1e-5, group), rmsnorm_fp8_fwd(delivered, weight, 1e-5, group)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group", [64, 128])
def test_the_norm_of_the_gathered_rows_is_the_norm_of_the_rows(dtype, group):
    """CPU: the torch reference quantizes both times, so the norm sees the same codes and scales, bit for bit."""
    ref, got = _norm_of_gathered_rows("cpu", dtype, group)
    for name, a, b in zip(("x8", "x_scales", "rstd", "y_scale", "y8"), ref, got):
        assert torch.equal(a.view(torch.uint8) if a.dtype == E4M3 else a,
                           b.view(torch.uint8) if b.dtype == E4M3 else b), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_norm_of_the_gathered_rows_on_cuda():
    """CUDA: the gather quantizes with torch's IEEE division, the norm's kernel with its own, so a value within a
    float32 step of the midpoint between two E4M3 codes may take the other code there (one E4M3 step apart, rare);
    the group scales match exactly (a group's largest value comes back exactly), and so rstd, but for such a code."""
    ref, got = _norm_of_gathered_rows("cuda", torch.bfloat16, 128)
    assert torch.equal(ref[1], got[1])  # group scales
    codes_ref, codes = ref[0].float(), got[0].float()
    differ = codes_ref != codes
    assert int(differ.sum()) <= max(1, codes.numel() // 100_000), int(differ.sum())
    assert torch.all((codes_ref - codes).abs()[differ] <= codes_ref.abs()[differ] / 8 + 2 ** -9)  # one E4M3 step
    assert torch.allclose(ref[2], got[2], rtol=2 ** -8, atol=0)  # one element of 512 one step off, at worst


def test_the_flag_reaches_a_coat_blocks_region():
    from megacoat.arguments import parse_config
    from megacoat.parallel.layers import TPRegion
    from megacoat.parallel.state import ParallelState
    from megacoat.parallel.tensor_parallel import region_of

    flags = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    assert parse_config(flags).parallel.sequence_parallel_gather == "bf16"  # the default
    assert parse_config(flags + ["--sequence-parallel-gather", "fp8"]).parallel.sequence_parallel_gather == "fp8"
    for gather, sp, carries in (("fp8", True, GROUP), ("bf16", True, None), ("fp8", False, None)):
        region = region_of(ParallelState(tp_size=2, sequence_parallel=sp, sequence_parallel_gather=gather))
        assert region.carrying_fp8(GROUP).fp8_group_size == carries
        assert region.fp8_group_size is None  # only a COAT block's region carries FP8 (ParallelRMSNorm's does not)
    cfg = ModelConfig(**TINY)
    model = GPT(cfg)
    convert_to_coat(model, replace(RECIPES["coat"], group_size=GROUP).for_layout(tensor_model_parallel_size=2))
    block = model.layers[0]
    block.enter_tp_region(TPRegion(None, 1, 0, sequence_parallel=True, fp8_gather=True))
    assert block.region.fp8_group_size == GROUP


def test_the_flag_is_checked():
    with pytest.raises(ValueError, match="--sequence-parallel-gather must be one of"):
        ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True, sequence_parallel_gather="fp16")


@pytest.mark.slow
def test_pretrain_gpt_trains_the_same_with_either_gather(tmp_path):
    """pretrain_gpt.py --coat-fp8, TP=2 + SP on 2 CPU ranks (bf16): the flag reaches the blocks, and the logged
    losses of the two gathers are equal (see the module docstring)."""
    from tests.parallel.test_pretrain_parallel import free_port
    from tests.training.checkpoint_runs import losses, run

    argv = ["--hidden-size", "128", "--ffn-hidden-size", "256", "--bf16", "--coat-fp8", "--train-iters", "3",
            "--tensor-model-parallel-size", "2", "--sequence-parallel", "--zero-stage", "1"]
    logs = {}
    for gather in ("fp8", "bf16"):
        logs[gather] = tmp_path / f"{gather}.json"
        run(tmp_path, argv + ["--sequence-parallel-gather", gather], logs[gather], ranks=2, port=free_port())
    assert losses(logs["fp8"]) == losses(logs["bf16"]) and len(losses(logs["fp8"])) == 3


@pytest.mark.multigpu
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "compiled-graphed"])
def test_gpu_tp2_fp8_gather_trains_as_the_bf16_gather(tmp_path, graphs):
    """Two GPUs, NCCL, bf16, TP=2 + SP, the coat default (eager, and as the benchmarks run it: compiled blocks in
    CUDA graphs). The gathers differ only where torch's division and the norm kernel's round a value at an E4M3
    code midpoint apart (test_the_norm_of_the_gathered_rows_on_cuda): the first loss agrees to 2^-10; later ones,
    after Adam steps that may turn such a flip into a different update of a near-zero-gradient weight, to 1%."""
    from tests.parallel.test_pretrain_parallel import free_port
    from tests.training.checkpoint_runs import losses, run

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    argv = ["--hidden-size", "128", "--ffn-hidden-size", "256", "--bf16", "--coat-fp8", "--train-iters", "10",
            "--tensor-model-parallel-size", "2", "--sequence-parallel", "--zero-stage", "1"]
    argv += ["--compile", "--enable-cuda-graph"] if graphs else []
    logs = {}
    for gather in ("fp8", "bf16"):
        logs[gather] = tmp_path / f"{gather}.json"
        run(tmp_path, argv + ["--sequence-parallel-gather", gather], logs[gather], ranks=2, port=free_port())
    fp8, ref = losses(logs["fp8"]), losses(logs["bf16"])
    assert [i for i, _ in fp8] == [i for i, _ in ref] and len(fp8) == 10
    assert fp8[0][1] == pytest.approx(ref[0][1], rel=2 ** -10)
    for (_, a), (_, b) in zip(fp8, ref):
        assert a == pytest.approx(b, rel=1e-2)
