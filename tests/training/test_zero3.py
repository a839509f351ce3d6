"""--zero-stage 3 (DeepSpeed's stage 3) with CoatAdamW and the COAT flow: the flags and their errors, the weights
the fused functions read outside their modules, and on 2 CPU gloo ranks (fp32) training against ZeRO-1, exact
resume, and resuming ZeRO-3 checkpoints on ZeRO-1 and back through the layout-free form.

Tolerance against ZeRO-1. Both runs start from the same weights and read the same batches; the forward and
backward see whole weights either way (ZeRO-3 gathers them), so the first loss agrees to fp32 rounding. The
gradients are reduced in another order (reduce-scatter per parameter against ZeRO-1's bucketed all-reduce),
1e-5 relative at most. CoatAdamW's FP8 groups of 128 run along each rank's partition: ZeRO-1 partitions each
group's flat buffer in two, ZeRO-3 each parameter, so the moments are grouped differently and each step's update
differs by up to ~1.5 u relative (E4M3, u = 2^-4), which moves the loss by at most that fraction of how much it
has moved so far: tests.training.test_checkpoint_reshard.within_fp8_moment_error, the same bound as a resume on
another layout, which regroups the moments once as well.

Every parameter is partitioned: the DeepSpeed config sets stage3_param_persistence_threshold 0 (its default keeps
parameters under 100k elements whole on every rank, which would be all of the tiny model's).
"""
import json
import os

import pytest
import torch

from megacoat.arguments import parse_config
from megacoat.config import check_cuda_graph
from megacoat.model import GPT
from megacoat.model.config import ModelConfig
from megacoat.coat import RECIPES, convert_to_coat
from megacoat.training.deepspeed_config import build_deepspeed_config
from megacoat.training.zero3 import weights_read_outside_their_module
from tests.parallel.test_pretrain_parallel import free_port
from tests.training.checkpoint_runs import ROOT, losses, run, same_sequence
from tests.training.test_checkpoint_reshard import report, within_fp8_moment_error

ITERS, SAVE_AT = 20, 10
BASE = ["--train-iters", str(ITERS), "--fp32", "--coat-fp8"]


def _zero3(tmp):
    path = tmp / "zero3.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}))
    return ["--zero-stage", "3", "--deepspeed_config", str(path)]


# --- flags -----------------------------------------------------------------------------------------------------
def test_zero3_takes_no_fp8_weight_copies_and_writes_stage_3():
    cfg = parse_config(["--coat-fp8", "--zero-stage", "3"])
    assert cfg.fp8.weight_cache == "none" and cfg.parallel.zero3_weight_gather == "bf16"
    assert build_deepspeed_config(cfg, 2, on_cuda=False)["zero_optimization"]["stage"] == 3
    assert cfg.optim.main_params_dtype is None or cfg.optim.main_params_dtype == "fp32"
    assert parse_config(["--coat-fp8", "--zero-stage", "1"]).fp8.weight_cache == "rowwise"


@pytest.mark.parametrize("argv, line", [
    (["--pipeline-model-parallel-size", "2"], "error: --zero-stage 3 does not support --pipeline-model-parallel-size"),
    (["--tensor-model-parallel-size", "2"], "error: --zero-stage 3 does not support --tensor-model-parallel-size"),
    (["--coat-fp8", "--fp8-weight-cache", "rowwise"], "error: --fp8-weight-cache rowwise keeps a full FP8 copy"),
    (["--fp8-optimizer", "--bf16", "--main-params-dtype", "bf16-remainder"],
     "error: --main-params-dtype bf16-remainder needs --zero-stage 1 or 2"),
])
def test_unsupported_combinations_are_one_error_line(capsys, argv, line):
    with pytest.raises(SystemExit) as e:
        parse_config(["--zero-stage", "3", "--num-layers", "2", *argv])
    assert e.value.code == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(line), err


def test_cuda_graphs_refuse_zero3():
    cfg = parse_config(["--zero-stage", "3"])
    with pytest.raises(ValueError, match="--enable-cuda-graph does not support --zero-stage 3"):
        check_cuda_graph(cfg.parallel, cuda_available=True)


# --- the weights read outside their modules ---------------------------------------------------------------------
def test_weights_read_outside_their_module_are_those_of_modules_that_never_run():
    cfg = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, seq_length=32,
                      vocab_size=256)
    model = convert_to_coat(GPT(cfg), RECIPES["coat"].for_layout(vocab_size=256, hidden_size=64))
    pairs = weights_read_outside_their_module(model)
    names = {id(p): n for n, p in model.named_parameters()}
    got = sorted(names[id(p)] for _, p in pairs)
    per_block = ["attention.wk.weight", "attention.wq.weight", "attention.wv.weight", "attention_norm.weight",
                 "feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight", "ffn_norm.weight"]
    # the FP8 head reads the tied output weight, which the embedding owns
    assert got == sorted([f"layers.{i}.{n}" for i in range(2) for n in per_block] + ["tok_embeddings.weight"])
    readers = {type(r).__name__ for r, _ in pairs}
    assert readers == {"CoatTransformerBlock", "Fp8Head"}


# --- 2 gloo ranks ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """ZeRO-1 and ZeRO-3 over 2 ranks, ITERS steps, a checkpoint at SAVE_AT: (checkpoint dir, losses) per stage."""
    out = {}
    for stage in ("zero1", "zero3"):
        tmp = tmp_path_factory.mktemp(stage)
        flags = _zero3(tmp) if stage == "zero3" else ["--zero-stage", "1"]
        run(tmp, BASE + flags + ["--save", str(tmp / "ckpt"), "--save-interval", str(SAVE_AT)], tmp / "log.json",
            ranks=2, port=free_port())
        out[stage] = (tmp / "ckpt", losses(tmp / "log.json"), flags)
    return out


@pytest.mark.slow
def test_zero3_fp8_follows_zero1_fp8(runs):
    ckpt, zero3, _ = runs["zero3"]
    _, zero1, _ = runs["zero1"]
    assert [i for i, _ in zero3] == list(range(1, ITERS + 1))
    assert zero3[0][1] == pytest.approx(zero1[0][1], rel=1e-6)
    assert within_fp8_moment_error(zero3, zero1), report(zero3, zero1)
    # the weights were partitioned: the model-state files hold none of them
    module = torch.load(ckpt / f"iter_{ITERS:07d}" / "zero_pp_rank_0_mp_rank_00_model_states.pt",
                        weights_only=False)["module"]
    assert all(t.numel() == 0 for n, t in module.items() if n.endswith("weight")), {n: t.shape for n, t in module.items()}


@pytest.mark.slow
def test_zero3_resumes_exactly(runs, tmp_path):
    ckpt, full, flags = runs["zero3"]
    proc = run(tmp_path, BASE + _zero3(tmp_path) + ["--load", str(ckpt / f"iter_{SAVE_AT:07d}")],
               tmp_path / "log.json", ranks=2, port=free_port())
    assert f"at iteration {SAVE_AT}" in proc.stdout and "layout changed" not in proc.stdout
    assert same_sequence(losses(tmp_path / "log.json"), full[SAVE_AT:]), (losses(tmp_path / "log.json"), full)


@pytest.mark.slow
@pytest.mark.parametrize("source, target", [("zero3", "zero1"), ("zero1", "zero3")])
def test_zero3_checkpoints_resume_on_zero1_and_back(runs, tmp_path, source, target):
    ckpt, ref, _ = runs[source]
    flags = _zero3(tmp_path) if target == "zero3" else ["--zero-stage", "1"]
    proc = run(tmp_path, BASE + flags + ["--load", str(ckpt / f"iter_{SAVE_AT:07d}")], tmp_path / "log.json",
               ranks=2, port=free_port())
    stages = {"zero1": 1, "zero3": 3}
    assert f"zero_stage {stages[source]} -> {stages[target]}" in proc.stdout, proc.stdout[-2000:]
    assert f"resumed from {ckpt / f'iter_{SAVE_AT:07d}' / 'layout_free'} at iteration {SAVE_AT}" in proc.stdout
    got = losses(tmp_path / "log.json")
    assert [i for i, _ in got] == list(range(SAVE_AT + 1, ITERS + 1))
    assert within_fp8_moment_error(got, ref), report(got, ref)


@pytest.mark.slow
def test_fp8_weight_gather_sends_one_byte_a_weight_and_trains_as_the_bf16_gather(tmp_path):
    """--zero3-weight-gather fp8 against bf16 (the default), 6 steps on 2 ranks, every all-gather's bytes counted
    (tests/training/count_gathers.py). The losses are the same bit for bit: each shard's E4M3 codes, made with the
    whole GEMM's agreed amax, are the codes the bf16 gather's weight cache makes from the gathered weight. Every
    element of a block GEMM weight that the bf16 gather sent as 4 bytes (these runs are fp32) the FP8 gather sends
    as 1; the rest (norms, embedding) is gathered as before; and the FP8 bytes are whole gathers of this rank's
    shards of those weights."""
    counter = (os.path.join(ROOT, "tests", "training", "count_gathers.py"),)
    sent, logs = {}, {}
    for gather in ("fp8", "bf16"):
        out = tmp_path / gather
        out.mkdir()
        argv = ["--train-iters", "6", "--fp32", "--coat-fp8", *_zero3(tmp_path), "--zero3-weight-gather", gather]
        run(out, argv, out / "log.json", ranks=2, port=free_port(), script=counter, GATHER_COUNT_DIR=str(out))
        sent[gather] = [json.loads((out / f"gathers_rank{r}.json").read_text()) for r in range(2)]
        logs[gather] = losses(out / "log.json")
    assert same_sequence(logs["fp8"], logs["bf16"]), logs
    # this rank's shard of the block GEMM weights: ceil(n / 2) elements of each (2 layers of the tiny model)
    shard = 2 * sum(-(-n // 2) for n in (64 * 64,) * 4 + (128 * 64,) * 3)
    for fp8, bf16 in zip(sent["fp8"], sent["bf16"]):
        assert set(bf16) == {"float32"} and fp8["uint8"] > 0
        assert bf16["float32"] - fp8["float32"] == 4 * fp8["uint8"]
        assert fp8["uint8"] % shard == 0


@pytest.mark.multigpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gpu_zero3_fp8_gather_trains_as_the_bf16_gather_and_follows_zero1(tmp_path, compiled):
    """Two GPUs, NCCL, bf16, the coat default (eager, and compiled as the benchmarks run ZeRO-3: no CUDA graphs).
    The FP8 and bf16 gathers train bit for bit alike (the shards' codes are the whole weight's, the CPU test's
    argument). Against ZeRO-1 (its default rowwise cache and remainder master: the same codes and the same
    fp32-master update) the first loss is the same forward; later ones differ by the moments' regrouping and by
    bf16 gradients reduced in another order, which in 10 steps of the tiny model stays within 1%."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    argv = ["--train-iters", "10", "--bf16", "--coat-fp8"] + (["--compile"] if compiled else [])
    runs = {"fp8": _zero3(tmp_path) + ["--zero3-weight-gather", "fp8"],
            "bf16": _zero3(tmp_path) + ["--zero3-weight-gather", "bf16"], "zero1": ["--zero-stage", "1"]}
    logs = {}
    for name, flags in runs.items():
        run(tmp_path, argv + flags, tmp_path / f"{name}.json", ranks=2, port=free_port())
        logs[name] = losses(tmp_path / f"{name}.json")
    assert same_sequence(logs["fp8"], logs["bf16"]) and len(logs["fp8"]) == 10, logs
    assert logs["fp8"][0][1] == pytest.approx(logs["zero1"][0][1], rel=2 ** -10)
    for (_, a), (_, b) in zip(logs["fp8"], logs["zero1"]):
        assert a == pytest.approx(b, rel=1e-2)
