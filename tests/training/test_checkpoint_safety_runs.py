"""Checkpoint safety as users meet it: pretrain_gpt.py --load of a real ZeRO-1 checkpoint (CPU, fp32) whose files
were crafted, corrupted or edited stops with one `error:` line naming the file, exit status 1, no traceback, and
nothing in the files runs; an intact checkpoint resumes, and one resumed from without a step is not saved again."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from megacoat.checkpoint.integrity import file_manifest
from tests.training.checkpoint_runs import PRETRAIN, TINY, env

FLAGS = TINY + ["--zero-stage", "1", "--fp32"]
TAG = "iter_0000002"
MODEL, OPTIM, RNG, META = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                           "rng_rank00000.pt", "megacoat.json")


class Evil:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("saved")
    proc = subprocess.run([sys.executable, PRETRAIN, *FLAGS, "--train-iters", "2", "--save", str(d / "ckpt")],
                          cwd=d, env=env(d), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return d / "ckpt"


def _meta(tag_dir, edit):
    path = tag_dir / META
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


def _forge(tag_dir, name, obj):
    """Replace a file and record its checksum, as a forger who also rewrites megacoat.json would."""
    torch.save(obj, tag_dir / name)
    _meta(tag_dir, lambda m: {**m, "files": {**m["files"], **file_manifest(str(tag_dir), [name])}})


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2:len(data) // 2 + 16] = bytes(b ^ 0xFF for b in data[len(data) // 2:len(data) // 2 + 16])
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])


def _unrecorded(tag_dir):  # a checkpoint written before megacoat recorded checksums
    _meta(tag_dir, lambda m: {k: v for k, v in m.items() if k != "files"})


# (what is done to the checkpoint directory `t` (the tag) given the marker path, extra flags, the error's text)
CASES = {
    "rng-crafted": (lambda t, m: _forge(t, RNG, {"python": Evil(m)}), [], f"{RNG}: refused"),
    "model-states-crafted": (lambda t, m: _forge(t, MODEL, {"module": Evil(m)}), [], f"{MODEL}: refused"),
    "optimizer-crafted": (lambda t, m: _forge(t, OPTIM, {"optimizer_state_dict": Evil(m)}), [], f"{OPTIM}: refused"),
    "model-states-flipped": (lambda t, m: _flip(t / MODEL), [], f"{MODEL}: sha256 differs"),
    "model-states-truncated": (lambda t, m: _truncate(t / MODEL), [], f"{MODEL}: "),
    "model-states-empty": (lambda t, m: (t / MODEL).write_bytes(b""), [], f"{MODEL}: 0 bytes, but"),
    "model-states-deleted": (lambda t, m: (t / MODEL).unlink(), [], f"{MODEL}: missing"),
    "optimizer-truncated": (lambda t, m: _truncate(t / OPTIM), [], f"{OPTIM}: "),
    "optimizer-truncated-unrecorded": (lambda t, m: (_unrecorded(t), _truncate(t / OPTIM)), [],
                                       f"{OPTIM}: truncated or corrupted"),
    "model-states-empty-unrecorded": (lambda t, m: (_unrecorded(t), (t / MODEL).write_bytes(b"")), [],
                                      f"{MODEL}: empty"),
    "rng-empty-unrecorded": (lambda t, m: (_unrecorded(t), (t / RNG).write_bytes(b"")), [], f"{RNG}: empty"),
    "rng-not-a-state": (lambda t, m: _forge(t, RNG, [1, 2]), [], f"{RNG}: not an RNG state megacoat saved"),
    "iteration-edited": (lambda t, m: _meta(t, lambda d: {**d, "iteration": 30}), [],
                         "megacoat.json says iteration 30 and 16 consumed samples, but DeepSpeed's model-states file "
                         "says 2 steps and 16 samples"),
    "consumed-samples-edited": (lambda t, m: _meta(t, lambda d: {**d, "consumed_samples": 0}), [],
                                "megacoat.json says iteration 2 and 0 consumed samples"),
    "meta-not-an-object": (lambda t, m: (t / META).write_text("[1, 2]"), [], f"{META}: not a JSON object"),
    "meta-missing-key": (lambda t, m: _meta(t, lambda d: {k: v for k, v in d.items() if k != "consumed_samples"}),
                         [], f"{META}: no 'consumed_samples'"),
    "meta-wrong-type": (lambda t, m: _meta(t, lambda d: {**d, "iteration": "2"}), [],
                        f"{META}: 'iteration' is '2', not a non-negative integer"),
    "meta-model-not-the-weights": (
        lambda t, m: _meta(t, lambda d: {**d, "megacoat_config": {**d["megacoat_config"], "model": {
            **d["megacoat_config"]["model"], "ffn_hidden_size": 192}}}), ["--ffn-hidden-size", "192"],
        "the weights do not fit the model its megacoat.json describes"),
    "latest-outside": (lambda t, m: (t.parent / "latest").write_text("../elsewhere/iter_0000002"), [],
                       "'latest' names '../elsewhere/iter_0000002'; it may name only an iter_N directory inside"),
}
FAST = ("rng-crafted", "iteration-edited")  # one of each kind; the rest run with the slow tests


@pytest.mark.parametrize("case", [c if c in FAST else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_a_bad_checkpoint_is_one_error_line_and_runs_nothing(saved, tmp_path, case):
    change, flags, expected = CASES[case]
    ckpt, marker = tmp_path / "ckpt", tmp_path / "marker"
    shutil.copytree(saved, ckpt)
    change(ckpt / TAG, marker)
    proc = subprocess.run([sys.executable, PRETRAIN, *FLAGS, *flags, "--train-iters", "3", "--load", str(ckpt),
                           "--save", str(ckpt)], cwd=tmp_path, env=env(tmp_path), capture_output=True, text=True,
                          timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Traceback" not in out, out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and expected in lines[0], (expected, out[-3000:])
    assert not marker.exists()  # nothing in the files ran
    assert (ckpt / "latest").read_text() in (TAG, "../elsewhere/iter_0000002")  # nothing saved over it


def test_an_intact_checkpoint_resumes_and_is_not_saved_again_unchanged(saved, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    model = ckpt / TAG / MODEL
    before = model.stat().st_mtime_ns
    argv = [sys.executable, PRETRAIN, *FLAGS, "--load", str(ckpt), "--save", str(ckpt)]
    again = subprocess.run(argv + ["--train-iters", "2"], cwd=tmp_path, env=env(tmp_path), capture_output=True,
                           text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"checkpoint {ckpt / TAG} already holds iteration 2: not saved again" in again.stdout
    assert model.stat().st_mtime_ns == before
    on = subprocess.run(argv + ["--train-iters", "3"], cwd=tmp_path, env=env(tmp_path), capture_output=True,
                        text=True, timeout=600)
    assert on.returncode == 0, on.stdout[-3000:] + on.stderr[-3000:]
    assert f"resumed from {ckpt / TAG} at iteration 2" in on.stdout and (ckpt / "latest").read_text() == \
        "iter_0000003"
    recorded = json.loads((ckpt / "iter_0000003" / META).read_text())["files"]
    assert sorted(os.listdir(ckpt / "iter_0000003")) == sorted([*recorded, META])


FAULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoint_faults.py")


@pytest.mark.slow
@pytest.mark.parametrize("fault, expected", [
    ("disk-full", "writing iter_0000004 failed: No space left on device (torch: [enforce fail at inline_container.cc:"
                  "664] . unexpected pos 4736 vs 4630); the partial save was removed ('latest' still names "
                  "iter_0000002)"),
    ("inf-weights", "refusing to save iteration 4: tok_embeddings.weight holds NaN or Inf ({ckpt}/iter_0000002 is "
                    "kept)")])
def test_a_save_that_cannot_be_made_is_one_line_and_keeps_the_last_checkpoint(tmp_path, fault, expected):
    ckpt = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, FAULTS, fault, "4", *FLAGS, "--train-iters", "4", "--save-interval", "2",
                           "--save", str(ckpt)], cwd=tmp_path, env=env(tmp_path), capture_output=True, text=True,
                          timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Traceback" not in out, out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("error: ")]
    assert lines == [f"error: --save {ckpt}: " + expected.format(ckpt=ckpt)], out[-3000:]
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "latest", "zero_to_fp32.py", "zero_to_torch.py"]
    assert (ckpt / "latest").read_text() == "iter_0000002"
