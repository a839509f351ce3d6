"""DeepSpeed's ZeRO-1/2 step reads its gradient partition in place (megacoat/training/zero_flat_grads.py): the
listed gradients are views of one contiguous buffer, so the step's flatten copy is skipped, and the result is the
same bit for bit. `flat_view` refuses anything that is not exactly consecutive pieces of one storage."""
import subprocess
import sys

import pytest
import torch

from megacoat.training.zero_flat_grads import flat_view
from tests.training.test_main_params_grads import env


def test_flat_view_of_consecutive_pieces_is_the_buffer():
    buf = torch.arange(20.0)
    pieces = [buf[0:6].view(2, 3), buf[6:10], buf[10:20].view(5, 2)]
    flat = flat_view(pieces, 20)
    assert flat is not None and flat.data_ptr() == buf.data_ptr() and torch.equal(flat, buf)
    flat[7] = -1.0  # a view, not a copy
    assert buf[7] == -1.0
    tail = flat_view([buf[4:10], buf[10:12]], 8)  # a partition that starts inside the buffer
    assert tail is not None and torch.equal(tail, buf[4:12])


@pytest.mark.parametrize("pieces, numel", [
    (lambda b: [b[0:6], b[7:10]], 9),                  # a gap
    (lambda b: [b[6:10], b[0:6]], 10),                 # out of order
    (lambda b: [b[0:6], torch.zeros(4)], 10),          # a piece in another storage (DeepSpeed's zero padding)
    (lambda b: [b[0:6], b[6:10]], 12),                 # does not cover the partition
    (lambda b: [b[0:8].view(2, 4).t(), b[8:10]], 10),  # not contiguous
    (lambda b: [b[0:6], b[6:10].to(torch.float64)], 10),
    (lambda b: [], 0),
])
def test_flat_view_refuses_what_is_not_one_run_of_memory(pieces, numel):
    assert flat_view(pieces(torch.arange(20.0)), numel) is None


SCRIPT = r"""
import os, sys, torch, deepspeed
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
deepspeed.init_distributed(dist_backend="gloo")
from megacoat.optim.coat_adamw import CoatAdamW
from megacoat.training.zero_flat_grads import install_flat_grad_partition
remainder = sys.argv[4] == "remainder"
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 200), torch.nn.GELU(), torch.nn.Linear(200, 8))
bf16 = {"enabled": True}
if remainder:
    bf16.update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
# buckets smaller than the gradients, as for a 1.3 B model against DeepSpeed's default of 5e8 elements
zero = {"stage": int(sys.argv[1]), "reduce_bucket_size": 5000}
cfg = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "bf16": bf16,
       "data_types": {"grad_accum_dtype": "bf16"}, "zero_optimization": zero, "zero_allow_untested_optimizer": True}
opt = CoatAdamW(model.parameters(), lr=1e-2, param_remainders=remainder)
engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
zo = engine.optimizer
views = []
if sys.argv[3] == "flat":
    assert install_flat_grad_partition(zo)
    found = zo._get_preflattened_grad_partition
    def spy(i):
        first = zo.averaged_gradients[i][0]
        v = found(i)
        views.append(v is not None and v.untyped_storage().data_ptr() == first.untyped_storage().data_ptr())
        return v
    zo._get_preflattened_grad_partition = spy
x = torch.randn(2, 64).bfloat16()
for _ in range(6):
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
print("VIEWS", views)
print("RESULT", [p.detach().float().sum().item() for p in model.parameters()], loss.item())
"""


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("master", ["fp32", "remainder"])
def test_step_reads_the_partition_in_place_with_the_same_result(tmp_path, stage, master):
    out = {}
    for i, mode in enumerate(("flat", "copy")):
        port = 29671 + 4 * stage + 2 * (master == "remainder") + i
        proc = subprocess.run([sys.executable, "-c", SCRIPT, str(stage), str(port), mode, master], cwd=tmp_path,
                              env=env(tmp_path), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        out[mode] = {line.split(" ", 1)[0]: line for line in proc.stdout.splitlines()
                     if line.startswith(("RESULT", "VIEWS"))}
    # ZeRO-1 lists the reduced gradients in their buffer's order: every step reads the buffer itself. ZeRO-2 fills
    # its partition in backward's (reversed) order, so its list is not one run and DeepSpeed's flatten stays.
    assert out["flat"]["VIEWS"] == "VIEWS " + str([stage == 1] * 3)
    assert out["flat"]["RESULT"] == out["copy"]["RESULT"]


TWO_RANKS = r"""
import os, sys, torch, deepspeed
import torch.multiprocessing as mp


def main(rank):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    deepspeed.init_distributed(dist_backend="gloo")
    from megacoat.optim.coat_adamw import CoatAdamW
    from megacoat.training.zero_flat_grads import install_flat_grad_partition
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 200), torch.nn.GELU(), torch.nn.Linear(200, 8))
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"},
           "zero_optimization": {"stage": 1, "reduce_bucket_size": 5000}, "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=CoatAdamW(model.parameters(), lr=1e-2), config=cfg)
    zo = engine.optimizer
    views = []
    if sys.argv[2] == "flat":
        install_flat_grad_partition(zo)
        found = zo._get_preflattened_grad_partition
        zo._get_preflattened_grad_partition = lambda i: views.append(found(i) is not None) or found(i)
    x = torch.randn(2, 64).bfloat16() + rank
    for _ in range(6):
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    with open(f"{sys.argv[2]}_rank{rank}.txt", "w") as f:  # one file per rank: their prints would interleave
        f.write(f"{views} {[p.detach().float().sum().item() for p in model.parameters()]}")
    # gloo's threads must stop before the process exits, or one rank can abort in teardown (SIGABRT)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(main, nprocs=2)
"""


@pytest.mark.slow
def test_zero1_partitions_of_two_ranks_are_read_in_place_too(tmp_path):
    """Each rank's ZeRO-1 partition (parameters cut at its edges) is one run of the reduced-gradient buffer: read
    in place on both ranks, with the weights of DeepSpeed's own flatten."""
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    out = {}
    for i, mode in enumerate(("flat", "copy")):
        proc = subprocess.run([sys.executable, str(script), str(29691 + i), mode], cwd=tmp_path, env=env(tmp_path),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        out[mode] = [(tmp_path / f"{mode}_rank{r}.txt").read_text() for r in (0, 1)]
    assert all(line.startswith("[True, True, True] ") for line in out["flat"])  # 6 micro-batches: 3 steps
    assert [line[len("[True, True, True] "):] for line in out["flat"]] == [line[len("[] "):] for line in out["copy"]]
