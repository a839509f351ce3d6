"""--compile (apply_compile: torch.compile per transformer block and of the loss) in every FP8 activation mode:
the compiled model computes what the eager one does. Each block is one graph with the FP8 flow inside it (the
megacoat:: operators; tests/coat/test_blocks.py checks fullgraph), reading FP8 weight copies made by
refresh_fp8_weights."""
import copy

import pytest
import torch

from tests.coat.recipes import recipe_of
from megacoat.coat.convert import convert_to_coat
from megacoat.coat.linear import refresh_fp8_weights
from tests.coat.saved_memory import saved_activation_bytes
from megacoat.model.config import ModelConfig
from megacoat.model.gpt import GPT, RMSNorm, cross_entropy_loss
from megacoat.training.model_builder import apply_compile

CFG = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
           seq_length=32, vocab_size=256)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bf16", "fp8-linear", "coat", "coat+fp8-head"])
def test_compiled_blocks_match_eager(mode):
    torch._dynamo.reset()
    torch.manual_seed(0)
    mode, _, head = mode.partition("+")  # coat+fp8-head: --fp8-output-layer too
    eager = convert_to_coat(GPT(ModelConfig(**CFG)), recipe_of(mode=mode, group_size=32, output_layer=bool(head)))
    compiled = copy.deepcopy(eager)
    apply_compile(compiled)
    refresh_fp8_weights(compiled)  # what the trainer does before the first step
    if not head:  # the FP8 head fuses its own loss
        assert compiled.head.loss_fn is not cross_entropy_loss and eager.head.loss_fn is cross_entropy_loss
    assert compiled.norm._compiled_call_impl is not None and eager.norm._compiled_call_impl is None
    tokens = torch.randint(0, CFG["vocab_size"], (2, CFG["seq_length"] + 1))
    losses, grads = [], []
    for model in (eager, compiled):
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    # fp32 on CPU: the compiled graphs only reorder fp32 arithmetic (and the FP8 parts trace into the same torch
    # references), so agreement is to a few fp32 ulps of the O(1) values, far below FP8's 2^-4.
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-4, atol=1e-5, msg=f"gradient of {name}")


@pytest.mark.slow
def test_compiled_loss_keeps_only_the_bf16_logits():
    """Eager F.cross_entropy on .float() logits keeps the fp32 log-softmax (4 bytes per logit) for backward;
    the compiled loss keeps the bf16 logits (2 bytes) and per-token statistics: why apply_compile compiles it.
    Bytes are unique storages (saved_activation_bytes)."""
    torch._dynamo.reset()
    logits = torch.randn(2, 64, 512, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 512, (2, 64))
    labels[0, :5] = -100
    compiled = torch.compile(cross_entropy_loss)
    eager_bytes, _ = saved_activation_bytes(lambda: cross_entropy_loss(logits, labels))
    compiled_bytes, _ = saved_activation_bytes(lambda: compiled(logits, labels))
    assert eager_bytes >= 4 * logits.numel() and compiled_bytes <= 2 * logits.numel() + 64 * labels.numel()
    (g_eager,) = torch.autograd.grad(cross_entropy_loss(logits, labels), logits)
    (g_compiled,) = torch.autograd.grad(compiled(logits, labels), logits)
    torch.testing.assert_close(g_compiled, g_eager)  # bf16 gradients: equal to bf16 rounding


@pytest.mark.slow
def test_compiled_final_norm_keeps_no_fp32_copy():
    """Eager RMSNorm keeps x.float() (4 bytes per element) and more for backward; compiled (apply_compile compiles
    the final norm) it keeps at most the bf16 input and per-token statistics, and gives the same output and
    gradients to bf16 rounding."""
    torch._dynamo.reset()
    norm = RMSNorm(256, 1e-5).bfloat16()
    x = torch.randn(4, 64, 256, dtype=torch.bfloat16, requires_grad=True)
    compiled = copy.deepcopy(norm)
    compiled.compile()
    eager_bytes, _ = saved_activation_bytes(lambda: norm(x), list(norm.parameters()))
    compiled_bytes, _ = saved_activation_bytes(lambda: compiled(x), list(compiled.parameters()))
    assert eager_bytes >= 4 * x.numel() and compiled_bytes <= 2 * x.numel() + 4 * 4 * 64, (eager_bytes, compiled_bytes)
    dy = torch.randn_like(x)
    (g_eager,) = torch.autograd.grad(norm(x), x, dy)
    (g_compiled,) = torch.autograd.grad(compiled(x), x, dy)
    torch.testing.assert_close(compiled(x), norm(x))
    torch.testing.assert_close(g_compiled, g_eager)
