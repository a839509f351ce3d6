"""Process start-up on CPU: no JIT build of DeepSpeed's shared-memory all-reduce (a minute of silence on a
first run), and a world of one created for plain `python`."""
import os
import subprocess
import sys

from tests.training.checkpoint_runs import ROOT, env

START = """
import importlib
import torch.distributed as dist
from megacoat.training.distributed import init_distributed
device = init_distributed()
cdb = importlib.import_module("deepspeed.comm.comm").cdb
print("device", device, "world", dist.get_world_size(), "shm op", cdb.shm_comm_op)
"""


def test_cpu_start_up_builds_no_shm_comm_op(tmp_path):
    extensions = tmp_path / "torch_extensions"  # empty: a build would have to happen here
    proc = subprocess.run([sys.executable, "-c", START], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=env(tmp_path, TORCH_EXTENSIONS_DIR=str(extensions)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "device cpu world 1 shm op None" in proc.stdout
    assert "built successfully" not in proc.stdout + proc.stderr
    assert not extensions.exists() or not any(os.scandir(extensions))
