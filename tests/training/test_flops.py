from megacoat.model import ModelConfig
from megacoat.training.flops import flops_per_token, matmul_parameters


def test_flops_per_token_matches_a_hand_count():
    # 2 layers, h=64, ffn=96, 4 heads of 16, 2 kv groups (kv width 32), seq 16, vocab 50.
    cfg = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
                      num_query_groups=2, seq_length=16, vocab_size=50)
    per_layer = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 96  # wq wk wv wo + w1 w3 w2 = 30720
    assert matmul_parameters(cfg) == 2 * per_layer + 64 * 50
    # forward: 2 FLOPs per MAC per weight, plus QK^T and AV (2 * s * h MACs each... per token: 2*2*s*h FLOPs);
    # training = 3x forward.
    forward = 2 * (2 * 30720 + 3200) + 2 * 2 * 2 * 16 * 64
    assert flops_per_token(cfg) == 3 * forward == 3 * 2 * (64640) + 3 * 8192
