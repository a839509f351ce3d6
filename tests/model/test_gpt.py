import pytest
import torch
import torch.nn.functional as F

from megacoat.model import GPT, IGNORE_INDEX, ModelConfig
from megacoat.model.gpt import apply_rope, rope_tables

TINY = dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, seq_length=16, vocab_size=50)


def test_parameter_count_matches_config():
    for kw in (TINY, dict(TINY, num_query_groups=2), dict(TINY, tie_embeddings=False)):
        cfg = ModelConfig(**kw)
        model = GPT(cfg)
        assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()


def test_default_model_is_tiny():
    assert 1_000_000 <= ModelConfig().num_parameters() <= 5_000_000


def test_tied_embeddings_share_storage():
    model = GPT(ModelConfig(**TINY))
    assert model.output.weight is model.tok_embeddings.weight
    untied = GPT(ModelConfig(**TINY, tie_embeddings=False))
    assert untied.output.weight is not untied.tok_embeddings.weight


def test_loss_ignores_padding_labels():
    model = GPT(ModelConfig(**TINY))
    tokens = torch.randint(0, 50, (2, 16))
    labels = torch.randint(0, 50, (2, 16))
    logits = model(tokens)
    labels[:, 10:] = IGNORE_INDEX
    expected = F.cross_entropy(logits[:, :10].reshape(-1, 50), labels[:, :10].reshape(-1))
    torch.testing.assert_close(model(tokens, labels), expected, rtol=1e-5, atol=1e-6)


def test_attention_is_causal():
    model = GPT(ModelConfig(**TINY)).eval()
    tokens = torch.randint(0, 50, (1, 16))
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 50
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_rope_matches_complex_rotation():
    cos, sin = rope_tables(8, 5, 10000.0)
    x = torch.randn(2, 5, 3, 8)
    freqs = torch.polar(torch.ones_like(cos), torch.atan2(sin, cos))  # e^{i angle}
    xc = torch.view_as_complex(x.unflatten(-1, (-1, 2)).contiguous())
    expected = torch.view_as_real(xc * freqs.view(1, 5, 1, 4)).flatten(-2)
    torch.testing.assert_close(apply_rope(x, cos, sin), expected, rtol=1e-5, atol=1e-5)


def test_grouped_query_attention_equals_mha_with_repeated_kv_heads():
    torch.manual_seed(0)
    gqa = GPT(ModelConfig(**TINY, num_query_groups=2))
    mha = GPT(ModelConfig(**TINY))
    sd = gqa.state_dict()
    hd = 16
    for i in range(2):
        for name in ("wk", "wv"):
            w = sd[f"layers.{i}.attention.{name}.weight"]  # [2*hd, h]: each kv head serves 2 query heads
            sd[f"layers.{i}.attention.{name}.weight"] = w.view(2, hd, -1).repeat_interleave(2, 0).reshape(4 * hd, -1)
    mha.load_state_dict(sd)
    tokens = torch.randint(0, 50, (2, 16))
    torch.testing.assert_close(gqa(tokens), mha(tokens), rtol=1e-5, atol=1e-5)


def test_too_long_sequence_is_an_error():
    model = GPT(ModelConfig(**TINY))
    with pytest.raises(ValueError, match="seq-length"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_loss_backward_reaches_every_parameter():
    model = GPT(ModelConfig(**TINY))
    tokens = torch.randint(0, 50, (2, 16))
    model(tokens, tokens).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
