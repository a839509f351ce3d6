"""pretrain_gpt.py --coat-fp8 with --pipeline-model-parallel-size 2 on CPU ranks (gloo, fp32) against the one-rank
run of the same flags: under PP the default recipe keeps delayed scaling and the FP8 head (on the last stage, and
vocabulary-parallel under TP), and both give the one-stage run's numbers.

Same data, same global batch of 4 micro-batches (a stage runs forwards ahead of its backwards), same initial
weights. The first step's amax entries are bit for bit the one-rank run's (the same calls in the same order, same
weights); after it the stages differ from one rank only in the order of fp32 sums (the tied embedding's gradient is
summed across the stages), ~1e-7 relative, so we require 1e-5 on every entry and every logged loss. The GPU test
does the same in bf16 on two GPUs."""
import glob
import os
import socket

import pytest
import torch

from megacoat.coat.delayed_scaling import HISTORY_KEY
from tests.training.checkpoint_runs import losses, run

ITERS, MICRO_BATCHES = 3, 4
ARGV = ["--train-iters", str(ITERS), "--zero-stage", "1", "--coat-fp8", "--global-batch-size", str(4 * MICRO_BATCHES),
        "--save-interval", str(ITERS)]
SITES = ("swiglu_grad_scale", "qkv_grad_scale", "qkv_norm_out_scale", "mlp_norm_out_scale", "swiglu_out_scale",
         "wo_in_scale")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def histories(save_dir, pipelined: bool) -> dict[str, torch.Tensor]:
    """{"layers.<i>.<site>": history} from the last checkpoint: the one-rank model state, or the pipeline's layer
    files (layer 0 the embedding, layer i + 1 block i)."""
    tag = os.path.join(save_dir, f"iter_{ITERS:07d}")
    if not pipelined:
        state = torch.load(os.path.join(tag, "mp_rank_00_model_states.pt"), weights_only=False)["module"]
        return {k.removesuffix("." + HISTORY_KEY): v for k, v in state.items() if k.endswith(HISTORY_KEY)}
    found = {}
    for path in glob.glob(os.path.join(tag, "layer_*-model_00-model_states.pt")):
        block = int(os.path.basename(path)[len("layer_"):][:2]) - 1
        for k, v in torch.load(path, weights_only=False).items():
            if k.endswith(HISTORY_KEY):
                found[f"layers.{block}.{k.removeprefix('block.').removesuffix('.' + HISTORY_KEY)}"] = v
    return found


def compare_with_one_rank(tmp_path, argv, rel=1e-5, first_step_rel=0.0, loss_rel=1e-5, first_step_grad_rel=None):
    """PP=2 against one rank: amax entries within rel, the first step's within first_step_rel (gradient sites':
    first_step_grad_rel, if given), losses loss_rel."""
    one = run(tmp_path, argv + ["--save", str(tmp_path / "one")], tmp_path / "one.json")
    pp = run(tmp_path, argv + ["--save", str(tmp_path / "pp"), "--pipeline-model-parallel-size", "2"],
             tmp_path / "pp.json", ranks=2, port=free_port())
    for proc in (one, pp):
        assert "with delayed scaling" in proc.stdout and "the output layer in FP8 too" in proc.stdout, proc.stdout
    assert "x PP 2" in pp.stdout
    a, b = losses(tmp_path / "pp.json"), losses(tmp_path / "one.json")
    assert [i for i, _ in a] == [i for i, _ in b] == list(range(1, ITERS + 1))
    for (i, x), (_, y) in zip(a, b):
        assert x == pytest.approx(y, rel=loss_rel), (i, x, y)
    h_one, h_pp = histories(tmp_path / "one", False), histories(tmp_path / "pp", True)
    assert sorted(h_one) == sorted(h_pp) == sorted(f"layers.{i}.{s}" for i in range(2) for s in SITES)
    first_step = slice((ITERS - 1) * MICRO_BATCHES, ITERS * MICRO_BATCHES)  # most recent first
    for name, h in h_one.items():
        assert h[:ITERS * MICRO_BATCHES].gt(0).all(), name  # one entry per micro-batch
        first = first_step_grad_rel if first_step_grad_rel is not None and "_grad_" in name else first_step_rel
        torch.testing.assert_close(h_pp[name][first_step], h[first_step], rtol=first, atol=0,
                                   msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(h_pp[name], h, rtol=rel, atol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("head", ["tied", "untied"])
def test_pipeline_keeps_delayed_scaling_and_the_fp8_head_of_one_stage(tmp_path, head):
    """tied: the last stage's copy of the embedding serves the FP8 head (its FP8 weight copy refreshed there after
    each step); untied: the head's own Fp8Linear on the last stage."""
    argv = ARGV + ["--fp32"] + (["--untie-embeddings-and-output-weights"] if head == "untied" else [])
    compare_with_one_rank(tmp_path, argv)


@pytest.mark.slow
def test_tp2_pp2_trains_with_the_vocab_parallel_fp8_head_on_the_last_stage(tmp_path):
    """4 ranks: the default recipe keeps delayed scaling and the FP8 head (vocabulary-parallel, tied to the first
    stage's embedding shard) under TP=2 x PP=2. Per-shard E4M3 scales round other values than one rank's (as in
    tests/parallel/test_tensor_parallel.py), so the losses agree within 2^-6 relative, not bit for bit."""
    argv = ARGV[:-2] + ["--fp32", "--hidden-size", "128", "--ffn-hidden-size", "256"]  # shards: multiples of 16
    run(tmp_path, argv, tmp_path / "one.json")
    proc = run(tmp_path, argv + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
               tmp_path / "tp_pp.json", ranks=4, port=free_port())
    assert "parallel: TP 2 x PP 2" in proc.stdout
    assert "with delayed scaling" in proc.stdout and "the output layer in FP8 too" in proc.stdout
    a, b = losses(tmp_path / "tp_pp.json"), losses(tmp_path / "one.json")
    assert [i for i, _ in a] == [i for i, _ in b] == list(range(1, ITERS + 1))
    for (i, x), (_, y) in zip(a, b):
        assert x == pytest.approx(y, rel=2 ** -6), (i, x, y)


@pytest.mark.slow
def test_a_micro_batch_the_fp8_gemms_cannot_take_is_one_error_line_on_every_stage(tmp_path):
    """Refused at start-up on every rank, instead of by the first forward on one stage in the middle of a step."""
    argv = ["--coat-fp8", "--fp32", "--seq-length", "30", "--micro-batch-size", "1", "--global-batch-size", "4",
            "--pipeline-model-parallel-size", "2"]
    proc = run(tmp_path, argv, tmp_path / "bad.json", ranks=2, port=free_port(), check=False)
    assert proc.returncode != 0
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "error:" in line]
    assert lines and all("--micro-batch-size 1 x --seq-length 30 = 30 tokens" in line for line in lines), lines
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.multigpu
def test_gpu_pipeline_histories_equal_one_stage_in_bf16(tmp_path):
    """Two GPUs, bf16, NCCL: PP=2 against one GPU. The first step's entries differ only by the order of GPU sums
    (attention's backward, the tied gradient): 2^-7 relative, two bf16 roundings, at the activation sites. A
    gradient site's amax is that of a GEMM of an E5M2 gradient, where one bf16 rounding apart can flip a code by a
    quarter (two mantissa bits): 2^-4 there. After a step Adam can turn a
    flipped bf16 rounding of a near-zero gradient into a full update of that weight: 5% on later entries and 1% on
    the losses, far below what a misplaced entry moves (a step's amaxes differ by tens of percent)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    compare_with_one_rank(tmp_path, ARGV + ["--bf16", "--main-params-dtype", "fp32"], rel=5e-2, first_step_rel=2 ** -7,
                          loss_rel=1e-2, first_step_grad_rel=2 ** -4)


@pytest.mark.multigpu
def test_gpu_pipeline_with_cuda_graphs_equals_it_without(tmp_path):
    """Two GPUs, PP=2, bf16, the FP8 default compiled: --enable-cuda-graph (each stage's blocks captured per
    micro-batch slot, megacoat/parallel/stage_graphs.py) against the same run without graphs. A replay runs the
    compiled call's kernels on the same data, so every loss and every amax history entry is equal bit for bit;
    the captures happen in the first step (after 3 eager calls a block) and the later steps replay them."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    argv = ARGV + ["--bf16", "--compile", "--pipeline-model-parallel-size", "2"]
    runs = {}
    for name, extra in (("plain", []), ("graphs", ["--enable-cuda-graph"])):
        runs[name] = run(tmp_path, argv + extra + ["--save", str(tmp_path / name)], tmp_path / f"{name}.json",
                         ranks=2, port=free_port())
    assert losses(tmp_path / "plain.json") == losses(tmp_path / "graphs.json")
    plain, graphs = histories(tmp_path / "plain", True), histories(tmp_path / "graphs", True)
    assert sorted(plain) == sorted(graphs) and plain
    for name in plain:
        assert torch.equal(plain[name], graphs[name]), name
