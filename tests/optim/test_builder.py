import torch

from megacoat.model import GPT, ModelConfig
from megacoat.optim import OptimizerConfig, build_optimizer, param_groups


def test_norm_weights_do_not_decay_and_tied_weight_counted_once():
    model = GPT(ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=2, vocab_size=40))
    groups = param_groups(model, 0.1)
    decay, no_decay = groups
    assert all(p.dim() == 2 for p in decay["params"]) and decay["weight_decay"] == 0.1
    assert all(p.dim() == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    n = sum(p.numel() for g in groups for p in g["params"])
    assert n == model.cfg.num_parameters()


def test_build_optimizer_uses_config():
    model = torch.nn.Linear(4, 4)
    opt = build_optimizer(param_groups(model, 0.05), OptimizerConfig(lr=3e-4, adam_beta2=0.99), torch.device("cpu"))
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.param_groups[0]["betas"] == (0.9, 0.99) and opt.param_groups[0]["weight_decay"] == 0.05
