"""--fp8-weight-cache none (the FP8 weight copies made per use and never kept) and rowwise (only W8 kept, W8^T
its transposed bytes) compute exactly what the default step cache (W8 and W8^T kept per optimizer step)
computes: the same weights give the same amax, hence the same scale and the same FP8 bytes, whichever way W8^T
is obtained.

Compared bit for bit: what the cache governs, i.e. the loss, every block parameter's gradient (and the final
norm's) and the gradient the blocks hand back to the embedding output. Not compared: the embedding table's
own gradient, which the GPU sums with atomic adds in an order that changes from run to run (a property of
the embedding's backward, the same with either cache). Attention runs on SDPA's math backend, whose backward
is deterministic on every device, so only the cache can make the two runs differ."""
import copy

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from tests.coat.recipes import recipe_of
from megacoat.coat.convert import convert_to_coat
from megacoat.coat.linear import Fp8WeightCache
from megacoat.model.config import ModelConfig
from megacoat.model.gpt import GPT

CFG = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
           seq_length=32, vocab_size=256)


def _caches(model):
    return [v for m in model.modules() for v in vars(m).values() if isinstance(v, Fp8WeightCache)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("mode", ["fp8-linear", "coat"])
@pytest.mark.parametrize("policy", ["none", "rowwise"])
def test_other_weight_caches_are_bit_identical_to_step(mode, device, policy):
    torch.manual_seed(0)
    kept = convert_to_coat(GPT(ModelConfig(**CFG)), recipe_of(mode=mode, group_size=32)).to(device)
    plain = GPT(ModelConfig(**CFG))
    plain.load_state_dict(kept.state_dict())
    per_use = convert_to_coat(plain, recipe_of(mode=mode, group_size=32, weight_cache=policy)).to(device)
    assert _caches(per_use) and all(c.policy == policy for c in _caches(per_use))
    tokens = torch.randint(0, CFG["vocab_size"], (2, CFG["seq_length"] + 1), device=device)
    results = []
    for model in (kept, per_use):
        into_embedding = []  # the gradient reaching the embedding output, per micro-batch

        def keep_grad(module, inputs, out, into=into_embedding):
            out.register_hook(lambda g: into.append(g.clone()))

        hook = model.tok_embeddings.register_forward_hook(keep_grad)
        with sdpa_kernel(SDPBackend.MATH):
            for _ in range(2):  # two micro-batches: the persistent cache is reused, the other remade
                loss = model(tokens[:, :-1], tokens[:, 1:])
                loss.backward()
        hook.remove()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if n != "tok_embeddings.weight"}
        results.append((loss.detach(), into_embedding, grads))
    assert torch.equal(results[0][0], results[1][0])
    assert len(results[0][1]) == 2 and all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))
    assert len(results[0][2]) == len(list(kept.parameters())) - 1  # all but the (tied) embedding table
    for name, g in results[0][2].items():
        assert torch.equal(results[1][2][name], g), name
    assert all(c.builds == 1 for c in _caches(kept))
    if policy == "none":
        assert all(c.w8 is None and c.w8t is None for c in _caches(per_use))  # nothing outlives its use
        assert all(c.builds == 2 for c in _caches(per_use))  # one W8 per forward (W8^T in backward is not cached)
    else:  # one W8 per optimizer step, kept; no W8^T kept
        assert all(c.w8 is not None and c.w8t is None and c.builds == 1 for c in _caches(per_use))


def test_bad_weight_cache_is_named():
    with pytest.raises(ValueError, match="--fp8-weight-cache"):
        recipe_of(mode="coat", weight_cache="micro-batch")
