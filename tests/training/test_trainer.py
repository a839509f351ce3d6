"""The training loop's own host work: between two log lines, megacoat's trainer reads nothing back from the
device (no `.item()`, `float(t)`, `.tolist()`, `if t:` ...) and nothing synchronizes the device (DeepSpeed's
throughput timer would, twice per micro-batch). On a GPU each such read or synchronize drains the queue: the GPU
then idles while the host catches up with the next launches, which is what makes small micro-batches
host-bound. On the CPU they cost nothing, but they are the same Python calls, so counting them here guards the
GPU path. The run is the benchmarks' configuration (bf16, ZeRO-1) in its own process (it initialises
torch.distributed), with every read attributed to the first caller outside torch."""
import json
import subprocess
import sys

from tests.training.checkpoint_runs import ROOT, TINY, env

RECORDER = r"""
import collections, json, sys
import torch
from deepspeed.accelerator import get_accelerator
import megacoat.training.trainer as trainer
from megacoat.arguments import parse_config

READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__format__", "cpu", "numpy")
step = {"iteration": 0}
reads = collections.defaultdict(list)


def caller():
    frame = sys._getframe(2)
    while frame is not None and "/torch/" in frame.f_code.co_filename:
        frame = frame.f_back
    return "?" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"


def recording(name):
    original = getattr(torch.Tensor, name)

    def read(self, *args, **kwargs):
        reads[step["iteration"]].append(caller())
        return original(self, *args, **kwargs)
    return read


for name in READS:
    setattr(torch.Tensor, name, recording(name))
accelerator = type(get_accelerator())
device_synchronize = accelerator.synchronize


def synchronize(self, *args, **kwargs):
    reads[step["iteration"]].append("synchronize@" + caller())
    return device_synchronize(self, *args, **kwargs)


accelerator.synchronize = synchronize
train_step = trainer.Trainer.train_step


def counted_step(self, data_iter):
    step["iteration"] = self.state.iteration + 1  # reads until the next step are this one's (its log included)
    return train_step(self, data_iter)


trainer.Trainer.train_step = counted_step
trainer.pretrain(parse_config(sys.argv[1:]))
print("READS " + json.dumps(reads))
"""


def _reads_per_iteration(tmp_path, argv) -> dict[int, list[str]]:
    proc = subprocess.run([sys.executable, "-c", RECORDER, *TINY, *argv, "--log-json", str(tmp_path / "log.json")],
                          cwd=tmp_path, env=env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("READS "))
    return {int(k): v for k, v in json.loads(line[len("READS "):]).items()}


def test_steps_between_log_lines_read_nothing_back_from_the_device(tmp_path):
    reads = _reads_per_iteration(tmp_path, ["--bf16", "--zero-stage", "1", "--train-iters", "6",
                                            "--log-interval", "3"])
    ours = {it: [r for r in rs if "/megacoat/training/" in r] for it, rs in reads.items() if it > 0}
    assert ours.get(3) and ours.get(6), ours  # the recorder sees the log's reads: this test can fail
    quiet = {it: rs for it, rs in ours.items() if it % 3}
    assert not any(quiet.values()), quiet
    syncs = {it: [r for r in rs if r.startswith("synchronize@")] for it, rs in reads.items() if it % 3}
    assert not any(syncs.values()), syncs
    # What DeepSpeed's ZeRO-1 bf16 step reads by itself (its overflow check and clipping), for the record.
    deepspeed = [r for r in reads.get(2, []) if "/deepspeed/" in r]
    print(f"DeepSpeed's reads in a step: {len(deepspeed)}: {sorted(set(deepspeed))}")
