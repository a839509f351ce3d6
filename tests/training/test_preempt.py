"""Preemption: SIGTERM/SIGUSR1 (what Slurm sends) → save at the next iteration boundary and exit 0; a signal
to one rank stops every rank at the same iteration; --exit-duration-in-mins does the same on a timer."""
import os
import signal
import subprocess
import time

import psutil
import pytest

from tests.training.checkpoint_runs import command, env, losses, run


def _start(tmp_path, argv, ranks=1, port=29620):
    log = tmp_path / "log.json"
    proc = subprocess.Popen(command(argv, log, ranks, port), cwd=tmp_path, env=env(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, log


def _wait_for(proc, text, timeout=300):
    """Read stdout until `text` appears (training has started); return what was read."""
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if text in line:
            return "".join(seen)
    proc.kill()
    raise AssertionError(f"never saw {text!r}:\n" + "".join(seen)[-3000:])


def _check_saved_where_it_stopped(tmp_path, log, out, reason):
    it = losses(log)[-1][0]
    assert 2 <= it < 5000, out
    assert f"exiting at iteration {it}: {reason}" in out, out[-3000:]
    assert (tmp_path / "ckpt" / "latest").read_text() == f"iter_{it:07d}"
    return it


def test_sigterm_saves_at_the_next_iteration_and_exits_zero(tmp_path):
    proc, log = _start(tmp_path, ["--train-iters", "5000", "--save", str(tmp_path / "ckpt")])
    out = _wait_for(proc, "iter      2/5000")
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, (out + rest)[-3000:]
    _check_saved_where_it_stopped(tmp_path, log, out + rest, "received SIGTERM")


def test_exit_duration_saves_and_exits_zero(tmp_path):
    proc = run(tmp_path, ["--train-iters", "100000", "--save", str(tmp_path / "ckpt"),
                          "--exit-duration-in-mins", "0.05"], tmp_path / "log.json")
    it = _check_saved_where_it_stopped(tmp_path, tmp_path / "log.json", proc.stdout,
                                       "--exit-duration-in-mins reached")
    assert it < 100000


@pytest.mark.slow
def test_sigusr1_to_one_rank_stops_both_ranks_at_the_same_iteration(tmp_path):
    proc, log = _start(tmp_path, ["--train-iters", "5000", "--save", str(tmp_path / "ckpt"), "--zero-stage", "1"],
                       ranks=2, port=29621)
    out = _wait_for(proc, "iter      2/5000")
    ranks = {}
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if "pretrain_gpt.py" in " ".join(child.cmdline()):
                ranks[int(child.environ()["RANK"])] = child
        except (psutil.Error, KeyError):
            pass
    assert sorted(ranks) == [0, 1], ranks
    os.kill(ranks[1].pid, signal.SIGUSR1)  # rank 0 never sees a signal: it learns through the all-reduce
    rest, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, (out + rest)[-3000:]
    it = _check_saved_where_it_stopped(tmp_path, log, out + rest, "received")
    files = os.listdir(tmp_path / "ckpt" / f"iter_{it:07d}")
    assert {"rng_rank00000.pt", "rng_rank00001.pt"} <= set(files)
    assert sum(n.startswith("zero_pp_rank_") for n in files) == 2  # both ranks' optimizer partitions
