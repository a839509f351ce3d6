"""--distributed-timeout-minutes (issue 60, point 7): a stopped rank ends the others after the timeout, in every
process group (the default one and those DeepSpeed builds, ZeRO's data-parallel group included), not after
torch's 30-minute default."""
import os
import subprocess
import sys
import time

import pytest

from tests.training.checkpoint_runs import ROOT, TINY, env, launcher

GROUP_RANK = """
import os, sys, time
import torch
import torch.distributed as dist
import deepspeed.comm as ds_comm
from megacoat.training.distributed import init_distributed
init_distributed(0.05)  # 3 s
group = ds_comm.new_group([0, 1])  # how ZeRO and the pipeline grid make theirs
if dist.get_rank() == 1:
    time.sleep(120)  # never joins the collective
    sys.exit(0)
start = time.monotonic()
try:
    dist.all_reduce(torch.ones(1), group=group)
except RuntimeError as e:
    print(f"failed after {time.monotonic() - start:.1f} s: {e}", flush=True)
    os._exit(3)  # not sys.exit: tearing down a timed-out gloo group can abort the interpreter ("terminate called")
"""


@pytest.mark.slow
def test_groups_deepspeed_builds_take_the_timeout(tmp_path):
    """DeepSpeed's `new_group` alone would wait torch's 30 minutes (DEEPSPEED_TIMEOUT does not reach it)."""
    base = env(tmp_path, MASTER_ADDR="127.0.0.1", MASTER_PORT="29653", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    procs = [subprocess.Popen([sys.executable, "-c", GROUP_RANK], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=dict(base, RANK=str(r), LOCAL_RANK=str(r)))
             for r in (0, 1)]
    try:
        out, _ = procs[0].communicate(timeout=90)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert procs[0].returncode == 3, out
    seconds = float(out.split("failed after ")[1].split(" s")[0])
    assert 2.5 <= seconds < 30, out


@pytest.mark.slow
def test_a_stopped_rank_ends_the_run_with_one_line(tmp_path):
    """Two ranks train with ZeRO-1; rank 1 stops (SIGSTOP) before iteration 3. Rank 0 waits in the step's
    collectives for --distributed-timeout-minutes (6 s), then says so in one line and the launcher ends the job."""
    script = os.path.join(ROOT, "tests", "training", "stop_rank.py")
    cmd = launcher(2, 29655) + [script] + TINY + [
        "--train-iters", "6", "--zero-stage", "1", "--distributed-timeout-minutes", "0.1"]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=tmp_path, env=env(tmp_path, STOP_RANK_AT="1:3"), capture_output=True, text=True,
                          timeout=400)
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "rank 1 stops before iteration 3" in out
    errors = [line for line in out.splitlines() if "error:" in line]
    assert errors == ["error: a collective waited --distributed-timeout-minutes 0.1 for another rank, which stopped "
                      "or hung (its own output says why); this rank stops"], out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert elapsed < 300, elapsed  # start-up, two steps and the 6 s wait; torch's default would be 30 minutes
