"""megacoat/training/deepspeed_patches.py: each patch of DeepSpeed's ZeRO-1/2 optimizer gives DeepSpeed's own
result (bit for bit, or to an ulp where documented), is installed only where it applies, and nothing is patched on
a DeepSpeed the patches were not written for.

- the flat gradient partition: the listed gradients are views of one buffer, so the step's flatten copy is skipped;
  `flat_view` refuses anything that is not exactly consecutive pieces of one storage;
- ZeRO-1 on one data-parallel rank: the reduction is skipped with the same weights, gradients laid flat by
  own_graph_gradients are read in place, and a setting whose boundary does more keeps DeepSpeed's path;
- the device skip (bf16): DeepSpeed's step reads nothing back, a NaN step changes no weight, master or moment,
  the log and the checkpoint count it, and --max-skipped-steps still stops the run before a save. On the CPU the
  device path is taken with CoatAdamW (--fp8-optimizer); the CPU's for-each AdamW keeps DeepSpeed's host check.
"""
import json
import math
import os
import subprocess
import sys
import types

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from megacoat.coat.adamw import CoatAdamW
from megacoat.training.deepspeed_patches import (DEVICE_SKIP_LINE, TESTED_DEEPSPEED, SkipCounter,
                                                 _grad_norm_one_launch, _make_clip_on_device,
                                                 deepspeed_version_problem, flat_view, honours_found_inf,
                                                 patch_zero_optimizer)
from tests.training.checkpoint_runs import env, records, run
from tests.training.test_trainer import _reads_per_iteration


# --- the gradient partition read in place ---------------------------------------------------------------

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


FLAT_SCRIPT = r"""
import os, sys, torch, deepspeed
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
deepspeed.init_distributed(dist_backend="gloo")
from megacoat.coat.adamw import CoatAdamW
from megacoat.training.deepspeed_patches import install_flat_grad_partition
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
        proc = subprocess.run([sys.executable, "-c", FLAT_SCRIPT, str(stage), str(port), mode, master], cwd=tmp_path,
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
    from megacoat.coat.adamw import CoatAdamW
    from megacoat.training.deepspeed_patches import install_flat_grad_partition
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


# --- ZeRO-1 on one data-parallel rank ------------------------------------------------------------------

SINGLE_RANK_SCRIPT = r"""
import os, sys, torch, deepspeed
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
deepspeed.init_distributed(dist_backend="gloo")
from megacoat.coat.adamw import CoatAdamW
from megacoat.training.cuda_graph import gradient_groups, own_graph_gradients
from megacoat.training.deepspeed_patches import install_flat_grad_partition
from megacoat.training.deepspeed_patches import share_master_partitions
from megacoat.training.deepspeed_patches import skip_single_rank_reduction
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
    proc = subprocess.run([sys.executable, "-c", SINGLE_RANK_SCRIPT, str(port), mode, str(stage), str(accum), precision],
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


# --- the non-finite check on the device -----------------------------------------------------------------

NAN_RUN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nan_injection.py")
DEVICE_PATH = ["--zero-stage", "1", "--bf16", "--fp8-optimizer"]


def _tensors_but_step(obj, key=""):
    """Every tensor of a nested state in order, leaving out step counts (they move on over a refused step)."""
    if torch.is_tensor(obj):
        return [] if key == "step" else [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in _tensors_but_step(obj[k], str(k))]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors_but_step(v, key)]
    return []


def _checkpoint(ckpt, it):
    folder = ckpt / f"iter_{it:07d}"
    model = torch.load(folder / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    optim = torch.load(folder / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", weights_only=False)
    return model, optim["optimizer_state_dict"]


def test_a_nan_step_is_refused_on_the_device_and_changes_no_weight_master_or_moment(tmp_path):
    ckpt = tmp_path / "ckpt"
    argv = DEVICE_PATH + ["--train-iters", "5", "--save", str(ckpt), "--save-interval", "1"]
    proc = run(tmp_path, argv, tmp_path / "log.json", script=(NAN_RUN, "3"))
    train = {r["iteration"]: r for r in records(tmp_path / "log.json") if "loss" in r}
    assert math.isnan(train[3]["loss"]) and train[3]["skipped_steps"] == 1
    assert all(math.isfinite(train[i]["loss"]) and train[i]["skipped_steps"] == 0 for i in (1, 2, 4, 5))
    assert "iter 3: non-finite loss or gradient, 1 step(s) skipped" in proc.stdout
    (w2, o2), (w3, o3), (w4, _) = (_checkpoint(ckpt, i) for i in (2, 3, 4))
    for name, w in w2.items():
        assert torch.equal(w, w3[name]), name
    assert any(not torch.equal(w, w4[n]) for n, w in w2.items())
    a, b = _tensors_but_step(o2), _tensors_but_step(o3)
    assert len(a) == len(b) and len(a) > 6  # master partitions, FP8 codes, scales, exponents
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert json.loads((ckpt / "iter_0000003" / "megacoat.json").read_text())["skipped_steps"] == 1

    # DeepSpeed's host check refuses the same step: the weights it gives the next step are the same, so
    # iteration 4's loss is too (the LR schedule, which the device path moves on, first shows at iteration 4's step).
    host = tmp_path / "host"
    host.mkdir()
    run(host, DEVICE_PATH + ["--train-iters", "4", "--host-overflow-check"], host / "log.json", script=(NAN_RUN, "3"))
    host_train = {r["iteration"]: r for r in records(host / "log.json") if "loss" in r}
    for i in (1, 2, 4):
        assert host_train[i]["loss"] == train[i]["loss"], i
    assert host_train[4]["lr"] == host_train[3]["lr"] and train[4]["lr"] != train[3]["lr"]


def test_max_skipped_steps_read_at_a_save_stop_the_run_before_it(tmp_path):
    ckpt = tmp_path / "ckpt"
    argv = DEVICE_PATH + ["--train-iters", "8", "--save", str(ckpt), "--save-interval", "1",
                          "--log-interval", "4", "--max-skipped-steps", "3"]
    proc = run(tmp_path, argv, tmp_path / "log.json", check=False, script=(NAN_RUN, "2,3,4"))
    assert proc.returncode != 0
    assert "by iteration 4: 3 steps in a row skipped" in proc.stderr and "--max-skipped-steps 3" in proc.stderr
    assert (ckpt / "latest").read_text() == "iter_0000003"  # the save after the third refusal never happened


def test_deepspeed_step_reads_nothing_back_on_the_device_path(tmp_path):
    common = ["--train-iters", "3", "--log-interval", "3"]
    device = _reads_per_iteration(tmp_path, DEVICE_PATH + common)
    (tmp_path / "host").mkdir()
    host = _reads_per_iteration(tmp_path / "host", DEVICE_PATH + common + ["--host-overflow-check"])
    assert [r for r in host.get(2, []) if "/deepspeed/" in r]  # the recorder sees DeepSpeed's reads
    assert not [r for r in device.get(2, []) if "/deepspeed/" in r]


def test_skip_counter_counts_refusals_and_runs_across_reads():
    c = SkipCounter(torch.device("cpu"))
    for flag in (1, 0, 1, 1):
        c.found_inf.fill_(flag)
        c.record()
    assert c.read() == (3, 2, 2)
    c.found_inf.fill_(1)
    c.record()
    assert c.read() == (1, 3, 3)  # the run that spans the read is counted whole
    c.found_inf.fill_(0)
    c.record()
    assert c.read() == (0, 0, 3)


@pytest.mark.parametrize("make, honours", [
    (lambda p: torch.optim.AdamW([p], fused=True), True),
    (lambda p: torch.optim.AdamW([p]), False),
    (lambda p: CoatAdamW([p]), True),
    (lambda p: torch.optim.SGD([p], lr=0.1), False),
], ids=["fused-adamw", "foreach-adamw", "coat-adamw", "sgd"])
def test_which_optimizers_skip_on_the_flag(make, honours):
    assert honours_found_inf(make(torch.nn.Parameter(torch.zeros(4)))) is honours


@pytest.mark.parametrize("make", [lambda p: torch.optim.AdamW([p], lr=0.1, fused=True), lambda p: CoatAdamW([p])],
                         ids=["fused-adamw", "coat-adamw"])
def test_the_counters_flag_refuses_the_optimizers_step(make):
    """The flag as install_device_skip hands it over (SkipCounter.found_inf) is one the optimizer takes."""
    p = torch.nn.Parameter(torch.randn(300))
    opt = make(p)
    counter = SkipCounter(torch.device("cpu"))
    opt.found_inf = counter.found_inf
    p.grad = torch.randn(300)
    before = p.detach().clone()
    counter.found_inf.fill_(1)
    opt.step()
    assert torch.equal(p.detach(), before)
    counter.found_inf.fill_(0)
    opt.step()
    assert not torch.equal(p.detach(), before)


@pytest.mark.parametrize("make", [lambda p: torch.optim.AdamW([p], lr=0.1, fused=True), lambda p: CoatAdamW([p])],
                         ids=["fused-adamw", "coat-adamw"])
def test_the_clip_factor_goes_to_the_optimizer_as_its_grad_scale(make):
    """The device clip hands the factor over instead of scaling the flat gradients; the optimizer's step on the
    unclipped gradients with that grad_scale is the step on gradients clipped in place (to an ulp for fused AdamW,
    which divides). A norm within the limit clips nothing; without clipping there is no grad_scale."""
    p = torch.nn.Parameter(torch.randn(300))
    opt = make(p)
    found_inf = torch.zeros(())
    zero = types.SimpleNamespace(clip_grad=1.0, loss_scale=1.0)
    clip = types.MethodType(_make_clip_on_device(found_inf, opt), zero)
    grads = torch.randn(300) * 4
    clip([grads.clone()], torch.tensor(5.0))
    assert opt.grad_scale.item() == pytest.approx(5.0 + 1e-6) and found_inf.item() == 0
    p.grad = grads.clone()
    ref = torch.nn.Parameter(p.detach().clone())
    ref.grad = grads.clone().mul_(1.0 / opt.grad_scale)
    opt.step()
    assert torch.equal(p.grad, grads) or isinstance(opt, torch.optim.AdamW)  # CoatAdamW leaves them untouched
    make(ref).step()
    torch.testing.assert_close(p.detach(), ref.detach(), rtol=0, atol=1e-6)
    clip([grads.clone()], torch.tensor(0.5))
    assert opt.grad_scale.item() == 1.0
    clip([grads.clone()], torch.tensor(float("nan")))
    assert found_inf.item() == 1
    zero.clip_grad = 0.0
    clip([grads.clone()], torch.tensor(5.0))
    assert opt.grad_scale is None


class HostBuilt(TorchDispatchMode):
    """Ops that make the GPU wait when they run on CUDA: a tensor built from host data (`torch.tensor`: an H2D
    copy that synchronises), a read back, and a fill with a tensor value (read back to the host)."""

    def __init__(self):
        super().__init__()
        self.found = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if func.overloadpacket.__name__ in ("lift_fresh", "_local_scalar_dense", "item") \
                or name.startswith("aten.masked_fill") and name.endswith(".Tensor"):
            self.found.append(name)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def world_of_one(tmp_path):
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)


@pytest.mark.parametrize("loss_scale", [1.0, 2.0])
def test_the_norm_and_the_clip_make_the_gpu_wait_nowhere(world_of_one, loss_scale):
    """The norm's -1 sentinel and the clip's factor are made on the device. DeepSpeed's own sentinel helper builds
    its -1 on the host and fills with it: two waits per parameter group (seen on the H100 as the step's idle time),
    which this recorder sees on CPU (checked first, so the test can fail)."""
    from deepspeed.runtime.utils import mask_nan_or_inf_with_val_inplace

    norm = torch.tensor([1.0])
    with HostBuilt() as seen:
        mask_nan_or_inf_with_val_inplace(norm)
    assert seen.found == ["aten.lift_fresh.default", "aten.masked_fill_.Tensor"]
    zero = types.SimpleNamespace(model_parallel_rank=0, device=torch.device("cpu"), dp_process_group=None,
                                 _model_parallel_all_reduce=lambda tensor, op: None, clip_grad=1.0,
                                 loss_scale=loss_scale)
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
    found_inf = torch.zeros(())
    client = types.SimpleNamespace(grad_scale=None)
    for grads, norm, inf in (([torch.tensor([3.0, 0.0, 0.0]), torch.tensor([0.0, 4.0])], 5.0, 0),
                             ([torch.tensor([3.0, float("nan"), 0.0]), torch.tensor([0.0, 4.0])], -1.0, 1)):
        with HostBuilt() as seen:
            total = _grad_norm_one_launch(zero, grads, params)
            _make_clip_on_device(found_inf, client)(zero, None, total)
            zero.clip_grad = 0.0  # no clipping: the factor is the loss scale alone (a Python float)
            _make_clip_on_device(found_inf, client)(zero, None, total)
            zero.clip_grad = 1.0
        assert seen.found == []
        assert total.item() == norm and found_inf.item() == inf
        assert (client.grad_scale is None) == (loss_scale == 1.0)


class Seen(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_gradients_in_one_buffer_take_one_reduction_with_the_same_norm(world_of_one):
    zero = types.SimpleNamespace(model_parallel_rank=0, device=torch.device("cpu"), dp_process_group=None,
                                 _model_parallel_all_reduce=lambda tensor, op: None)
    sizes = [(300, 7), (1000,), (13, 17)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in sizes]
    buf = torch.randn(sum(p.numel() for p in params), generator=torch.Generator().manual_seed(0)).bfloat16()
    flat = list(buf.split([p.numel() for p in params]))
    apart = [g.clone() for g in flat]  # the same values, each in its own memory
    norms = {}
    for name, grads in (("flat", flat), ("apart", apart)):
        with Seen() as seen:
            norms[name] = _grad_norm_one_launch(zero, grads, params).item()
        assert ("_foreach_norm" in seen.ops) == (name == "apart")
        assert ("linalg_vector_norm" in seen.ops) == (name == "flat")
    expected = buf.double().square().sum().sqrt().item()
    # fp32 sums of 1,521 squares in two orders: each within a few ulps of the float64 norm
    assert norms["flat"] == pytest.approx(expected, rel=1e-6) and norms["apart"] == pytest.approx(expected, rel=1e-6)
    not_counted = types.SimpleNamespace(**{**vars(zero), "model_parallel_rank": 1})  # TP rank 1 skips replicas
    with Seen() as seen:
        _grad_norm_one_launch(not_counted, flat, params)
    assert "linalg_vector_norm" not in seen.ops  # nothing is counted there: no flat run of the counted ones


@pytest.mark.parametrize("layout", [["--zero-stage", "2"], ["--zero-stage", "1", "--tensor-model-parallel-size", "2"]],
                         ids=["zero2-dp2", "zero1-tp2"])
def test_device_path_gives_the_host_paths_norms_and_losses_on_two_ranks(tmp_path, layout):
    """The one-launch norm counts what DeepSpeed's per-tensor norm counts (TP shards once, reductions over the
    data-parallel and model-parallel groups): same gradient norms, same losses, on two ranks."""
    argv = ["--bf16", "--fp8-optimizer", "--train-iters", "3"] + layout
    logs = {}
    for name, extra, port in (("device", [], 29641), ("host", ["--host-overflow-check"], 29642)):
        (tmp_path / name).mkdir()
        proc = run(tmp_path / name, argv + extra, tmp_path / name / "log.json", ranks=2, port=port)
        assert (DEVICE_SKIP_LINE in proc.stdout) == (name == "device")
        logs[name] = [r for r in records(tmp_path / name / "log.json") if "loss" in r]
    assert len(logs["device"]) == len(logs["host"]) == 3
    for d, h in zip(logs["device"], logs["host"]):
        assert d["loss"] == h["loss"]
        assert d["grad_norm"] == pytest.approx(h["grad_norm"], rel=1e-5)  # summation order differs


@pytest.mark.parametrize("argv, installed", [
    (DEVICE_PATH, True),
    (["--zero-stage", "1", "--fp32", "--fp8-optimizer"], False),  # DeepSpeed reads an fp32 norm on the host anyway
    (DEVICE_PATH + ["--main-grads-dtype", "fp32"], False),  # DeepSpeed's BF16_Optimizer, not the ZeRO optimizer
    (["--zero-stage", "1", "--bf16"], False),  # the CPU's for-each AdamW does not take the flag
], ids=["bf16-zero1-coat", "fp32", "bf16-fp32-grads", "foreach-adamw"])
def test_where_the_device_path_is_taken(tmp_path, argv, installed):
    proc = run(tmp_path, argv + ["--train-iters", "1"], tmp_path / "log.json")
    assert (DEVICE_SKIP_LINE in proc.stdout) is installed

# --- the version check ----------------------------------------------------------------------------------------


def test_the_installed_deepspeed_is_the_one_the_patches_were_written_for():
    import deepspeed

    assert deepspeed.__version__ in TESTED_DEEPSPEED and deepspeed_version_problem() is None


def test_another_deepspeed_patches_nothing_and_says_so_in_one_line():
    """On an untested version the engine's optimizer is left as DeepSpeed made it (a stand-in that fails on any
    attribute access shows nothing is read or replaced), with one warning line naming both versions."""
    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"read {name}")

        def __setattr__(self, name, value):
            raise AssertionError(f"set {name}")

    engine = types.SimpleNamespace(optimizer=Untouchable())
    said = []
    assert patch_zero_optimizer(engine, share_master=True, device_skip=True, log=said.append, version="0.99.0") is None
    assert len(said) == 1 and "\n" not in said[0]
    assert said[0].startswith("warning: deepspeed 0.99.0 ") and TESTED_DEEPSPEED[0] in said[0]


def test_the_tested_deepspeed_installs_the_patches_that_apply():
    """Not a ZeRO-1/2 optimizer (a plain torch optimizer, as DeepSpeed runs for ZeRO-0 in fp32): nothing applies,
    nothing is said, DeepSpeed's host check stays."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    said = []
    engine = types.SimpleNamespace(optimizer=opt)
    assert patch_zero_optimizer(engine, share_master=False, device_skip=True, log=said.append,
                                version=TESTED_DEEPSPEED[0]) is None
    assert said == [] and "found_inf" not in vars(opt)


def test_another_deepspeed_gets_no_zero3_fp8_gather_and_one_line():
    """ZeRO-3's FP8 weight gather replaces DeepSpeed's per-parameter gather: on an untested DeepSpeed the engine is
    not touched and the weights are gathered in bf16, said in one line."""
    from megacoat.training.zero3_fp8_gather import install_fp8_weight_gather

    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"read {name}")

    said = []
    assert install_fp8_weight_gather(Untouchable(), 3, "fp8", log=said.append, version="0.99.0") is None
    assert len(said) == 1 and said[0].startswith("warning: deepspeed 0.99.0 ") and "bf16" in said[0]
    assert install_fp8_weight_gather(Untouchable(), 1, "fp8", log=said.append) is None and len(said) == 1
