"""pretrain_gpt.py with --tensor-model-parallel-size / --pipeline-model-parallel-size / --sequence-parallel on
CPU ranks (gloo, fp32), against the one-rank run of the same flags.

Same data, same global batch, same initial weights: the runs differ only in the order of floating-point sums
(row-parallel all-reduces, per-stage accumulation), ~1e-7 relative per step in fp32; over 8 Adam steps we
require 1e-5 relative on each logged loss (far inside bf16's 2^-8)."""
import socket

import pytest

from tests.training.checkpoint_runs import losses, records, run

ITERS = 8
BASE = ["--train-iters", str(ITERS), "--fp32"]
ARGV = BASE + ["--zero-stage", "1"]


def free_port() -> int:
    """A port nobody listens on now: fixed ports collide with other launches on a shared machine."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _close(a, b, rel=1e-5):
    assert [i for i, _ in a] == [i for i, _ in b], (a, b)
    for (i, x), (_, y) in zip(a, b):
        assert x == pytest.approx(y, rel=rel), (i, x, y)


def grad_norms(log) -> list[tuple[int, float]]:
    """DeepSpeed's global gradient norm per step: TP shards counted on every rank, replicated norms once,
    the tied embedding once across the two stages; any double counting shows as a different norm."""
    return [(r["iteration"], r["grad_norm"]) for r in records(log) if "loss" in r]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one_rank")
    run(tmp, ARGV, tmp / "one.json")
    return tmp / "one.json"


@pytest.mark.slow
def test_pipeline_two_stages_untied_matches_one_rank(tmp_path):
    """Untied head: the last stage holds `output` itself (the tied case is the TP x PP test below)."""
    argv = ARGV + ["--untie-embeddings-and-output-weights"]
    run(tmp_path, argv, tmp_path / "one.json")
    proc = run(tmp_path, argv + ["--pipeline-model-parallel-size", "2"], tmp_path / "pp.json", ranks=2, port=free_port())
    assert "parallel: TP 1 x PP 2 x DP 1" in proc.stdout
    one = losses(tmp_path / "one.json")
    _close(losses(tmp_path / "pp.json"), one)
    assert one[-1][1] < one[0][1]


@pytest.mark.slow
def test_tp2_pp2_sequence_parallel_trains_checkpoints_and_resumes(tmp_path, one_rank):
    """4 ranks: TP=2 (sequence parallel) x PP=2 (tied embedding across the stages). Stop at iteration 4 with a
    checkpoint (each rank its layer shards and ZeRO partition), resume in a new launch: the whole sequence
    still follows the one-rank run, so the shards were saved and loaded where they belong."""
    argv = ARGV + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel",
                   "--save", str(tmp_path / "ckpt")]
    log = tmp_path / "tp_pp.json"
    first = run(tmp_path, argv + ["--exit-interval", str(ITERS // 2)], log, ranks=4, port=free_port())
    assert "parallel: TP 2 x PP 2 x DP 1, sequence parallel" in first.stdout
    assert f"exiting at iteration {ITERS // 2}" in first.stdout
    shards = sorted(p.name for p in (tmp_path / "ckpt" / f"iter_{ITERS // 2:07d}").iterdir() if p.name.startswith("layer_"))
    # DeepSpeed writes one file per layer and TP rank: the tied embedding/head once (layer 00), 2 blocks, norm.
    assert shards == [f"layer_{i:02d}-model_{m:02d}-model_states.pt" for i in range(4) for m in range(2)]
    second = run(tmp_path, argv + ["--load", str(tmp_path / "ckpt")], log, ranks=4, port=free_port())
    assert f"resumed from {tmp_path / 'ckpt' / f'iter_{ITERS // 2:07d}'}" in second.stdout
    _close(losses(log), losses(one_rank))
    _close(grad_norms(log), grad_norms(one_rank), rel=1e-4)


@pytest.mark.slow
def test_tp2_with_data_parallel_zero2_matches_one_rank(tmp_path, one_rank):
    """TP=2 x DP=2 (4 ranks) under ZeRO-2: DeepSpeed partitions gradients and optimizer state over the DP
    group of each TP rank, and its gradient norm counts each shard once."""
    log = tmp_path / "tp_dp.json"
    proc = run(tmp_path, BASE + ["--zero-stage", "2", "--tensor-model-parallel-size", "2"], log, ranks=4, port=free_port())
    assert "parallel: TP 2 x PP 1 x DP 2" in proc.stdout and "ZeRO-2" in proc.stdout
    _close(losses(log), losses(one_rank))
    _close(grad_norms(log), grad_norms(one_rank), rel=1e-4)


def test_bad_split_is_refused_with_the_numbers(tmp_path):
    proc = run(tmp_path, ARGV + ["--tensor-model-parallel-size", "3"], tmp_path / "bad.json", check=False)
    assert proc.returncode != 0
    assert "world size 1 is not divisible by --tensor-model-parallel-size 3" in proc.stderr + proc.stdout
