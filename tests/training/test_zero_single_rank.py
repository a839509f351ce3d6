"""ZeRO-1 with one data-parallel rank skips DeepSpeed's gradient reduction (megacoat/training/zero_single_rank.py):
the weights after several steps equal DeepSpeed's own path bit for bit, the step reads gradients laid flat by
own_graph_gradients in place, and every setting whose boundary does more than reduce keeps DeepSpeed's path."""
import subprocess
import sys

import pytest

from tests.training.checkpoint_runs import env

SCRIPT = r"""
import os, sys, torch, deepspeed
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
deepspeed.init_distributed(dist_backend="gloo")
from megacoat.optim.coat_adamw import CoatAdamW
from megacoat.training.cuda_graph import gradient_groups, own_graph_gradients
from megacoat.training.zero_flat_grads import install_flat_grad_partition
from megacoat.training.zero_master import share_master_partitions
from megacoat.training.zero_single_rank import skip_single_rank_reduction
mode, stage, accum, precision = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 200), torch.nn.GELU(), torch.nn.Linear(200, 8))
bf16 = precision != "fp32"
cfg = {"train_batch_size": 2 * accum, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": accum,
       "bf16": {"enabled": bf16}, "gradient_clipping": 0.05, "zero_allow_untested_optimizer": True,
       # buckets smaller than the gradients, as for a 1.3 B model against DeepSpeed's default of 5e8 elements
       "zero_optimization": {"stage": stage, "reduce_bucket_size": 5000}}
remainder = precision == "bf16-remainder"
if bf16:
    cfg["data_types"] = {"grad_accum_dtype": "fp32" if precision == "bf16-fp32-accum" else "bf16"}
if remainder:  # the trainer's --main-params-dtype bf16-remainder
    cfg["bf16"].update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
opt = (CoatAdamW(model.parameters(), lr=1e-2, param_remainders=remainder) if bf16
       else torch.optim.AdamW(model.parameters(), lr=1e-2))
engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
zo = engine.optimizer
if remainder:
    share_master_partitions(zo)
install_flat_grad_partition(zo)
print("SKIPPED", skip_single_rank_reduction(zo) if mode != "deepspeed" else None)
buckets = []  # the elements of the ZeRO optimizer's reduction buckets, after each setup_buckets (every gradient hook)
setup = getattr(zo, "setup_buckets", None)  # (DeepSpeed's BF16_Optimizer has none)
def watch_buckets():
    setup()
    buckets.append(sum(b.numel() for bucket in zo.ipg_buckets.values() for b in bucket.buffer))
if setup is not None:
    zo.setup_buckets = watch_buckets
views = []
found = getattr(zo, "_get_preflattened_grad_partition", None)
if found is not None:
    def spy(i):
        v = found(i)
        views.append(v is not None)
        return v
    zo._get_preflattened_grad_partition = spy
torch.manual_seed(1)
for step in range(4):
    for micro in range(accum):
        x = torch.randn(2, 64, dtype=torch.bfloat16 if bf16 else torch.float32)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        if mode == "flat" and micro == 0 and accum > 1:
            own_graph_gradients(gradient_groups(engine))  # the trainer's copy out of a CUDA graph's pool
        engine.step()
print("VIEWS", views)
print("BUCKETS", sorted(set(buckets)))
print("NORM", engine.get_global_grad_norm())
print("RESULT", [p.detach().double().sum().item() for p in model.parameters()], loss.item())
torch.distributed.destroy_process_group()  # gloo's threads stopped before exit, as the trainer does
"""


def _run(tmp_path, port, mode, stage, accum, precision):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(port), mode, str(stage), str(accum), precision],
                          cwd=tmp_path, env=env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in proc.stdout.splitlines()
            if line.startswith(("SKIPPED", "VIEWS", "NORM", "RESULT", "BUCKETS"))}


@pytest.mark.slow
@pytest.mark.parametrize("accum", [1, 3])
@pytest.mark.parametrize("precision", ["bf16", "bf16-remainder", "fp32"])
def test_zero1_single_rank_skips_the_reduction_with_the_same_weights(tmp_path, accum, precision):
    base = 29741 + 8 * ["bf16", "bf16-remainder", "fp32"].index(precision) + 4 * (accum == 3)
    ref = _run(tmp_path, base, "deepspeed", 1, accum, precision)
    skip = _run(tmp_path, base + 1, "skip", 1, accum, precision)
    assert skip["SKIPPED"] == "True"
    assert (skip["RESULT"], skip["NORM"]) == (ref["RESULT"], ref["NORM"])  # clipping on: the norm matters too
    # DeepSpeed's own path allocates its bucket (reduce_bucket_size, 5000 here) at every backward; the skip, none
    assert ref["BUCKETS"] == "[5000]" and skip["BUCKETS"] == "[0]"
    if accum > 1:  # the graphed trainer's copy lays the gradients flat: every step reads them in place
        flat = _run(tmp_path, base + 2, "flat", 1, accum, precision)
        assert (flat["RESULT"], flat["NORM"]) == (ref["RESULT"], ref["NORM"])
        assert flat["VIEWS"] == str([True] * 4)


@pytest.mark.slow
@pytest.mark.parametrize("stage, precision", [(2, "bf16"), (1, "bf16-fp32-accum")])
def test_settings_whose_boundary_does_more_keep_deepspeeds_path(tmp_path, stage, precision):
    """ZeRO-2 partitions gradients at every micro-batch; bf16 parameters with fp32 gradient accumulation run
    DeepSpeed's BF16_Optimizer under ZeRO-1, which is not the ZeRO optimizer this changes."""
    out = _run(tmp_path, 29731 + stage, "skip", stage, 2, precision)
    assert out["SKIPPED"] == "False"
    assert out["BUCKETS"] != "[0]"  # DeepSpeed's buckets, as allocated
