"""tools/convert_to_hf.py and tools/convert_checkpoint.py read checkpoint files as data: a crafted file whose
pickle would run a command is refused with one `error:` line naming it, and the command never runs."""
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.tools.conftest import TOOLS
from tests.tools.test_convert_to_hf import CONFIGS, _model, write_checkpoint
from tests.training.checkpoint_runs import env


class Payload:
    """Unpickling calls os.system(command): what a malicious checkpoint file does."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _plant(path, marker):
    torch.save({"module": {"x": torch.zeros(2)}, "payload": Payload(f"touch {marker}")}, path)


def _tool(tmp_path, name, *args):
    return subprocess.run([sys.executable, os.path.join(TOOLS, name), *map(str, args)], env=env(tmp_path),
                          capture_output=True, text=True, timeout=300)


def _refused(proc, path, marker):
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len([line for line in lines if line.startswith("error:")]) == 1, lines
    assert lines[-1].startswith("error: ") and str(path) in lines[-1], lines[-1]
    assert not marker.exists(), "the file's code ran"


@pytest.mark.parametrize("layout", [{}, {"pp": True}], ids=["mp-rank", "pipeline-layer"])
def test_convert_to_hf_refuses_a_file_that_runs_code(tmp_path, layout):
    write_checkpoint(tmp_path / "ckpt", _model(CONFIGS["tied-mha"]), **layout)
    tag = tmp_path / "ckpt" / "iter_0000007"
    path = tag / ("layer_01-model_00-model_states.pt" if layout else "mp_rank_00_model_states.pt")
    marker = tmp_path / "MARKER"
    _plant(path, marker)
    _refused(_tool(tmp_path, "convert_to_hf.py", "--load", tmp_path / "ckpt", "--output", tmp_path / "hf"), path,
             marker)


def _deepspeed_checkpoint(directory):
    """A DeepSpeed-layout megacoat checkpoint of one rank at ZeRO-1 (model states + one optimizer file)."""
    from dataclasses import asdict

    cfg = CONFIGS["tied-mha"]
    tag = directory / "iter_0000002"
    tag.mkdir(parents=True)
    (directory / "latest").write_text("iter_0000002")
    layout = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "data_parallel_size": 1}
    (tag / "megacoat.json").write_text(json.dumps({"iteration": 2, "consumed_samples": 4, "tokenizer": None,
                                                   "layout": layout, "megacoat_config": {"model": asdict(cfg)}}))
    torch.save({"module": {"norm.weight": torch.ones(cfg.hidden_size)},
                "param_shapes": [{"norm.weight": torch.Size([cfg.hidden_size])}]}, tag / "mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": {}}, tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    return tag


@pytest.mark.parametrize("victim", ["mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"])
def test_convert_checkpoint_refuses_a_file_that_runs_code(tmp_path, victim):
    tag = _deepspeed_checkpoint(tmp_path / "ckpt")
    marker = tmp_path / "MARKER"
    _plant(tag / victim, marker)
    _refused(_tool(tmp_path, "convert_checkpoint.py", "--load", tmp_path / "ckpt", "--output", tmp_path / "o"),
             tag / victim, marker)


@pytest.mark.parametrize("damage", ["empty", "truncated", "not-a-dict", "bad-json", "no-config"])
def test_convert_checkpoint_bad_input_is_one_error_line(tmp_path, damage):
    tag = _deepspeed_checkpoint(tmp_path / "ckpt")
    states, meta = tag / "mp_rank_00_model_states.pt", tag / "megacoat.json"
    if damage == "empty":
        states.write_bytes(b"")
    elif damage == "truncated":
        states.write_bytes(states.read_bytes()[:200])
    elif damage == "not-a-dict":
        torch.save([1, 2], states)
    elif damage == "bad-json":
        meta.write_text("{")
    else:
        meta.write_text(json.dumps({"iteration": 2}))
    named = meta if damage in ("bad-json", "no-config") else states
    for tool in ("convert_checkpoint.py", "convert_to_hf.py"):
        proc = _tool(tmp_path, tool, "--load", tmp_path / "ckpt", "--output", tmp_path / "o")
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, (tool, proc.stderr[-2000:])
        lines = proc.stderr.strip().splitlines()
        assert lines[-1].startswith("error: ") and str(named) in lines[-1], (tool, lines)


@pytest.mark.parametrize("damage", ["weights", "config-list", "config-json"])
def test_convert_from_hf_bad_input_is_one_error_line(tmp_path, damage):
    hf = tmp_path / "hf"
    hf.mkdir()
    config = {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 96,
              "num_attention_heads": 4, "max_position_embeddings": 16, "vocab_size": 128, "rms_norm_eps": 1e-5}
    (hf / "config.json").write_text({"config-list": "[1]", "config-json": "{"}.get(damage, json.dumps(config)))
    (hf / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")
    named = hf / ("model.safetensors" if damage == "weights" else "config.json")
    proc = _tool(tmp_path, "convert_from_hf.py", "--hf-dir", hf, "--output", tmp_path / "o")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(named) in lines[0], lines
