"""Tensor (and sequence) parallelism on 2 CPU ranks against the single-rank model built from the same seed.

fp32 on CPU: a TP run differs from TP=1 only in the order of floating-point sums (the row-parallel all-reduce
splits each contraction in two), so loss and gradients agree to ~1e-6 relative; we require 1e-5 (gradients:
norm-wise relative error over each parameter's shard). The FP8 modes quantize with per-shard scales, so they
are compared with the single-rank FP8 run at FP8 tolerance (see test_fp8_modes_match_single_rank)."""
import pytest
import torch

from tests.coat.recipes import recipe_of
from megacoat.coat.convert import convert_to_coat
from megacoat.coat.delayed_scaling import DelayedScale
from megacoat.model import GPT
from megacoat.model.config import ModelConfig
from megacoat.parallel.config import ParallelConfig
from megacoat.parallel.state import check_parallel_sizes, initialize_parallel_state
from megacoat.parallel.tensor_parallel import apply_tp
from tests.parallel.dist_helpers import run_ranks

TINY = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, seq_length=32,
            vocab_size=256)
FP8_TINY = dict(TINY, hidden_size=128, ffn_hidden_size=256)  # shards stay multiples of 16 for FP8 GEMMs


def _batch(cfg: ModelConfig, batch: int = 2, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_length), generator=g)
    labels[0, :5] = -100  # padding must be ignored the same way
    return tokens, labels


def _shard_of(full: torch.Tensor, p: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    if getattr(p, "tensor_model_parallel", False):
        return full.chunk(tp, p.partition_dim)[rank]
    return full


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _tp_case(model_kw: dict, sequence_parallel: bool, fp8_mode: str | None, scaling: str = "current"):
    import torch.distributed as dist

    cfg = ModelConfig(**model_kw)
    fp8 = (recipe_of(mode=fp8_mode, group_size=64, grad_scaling=scaling, activation_scaling=scaling)
           if fp8_mode else None)
    tokens, labels = _batch(cfg)
    torch.manual_seed(0)
    ref = GPT(cfg)
    if fp8 is not None:
        convert_to_coat(ref, fp8)
    torch.manual_seed(0)
    model = GPT(cfg)
    tp = dist.get_world_size()
    state = initialize_parallel_state(ParallelConfig(tensor_model_parallel_size=tp,
                                                     sequence_parallel=sequence_parallel), cfg)
    if fp8 is not None:
        convert_to_coat(model, fp8)  # FP8 first, on the full model; apply_tp shards what it finds
    apply_tp(model, state)
    assert type(model) is GPT  # apply_tp swaps modules and the loss, never the model's class
    if fp8_mode == "coat":
        assert all(block.region.group is state.tp_group for block in model.layers)
    if scaling == "delayed":  # one step on another batch first: the measured one scales by the recorded amaxes
        for m in (ref, model):
            m(*_batch(cfg, seed=8)).backward()
            m.zero_grad(set_to_none=True)
            histories = [s.amax_history for s in m.modules() if isinstance(s, DelayedScale)]
            assert len(histories) == 6 * cfg.num_layers and all(h[0] > 0 for h in histories)  # 6 sites a block
    ref_loss = ref(tokens, labels)
    ref_loss.backward()
    loss = model(tokens, labels)
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        grads[name] = _rel(p.grad, _shard_of(ref.get_parameter(name).grad, p, state.tp_rank, tp))
    with torch.no_grad():
        logits_err = _rel(model(tokens), ref(tokens))
    return loss.item(), ref_loss.item(), grads, logits_err


def _all_cases(cases):
    return {_key(case): _tp_case(*case[1:]) for case in cases}


BF16_CASES = [("bf16", dict(TINY, num_query_groups=groups), sp, None) for groups in (None, 2) for sp in (False, True)]
FP8_CASES = [(mode, FP8_TINY, sp, mode) for mode in ("fp8-linear", "coat") for sp in (False, True)]
# coat with delayed scaling at both sites: each TP rank keeps the histories of its own shards
FP8_CASES += [("coat-delayed", FP8_TINY, sp, "coat", "delayed") for sp in (False, True)]


@pytest.fixture(scope="module")
def two_rank_results():
    """Every case in one pair of processes: starting ranks (DeepSpeed's import) costs more than the cases."""
    per_rank = run_ranks(2, _all_cases, BF16_CASES + FP8_CASES)
    return {key: [r[key] for r in per_rank] for key in per_rank[0]}


def _key(case):
    return f"{case[0]}-groups{case[1].get('num_query_groups')}-sp{case[2]}"


@pytest.mark.slow
@pytest.mark.parametrize("case", BF16_CASES, ids=_key)
def test_tp2_matches_tp1(two_rank_results, case):
    for loss, ref_loss, grads, logits_err in two_rank_results[_key(case)]:
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert logits_err < 1e-5
        assert len(grads) == 2 + 2 * 9  # embedding (= the tied head), final norm; per block 2 norms + 7 linears
        for name, err in grads.items():
            assert err < 1e-5, (name, err)


@pytest.mark.slow
@pytest.mark.parametrize("case", FP8_CASES, ids=_key)
def test_fp8_modes_match_single_rank(two_rank_results, case):
    """Per-shard scales change which FP8 values each shard rounds to; both runs approximate the same fp32
    math with E4M3 forward (u = 2^-4) and E5M2 gradients (u = 2^-3). The loss (an average over 64 tokens of
    smooth functions of the GEMMs) agrees far inside u; gradients to within 2u = 0.25 norm-wise."""
    for loss, ref_loss, grads, logits_err in two_rank_results[_key(case)]:
        assert loss == pytest.approx(ref_loss, rel=2 ** -6)
        assert logits_err < 2 ** -4
        for name, err in grads.items():
            assert err < 0.25, (name, err)


def test_sizes_are_checked_with_the_numbers():
    cfg = ModelConfig(**TINY)
    with pytest.raises(ValueError, match="world size 6 is not divisible by .* 4"):
        check_parallel_sizes(6, ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), cfg)
    with pytest.raises(ValueError, match=r"--num-attention-heads \(4\) .* \(8\)"):
        check_parallel_sizes(8, ParallelConfig(tensor_model_parallel_size=8), cfg)
    with pytest.raises(ValueError, match=r"--num-query-groups \(2\)"):
        check_parallel_sizes(4, ParallelConfig(tensor_model_parallel_size=4),
                             ModelConfig(**dict(TINY, num_query_groups=2)))
    with pytest.raises(ValueError, match=r"--vocab-size \(255\)"):
        check_parallel_sizes(2, ParallelConfig(tensor_model_parallel_size=2), ModelConfig(**dict(TINY, vocab_size=255)))
    with pytest.raises(ValueError, match=r"--num-layers \(3\) .* \(2\)"):
        check_parallel_sizes(2, ParallelConfig(pipeline_model_parallel_size=2), ModelConfig(**dict(TINY, num_layers=3)))
    with pytest.raises(ValueError, match="--zero-stage 2 with --pipeline-model-parallel-size 2"):
        check_parallel_sizes(2, ParallelConfig(pipeline_model_parallel_size=2, zero_stage=2), cfg)
    assert check_parallel_sizes(8, ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), cfg) == 2
