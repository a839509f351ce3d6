"""megacoat.checkpoint.from_deepspeed on --bf16 runs (CPU, gloo): DeepSpeed's `bf16_zero_pp_rank_*` optimizer files
are read, and the layout-free weights are the master, never the bf16 copy: the fp32 partition (AdamW, CoatAdamW
with --main-params-dtype fp32) or the bf16 partition joined with CoatAdamW's remainders (bf16-remainder). A layout
change (ZeRO-1 -> 2, 2 -> 1) resumes and converts with each master."""
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from megacoat.checkpoint.sharding import plain_name
from megacoat.ops.param_remainder import join_fp32, split_fp32
from tests.parallel.test_pretrain_parallel import free_port
from tests.tools.conftest import TOOLS, load_tool
from tests.training.checkpoint_runs import env, losses, run

MASTERS = {"adamw": ["--bf16"],
           "coat-fp32": ["--bf16", "--fp8-optimizer", "--main-params-dtype", "fp32"],
           "coat-remainder": ["--bf16", "--fp8-optimizer", "--main-params-dtype", "bf16-remainder"]}
TAG = "iter_0000003"


def master_of(tag_dir, num_layers=2) -> dict[str, torch.Tensor]:
    """The fp32 master of every parameter, read straight from DeepSpeed's files (one model-parallel rank)."""
    pieces: dict[str, list] = {}
    for path in sorted(tag_dir.glob("bf16_zero_pp_rank_*_mp_rank_00_optim_states.pt"),
                       key=lambda p: int(p.name.split("_")[4])):
        sd = torch.load(path, weights_only=False)["optimizer_state_dict"]
        for i, mapping in enumerate(sd["param_slice_mappings"]):
            part = sd["single_partition_of_fp32_groups"][i]
            rem = sd["base_optimizer_state"]["state"][i].get("remainder")
            full = part if rem is None else join_fp32(part, rem)
            assert full.dtype == torch.float32
            for name, a in mapping.items():
                pieces.setdefault(plain_name(name, num_layers), []).append(full.narrow(0, a.start, a.numel))
    return {k: torch.cat(v) for k, v in pieces.items()}


@pytest.fixture(scope="module", params=list(MASTERS))
def saved(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    run(tmp, ["--train-iters", "3", "--zero-stage", "1", "--save", str(tmp / "ckpt")] + MASTERS[request.param],
        tmp / "log.json")
    return request.param, tmp / "ckpt" / TAG


def test_bf16_checkpoint_converts_with_the_master_as_its_weights(saved, tmp_path):
    master, tag_dir = saved
    assert (tag_dir / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").is_file()
    meta = json.loads((tag_dir / "megacoat.json").read_text())
    assert meta["layout"]["main_params_dtype"] == ("bf16-remainder" if master == "coat-remainder" else "fp32")
    tool = load_tool("convert_checkpoint")
    assert tool.main(["--load", str(tag_dir), "--output", str(tmp_path / "free")]) == 0
    assert tool.main(["--load", str(tag_dir), "--output", str(tmp_path / "w"), "--weights-only"]) == 0
    out = tmp_path / "free" / TAG
    free = json.loads((out / "megacoat.json").read_text())
    assert free["optimizer"]["kind"] == ("adamw" if master == "adamw" else "coat")
    assert free["optimizer"]["keys"] == ["exp_avg", "exp_avg_sq"] and free["optimizer"]["step"] == 3
    assert json.loads((tmp_path / "w" / TAG / "megacoat.json").read_text())["optimizer"] is None

    weights, weights_only = load_file(out / "model.safetensors"), load_file(tmp_path / "w" / TAG / "model.safetensors")
    module = torch.load(tag_dir / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    want = master_of(tag_dir)
    assert set(weights) == set(want) == set(weights_only)
    for name, w in weights.items():
        assert w.dtype == torch.float32
        assert torch.equal(w.reshape(-1), want[name]) and torch.equal(weights_only[name], w), name
        # the bf16 weights the run used are the master rounded as the run rounds it
        rounded = split_fp32(w)[0] if master == "coat-remainder" else w.to(torch.bfloat16)
        assert torch.equal(rounded, module[name]), name
    # the master carries more than the bf16 copy: a conversion from the bf16 weights would fail here
    assert any(not torch.equal(w, module[n].float()) for n, w in weights.items())


def test_hf_export_of_a_bf16_run(saved, tmp_path):
    """--dtype fp32 exports the master, --dtype bf16 the bf16 weights the run computed with, both exactly."""
    from megacoat.checkpoint.hf_llama import from_hf_state_dict
    from megacoat.model.config import ModelConfig

    _, tag_dir = saved
    tool = load_tool("convert_to_hf")
    cfg = ModelConfig(**json.loads((tag_dir / "megacoat.json").read_text())["megacoat_config"]["model"])
    module = torch.load(tag_dir / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    want = master_of(tag_dir)
    for dtype in ("fp32", "bf16"):
        assert tool.main(["--load", str(tag_dir), "--output", str(tmp_path / dtype), "--dtype", dtype]) == 0
        back = from_hf_state_dict(cfg, load_file(tmp_path / dtype / "model.safetensors"))
        for name, w in back.items():
            expect = want[name].view(w.shape) if dtype == "fp32" else module[name].float()
            assert torch.equal(w, expect), (dtype, name)


def test_unreadable_optimizer_file_is_an_error_naming_it(saved, tmp_path):
    import shutil

    _, tag_dir = saved
    copy = tmp_path / TAG
    shutil.copytree(tag_dir, copy)
    bad = copy / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    bad.write_bytes(bad.read_bytes()[:1000])
    proc = subprocess.run([sys.executable, f"{TOOLS}/convert_checkpoint.py", "--load", str(copy), "--output",
                           str(tmp_path / "o")], capture_output=True, text=True, timeout=300, env=env(tmp_path))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and str(bad) in last, last


# --- layout changes on two ranks ------------------------------------------------------------------------------
ITERS, SAVE_AT = 6, 3


def _two_ranks(tmp, argv, log):
    return run(tmp, ["--train-iters", str(ITERS)] + argv, log, ranks=2, port=free_port())


@pytest.mark.slow
@pytest.mark.parametrize("master", list(MASTERS))
def test_layout_change_of_a_bf16_run(tmp_path, master):
    """ZeRO-1 -> 2 by resuming (the losses follow the uninterrupted run), 2 -> 1 by tools/convert_checkpoint.py
    (exact: the same partitions, so the same CoatAdamW groups), and the ZeRO-2 files convert back to the master."""
    flags = MASTERS[master]
    _two_ranks(tmp_path, ["--zero-stage", "1"] + flags, tmp_path / "full.json")
    _two_ranks(tmp_path, ["--zero-stage", "1", "--save", str(tmp_path / "z1"), "--exit-interval", str(SAVE_AT)]
               + flags, tmp_path / "z1.json")
    proc = _two_ranks(tmp_path, ["--zero-stage", "2", "--load", str(tmp_path / "z1"), "--save", str(tmp_path / "z2")]
                      + flags, tmp_path / "z2.json")
    assert "checkpoint layout changed: zero_stage 1 -> 2" in proc.stdout, proc.stdout[-2000:]
    full, resumed = dict(losses(tmp_path / "full.json")), losses(tmp_path / "z2.json")
    assert [i for i, _ in resumed] == list(range(SAVE_AT + 1, ITERS + 1))
    for i, x in resumed:  # bf16 runs: ZeRO-1 and ZeRO-2 reduce gradients in another order
        assert x == pytest.approx(full[i], rel=2e-3), (i, x, full[i])

    tool = load_tool("convert_checkpoint")
    tag = f"iter_{ITERS:07d}"
    assert tool.main(["--load", str(tmp_path / "z2"), "--output", str(tmp_path / "a")]) == 0
    proc = subprocess.run([sys.executable, f"{TOOLS}/convert_checkpoint.py", "--load", str(tmp_path / "a"), "--output",
                           str(tmp_path / "back"), "--data-parallel-size", "2", "--zero-stage", "1", "--"] + flags,
                          env=env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "back" / tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").is_file()
    assert tool.main(["--load", str(tmp_path / "back"), "--output", str(tmp_path / "b")]) == 0
    for name in ("model", "optim.exp_avg", "optim.exp_avg_sq"):
        a, b = (load_file(tmp_path / d / tag / f"{name}.safetensors") for d in ("a", "b"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    weights = load_file(tmp_path / "a" / tag / "model.safetensors")
    want = master_of(tmp_path / "z2" / tag)
    assert all(torch.equal(w.reshape(-1), want[n]) for n, w in weights.items())
