"""causal_attention against attention written out by hand (scores, causal mask, softmax, weighted sum), with
each key/value head repeated for its query heads. fp32 on CPU: the two differ only in summation order."""
import math

import pytest
import torch

from megacoat.ops.attention import causal_attention


def _reference(q, k, v):
    b, s, h, d = q.shape
    rep = h // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(b, s, h * d)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_matches_written_out_attention(kv_heads):
    q = torch.randn(2, 8, 4, 16)
    k, v = torch.randn(2, 8, kv_heads, 16), torch.randn(2, 8, kv_heads, 16)
    torch.testing.assert_close(causal_attention(q, k, v), _reference(q, k, v), rtol=1e-5, atol=1e-6)


def test_a_position_sees_no_later_token():
    q, k, v = torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8)
    k2, v2 = k.clone(), v.clone()
    k2[:, 4:], v2[:, 4:] = torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8)
    torch.testing.assert_close(causal_attention(q, k, v)[:, :4], causal_attention(q, k2, v2)[:, :4])
