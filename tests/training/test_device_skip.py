"""bf16 under ZeRO-1/2 refuses a non-finite step on the device (megacoat/training/device_skip.py): DeepSpeed's step
reads nothing back, a NaN step changes no weight, master or moment, the log and the checkpoint count it, and
--max-skipped-steps still stops the run before a save. On the CPU the device path is taken with CoatAdamW
(--fp8-optimizer), whose reference honours the flag; the CPU's for-each AdamW keeps DeepSpeed's host check."""
import json
import math
import os
import types

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from megacoat.optim.coat_adamw import CoatAdamW
from megacoat.training.device_skip import (DEVICE_SKIP_LINE, SkipCounter, _grad_norm_one_launch, _make_clip_on_device,
                                          honours_found_inf)
from tests.training.checkpoint_runs import records, run
from tests.training.test_trainer import _reads_per_iteration

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
