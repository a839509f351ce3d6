"""benchmarks/parallel/torchtitan_peer.py: what it refuses (one error line), torchao's recipes as torchtitan sets
them, and the FP8 weight all-gather on 2 gloo ranks where torchao is installed (its run through speed.py is
tests/benchmarks/test_parallel_speed.py::test_cpu_run_with_the_fsdp2_peer)."""
import importlib.util

import pytest

from benchmarks.parallel import torchtitan_peer as peer
from tests.benchmarks.conftest import run_module

TINY = ["--num-layers", "2", "--hidden-size", "128", "--ffn-hidden-size", "256", "--num-attention-heads", "4",
        "--seq-length", "64", "--vocab-size", "256", "--fp32", "--mock-data", "--eval-iters", "0"]
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None


@pytest.mark.parametrize("flags, message", [
    (["--coat-fp8"], "error: --fp8-activations/--coat-fp8/--fp8-optimizer"),
    (["--tensor-model-parallel-size", "2"], "error: --tensor-model-parallel-size/--pipeline-model-parallel-size"),
    (["--eval-iters", "2"], "error: --eval-iters"),
])
def test_what_the_peer_does_not_do_is_one_error(flags, message):
    with pytest.raises(SystemExit, match=message):
        peer.main(TINY + flags + ["--float8", "none"])


def test_without_torchao_it_stops_with_one_line(monkeypatch):
    monkeypatch.setattr(peer.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match="^error: torchao is not installed"):
        peer.main(TINY + ["--float8", "rowwise"])


@pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed (extra 'bench')")
def test_recipes_as_torchtitan_sets_them():
    assert peer.float8_config("none", on_cuda=True) is None
    tensorwise = peer.float8_config("tensorwise", on_cuda=True)
    assert tensorwise.enable_fsdp_float8_all_gather and not tensorwise.emulate
    rowwise = peer.float8_config("rowwise", on_cuda=False)
    assert not rowwise.enable_fsdp_float8_all_gather and rowwise.emulate


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed (extra 'bench')")
def test_tensorwise_gathers_every_block_weight_in_fp8(tmp_path):
    proc = run_module("deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(_free_port()), "--module",
                      "benchmarks.parallel.torchtitan_peer", *TINY, "--micro-batch-size", "1", "--global-batch-size",
                      "4", "--train-iters", "2", "--log-interval", "2", "--float8", "tensorwise", "--log-json",
                      str(tmp_path / "log.jsonl"), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "14 float8 linears, 14 weights all-gathered in FP8" in proc.stdout  # 7 linears a block, not the head
    assert '"iteration": 2' in (tmp_path / "log.jsonl").read_text()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
