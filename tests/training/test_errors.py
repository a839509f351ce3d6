"""Bad input stops pretrain_gpt.py with one `error:` line naming the flag or file, exit status 1 on every rank
and no Python traceback (megacoat/training/errors.py); --debug / MEGACOAT_DEBUG=1 show the traceback."""
import os
import subprocess
import sys

import numpy as np
import pytest

from megacoat.data.indexed_dataset import IndexedDatasetWriter
from megacoat.training.errors import error_line, one_line_errors
from tests.training.checkpoint_runs import PRETRAIN, TINY, env

# --- the context manager --------------------------------------------------------------------------------------


def test_input_errors_become_one_line_and_exit_1(capsys, monkeypatch):
    monkeypatch.delenv("MEGACOAT_DEBUG", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(SystemExit) as e, one_line_errors():
        raise ValueError("--vocab-size 8 is too small\n  for data.bin")
    assert e.value.code == 1
    assert capsys.readouterr().err == "error: --vocab-size 8 is too small for data.bin\n"
    with pytest.raises(SystemExit), one_line_errors():
        raise FileNotFoundError(2, "No such file or directory", "x.idx")
    assert "x.idx" in capsys.readouterr().err


def test_other_ranks_stay_quiet_and_bugs_and_debug_keep_the_traceback(capsys, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(SystemExit) as e, one_line_errors():
        raise ValueError("same on every rank")
    assert e.value.code == 1 and capsys.readouterr().err == ""
    with pytest.raises(KeyError), one_line_errors():  # not an input error: a bug keeps its traceback
        raise KeyError("bug")
    with pytest.raises(ValueError), one_line_errors(debug=True):
        raise ValueError("shown with its traceback")
    monkeypatch.setenv("MEGACOAT_DEBUG", "1")
    with pytest.raises(ValueError), one_line_errors():
        raise ValueError("shown with its traceback")


def test_error_line_keeps_an_existing_prefix():
    assert error_line(ValueError("error: x")) == "error: x"


# --- pretrain_gpt.py as users run it ---------------------------------------------------------------------------
def _write_shard(prefix, documents=200, high=256, seed=0):
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(str(prefix), np.uint16) as w:
        for _ in range(documents):
            w.add_document(rng.integers(0, high, 40))
    return str(prefix)


def _tokenizer(path, vocab_size=300):
    from megacoat.data.tokenizer import train_sentencepiece
    from tests.data.conftest import make_documents

    return train_sentencepiece(make_documents(300), str(path), vocab_size=vocab_size)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Shards (good, truncated, corrupt, foreign, too small, ids beyond the vocabulary), a tokenizer larger
    than the model's vocabulary and a real one-iteration checkpoint of the TINY model."""
    d = tmp_path_factory.mktemp("inputs")
    good = _write_shard(d / "good")
    raw_bin, raw_idx = open(good + ".bin", "rb").read(), bytearray(open(good + ".idx", "rb").read())
    for name, bin_bytes, idx_bytes in (
            ("truncated", raw_bin[:-6], raw_idx),
            ("corrupt", raw_bin, raw_idx[:-8]),
            ("magic", raw_bin, b"NOTMMIDX\x00" + raw_idx[9:])):
        (d / f"{name}.bin").write_bytes(bin_bytes)
        (d / f"{name}.idx").write_bytes(bytes(idx_bytes))
    _write_shard(d / "small", documents=10)
    _write_shard(d / "wide", high=300)
    _tokenizer(d / "tok.model")
    (d / "empty").mkdir()
    (d / "other").mkdir()
    (d / "other" / "notes.txt").write_text("not a checkpoint")
    ckpt = d / "ckpt"
    proc = subprocess.run([sys.executable, PRETRAIN, *TINY, "--train-iters", "1", "--zero-stage", "0", "--fp32",
                           "--save", str(ckpt)], cwd=d, env=env(d), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return d


def _data(d, name):
    return [a for a in TINY if a != "--mock-data"] + ["--data-path", str(d / name), "--eval-iters", "1"]


# (flags, the text the one error line must hold); {d} is the inputs directory.
CASES = {
    "truncated-bin": (lambda d: _data(d, "truncated"), "truncated.bin: holds 15994 bytes but"),
    "corrupt-idx": (lambda d: _data(d, "corrupt"), "corrupt.idx: 4034 bytes, but its header"),
    "wrong-magic": (lambda d: _data(d, "magic"), "magic.idx: not a Megatron indexed dataset index"),
    "load-missing": (lambda d: TINY + ["--load", str(d / "nope")], f"--load {{d}}{os.sep}nope: no such directory"),
    "load-empty": (lambda d: TINY + ["--load", str(d / "empty")], "empty: no checkpoint in this directory"),
    "load-not-a-checkpoint": (lambda d: TINY + ["--load", str(d / "other")], "other: no checkpoint in this"),
    "other-model": (lambda d: TINY + ["--load", str(d / "ckpt"), "--hidden-size", "128", "--fp32",
                                 "--zero-stage", "0"],
                    "the checkpoint's model differs from the flags (field: (saved, now)): {'hidden_size': (64, 128)}"),
    "other-optimizer": (lambda d: TINY + ["--load", str(d / "ckpt"), "--fp8-optimizer", "--fp32",
                                     "--zero-stage", "0"],
                        "optimizer state is not this run's: fp8_optimizer: saved False, now True"),
    "tp-above-world": (lambda d: TINY + ["--tensor-model-parallel-size", "2"],
                       "world size 1 is not divisible by --tensor-model-parallel-size 2"),
    "vocab-below-tokenizer": (lambda d: _data(d, "good") + ["--tokenizer-model", str(d / "tok.model")],
                              "--vocab-size 256 is smaller than the tokenizer's vocabulary (300"),
    "vocab-below-data": (lambda d: _data(d, "wide"), "--vocab-size 256 is too small for"),
    "small-data-default-split": (lambda d: _data(d, "small"),
                                 "--split 969,30,1: the valid split of"),
}


def _check_one_error_line(out: str, expected: str) -> str:
    assert "Traceback" not in out, out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, out[-3000:]
    assert expected in lines[0], (expected, lines[0])
    assert "megacoat run:" not in out  # stopped before the model was built
    return lines[0]


FAST = ("truncated-bin", "load-empty", "other-model")  # one of each kind in the fast subset (-m "not slow")


@pytest.mark.parametrize("case", [c if c in FAST else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_bad_input_one_rank(inputs, case):
    argv, expected = CASES[case]
    proc = subprocess.run([sys.executable, PRETRAIN, *argv(inputs)], cwd=inputs, env=env(inputs),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    _check_one_error_line(proc.stdout + proc.stderr, expected.replace("{d}", str(inputs)))


def test_debug_shows_the_traceback(inputs):
    argv, _ = CASES["truncated-bin"]
    proc = subprocess.run([sys.executable, PRETRAIN, *argv(inputs), "--debug"], cwd=inputs, env=env(inputs),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "IndexFormatError" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("case, port", [("truncated-bin", 29721), ("other-model", 29722),
                                        ("vocab-below-data", 29723), ("tp-above-world", 29724)])
def test_bad_input_two_ranks_every_rank_exits_1(inputs, case, port):
    """Two CPU ranks (gloo) started as DeepSpeed's launcher starts them, so that each rank's exit status is
    seen: both exit 1, the first rank of the node prints the one line, no rank prints a traceback."""
    argv, expected = CASES[case]
    argv = argv(inputs)
    if case == "tp-above-world":
        argv, expected = TINY + ["--tensor-model-parallel-size", "4"], \
            "world size 2 is not divisible by --tensor-model-parallel-size 4"
    procs = []
    for rank in range(2):
        e = env(inputs, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, PRETRAIN, *argv], cwd=inputs, env=e, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [1, 1], outs
    _check_one_error_line(outs[0] + outs[1], expected.replace("{d}", str(inputs)))
    assert not any(line.startswith("error: ") for line in outs[1].splitlines())  # rank 1 stays quiet


@pytest.mark.slow
def test_bad_input_through_the_deepspeed_launcher(inputs):
    """`deepspeed --num_gpus 2` (two CPU ranks): the launcher exits non-zero, one error line, no traceback."""
    argv, expected = CASES["truncated-bin"]
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", "29725",
           PRETRAIN, *argv(inputs)]
    proc = subprocess.run(cmd, cwd=inputs, env=env(inputs), capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    _check_one_error_line(proc.stdout + proc.stderr, expected)
