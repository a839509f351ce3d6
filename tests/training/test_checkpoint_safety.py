"""Checkpoint safety without a model (a fake DeepSpeed engine, one gloo rank): nothing in a checkpoint runs as
code, a re-save or a failed save never loses the last complete checkpoint, non-finite state is never saved,
altered files are refused, `latest` cannot lead out of the directory, --keep-last prunes only its own run."""
import errno
import json
import os

import pytest
import torch
import torch.distributed as dist

from megacoat.checkpoint.integrity import CheckpointFileError, safe_torch_load
from megacoat.training import checkpointing as ckpt
from megacoat.training.checkpointing import Layout, TrainState
from megacoat.training.stability import NonFiniteTrainingError

LAYOUT = Layout(world_size=1, data_parallel_size=1, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                zero_stage=0, fp8_optimizer=False)
CONFIG = {"model": {"hidden_size": 64, "num_layers": 2}}


@pytest.fixture(scope="module", autouse=True)
def world_of_one(tmp_path_factory):
    if not dist.is_initialized():
        store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield


class Evil:
    """Unpickling it would write `marker`: what a crafted checkpoint file does."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


class EvilShell(Evil):
    """The same through a shell command (torch words this refusal differently from exec's)."""

    def __reduce__(self):
        return os.system, (f"echo ran > {self.marker}",)


class FakeEngine:
    """DeepSpeed's save/load surface (DIR/TAG/model.pt through its checkpoint engine) with a model, an optimizer
    and DeepSpeed's step and sample counters."""

    def __init__(self, value=0.0):
        self.module = torch.nn.Linear(2, 2)
        with torch.no_grad():
            self.module.weight.fill_(value)
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=0.1)
        self.checkpoint_engine = None
        self.loaded, self.saves, self.global_steps, self.global_samples = None, 0, 0, 0

    def save_checkpoint(self, directory, tag, client_state, save_latest):
        self.saves += 1
        os.makedirs(os.path.join(directory, tag), exist_ok=True)
        meta = client_state["megacoat"]
        torch.save({"value": float(self.module.weight.detach()[0, 0]), "global_steps": meta["iteration"],
                    "global_samples": meta["consumed_samples"]}, os.path.join(directory, tag, "model.pt"))

    def load_checkpoint(self, directory, tag):
        path = os.path.join(directory, tag, "model.pt")
        sd = self.checkpoint_engine.load(path) if self.checkpoint_engine else torch.load(path, weights_only=False)
        self.loaded, self.global_steps, self.global_samples = sd["value"], sd["global_steps"], sd["global_samples"]
        return os.path.join(directory, tag), {}


class Counting:
    """A stand-in for DeepSpeed's TorchCheckpointEngine (weights_only=False, as DeepSpeed's own)."""

    def load(self, path, map_location=None):
        return torch.load(path, map_location=map_location, weights_only=False)


def save(directory, iteration, value=0.0, run_id="run-a", keep_last=None, engine=None, **kw):
    return ckpt.save_checkpoint(engine or FakeEngine(value), str(directory),
                                TrainState(iteration, 8 * iteration, run_id=run_id), CONFIG, LAYOUT,
                                keep_last=keep_last, **kw)


def load(directory, **kw):
    engine = FakeEngine()
    engine.checkpoint_engine = Counting()
    path, state = ckpt.load_checkpoint(engine, str(directory), CONFIG, LAYOUT, **kw)
    return engine, path, state


def forge(tag_dir, name, obj):
    """Replace `name` by `obj` and record its new checksum, as a forger who also edits megacoat.json would."""
    torch.save(obj, os.path.join(tag_dir, name))
    meta_path = os.path.join(tag_dir, "megacoat.json")
    meta = json.load(open(meta_path))
    from megacoat.checkpoint.integrity import file_manifest
    meta["files"].update(file_manifest(str(tag_dir), [name]))
    json.dump(meta, open(meta_path, "w"))


# --- 1. nothing runs from a checkpoint -----------------------------------------------------------------------
@pytest.mark.parametrize("evil, named", [(Evil, "exec"), (EvilShell, "system")])
def test_a_crafted_file_is_refused_naming_it_and_runs_nothing(tmp_path, evil, named):
    marker = tmp_path / "marker"
    path = tmp_path / "rng_rank00000.pt"
    torch.save({"python": evil(marker)}, path)
    with pytest.raises(CheckpointFileError, match=rf"rng_rank00000.pt: refused: .*nsupported (global|GLOBAL).*{named}"):
        safe_torch_load(str(path))
    assert not marker.exists()


@pytest.mark.parametrize("name", ["model.pt", "rng_rank00000.pt"])
def test_a_crafted_deepspeed_or_rng_file_is_refused_on_load(tmp_path, name):
    """DeepSpeed's own loader (weights_only=False) is handed megacoat's safe checkpoint engine for the load."""
    save(tmp_path, 10, value=1.0)
    marker = tmp_path / "marker"
    forge(tmp_path / "iter_0000010", name, {"value": Evil(marker), "python": Evil(marker)})
    with pytest.raises(CheckpointFileError, match=rf"iter_0000010/{name}: refused"):
        load(tmp_path)
    assert not marker.exists()


def test_a_normal_checkpoint_loads_through_the_safe_engine(tmp_path):
    save(tmp_path, 10, value=1.0)
    engine, path, state = load(tmp_path)
    assert engine.loaded == 1.0 and state == TrainState(10, 80, 0) and state.run_id == "run-a"
    assert isinstance(engine.checkpoint_engine, Counting)  # DeepSpeed's engine is given back after the load


# --- 2. a re-save never deletes the only complete copy -------------------------------------------------------
def test_a_resave_killed_between_its_renames_leaves_a_complete_checkpoint(tmp_path, monkeypatch):
    save(tmp_path, 10, value=1.0)
    real_rename = os.rename

    def killed_before_the_new_copy_lands(src, dst):
        if os.path.basename(src).startswith(ckpt.TMP_PREFIX):
            raise KeyboardInterrupt("killed")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", killed_before_the_new_copy_lands)
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path, 10, value=2.0)
    monkeypatch.setattr(os, "rename", real_rename)
    assert (tmp_path / "latest").read_text() == "iter_0000010"
    engine, path, state = load(tmp_path)  # the old copy, moved aside but never deleted
    assert engine.loaded == 1.0 and state.iteration == 10
    save(tmp_path, 20, value=3.0)  # the next save puts it back in place
    assert sorted(os.listdir(tmp_path)) == ["iter_0000010", "iter_0000020", "latest"]
    assert load(tmp_path, tag="iter_0000010")[0].loaded == 1.0


def test_a_resave_replaces_the_old_copy_and_an_unchanged_one_is_not_saved_again(tmp_path):
    final = save(tmp_path, 10, value=1.0)
    save(tmp_path, 10, value=2.0)  # a rollback's new timeline: the new one wins
    assert load(tmp_path)[0].loaded == 2.0 and sorted(os.listdir(tmp_path)) == ["iter_0000010", "latest"]
    engine, lines = FakeEngine(5.0), []
    assert save(tmp_path, 10, engine=engine, resumed_from=final, log=lines.append) == final
    assert engine.saves == 0 and lines == [f"checkpoint {final} already holds iteration 10: not saved again"]
    assert load(tmp_path)[0].loaded == 2.0


# --- 3. a full disk --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("failure", [RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4736 "
                                                  "vs 4630"), OSError(errno.ENOSPC, "No space left on device")])
def test_a_full_disk_is_one_line_and_leaves_latest_intact(tmp_path, monkeypatch, failure):
    save(tmp_path, 10, value=1.0)

    def full(*args, **kwargs):
        raise failure

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(ckpt.CheckpointWriteError) as e:
        save(tmp_path, 20, value=2.0)
    monkeypatch.undo()
    assert isinstance(e.value, OSError) and "\n" not in str(e.value)
    assert str(e.value).startswith(f"--save {tmp_path}: writing iter_0000020 failed: No space left on device")
    assert "'latest' still names iter_0000010" in str(e.value)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000010", "latest"]  # the partial save removed
    assert load(tmp_path)[0].loaded == 1.0


# --- 4. non-finite state is never saved --------------------------------------------------------------------------
def test_non_finite_weights_are_not_saved(tmp_path):
    save(tmp_path, 10, value=1.0)
    with pytest.raises(NonFiniteTrainingError, match=r"refusing to save iteration 20: weight holds NaN or Inf \("
                                                     rf"{tmp_path}/iter_0000010 is kept\)"):
        save(tmp_path, 20, value=float("inf"))
    assert sorted(os.listdir(tmp_path)) == ["iter_0000010", "latest"]


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_non_finite_fp8_optimizer_state_is_not_saved(tmp_path, fp8):
    engine = FakeEngine(1.0)
    p = engine.module.weight
    engine.optimizer.state[p] = {"exp_avg": torch.tensor([1.0, float("nan")]).to(fp8), "scale": torch.ones(1)}
    with pytest.raises(NonFiniteTrainingError, match=r"optimizer state 'exp_avg' of group 0 parameter 0 holds NaN "
                                                     r"or Inf \(nothing was saved\)"):
        save(tmp_path, 10, engine=engine)
    engine.optimizer.state[p]["exp_avg"] = torch.tensor([1.0, 2.0]).to(fp8)
    save(tmp_path, 10, engine=engine)


# --- 5. corruption and altered metadata are refused ---------------------------------------------------------------
def test_flipped_bytes_are_refused_naming_the_file(tmp_path):
    save(tmp_path, 10, value=1.0)
    path = tmp_path / "iter_0000010" / "model.pt"
    data = bytearray(path.read_bytes())
    data[200:216] = bytes(b ^ 0xFF for b in data[200:216])
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointFileError, match=rf"{path}: sha256 differs from the one recorded at the save"):
        load(tmp_path)


@pytest.mark.parametrize("key, value, message", [
    ("iteration", 30, "megacoat.json says iteration 30 and 80 consumed samples, but DeepSpeed's model-states file "
                      "says 10 steps and 80 samples"),
    ("consumed_samples", 0, "megacoat.json says iteration 10 and 0 consumed samples, but DeepSpeed's model-states "
                            "file says 10 steps and 80 samples")])
def test_metadata_that_disagrees_with_deepspeeds_counters_is_refused(tmp_path, key, value, message):
    save(tmp_path, 10, value=1.0)
    meta_path = tmp_path / "iter_0000010" / "megacoat.json"
    meta = json.loads(meta_path.read_text())
    meta[key] = value
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=message):
        load(tmp_path)


@pytest.mark.parametrize("edit, message", [
    (lambda m: [1, 2], "not a JSON object"),
    (lambda m: {k: v for k, v in m.items() if k != "iteration"}, "no 'iteration'"),
    (lambda m: {**m, "iteration": "10"}, "'iteration' is '10', not a non-negative integer"),
    (lambda m: {**m, "megacoat_config": {}}, "'megacoat_config' has no 'model' object"),
    (lambda m: {**m, "layout": None}, "no 'layout' object"),
    (lambda m: {**m, "files": {"../x": {}}}, "'files' entry '../x' is not"),
])
def test_malformed_metadata_is_one_error_naming_the_file(tmp_path, edit, message):
    save(tmp_path, 10)
    meta_path = tmp_path / "iter_0000010" / "megacoat.json"
    meta_path.write_text(json.dumps(edit(json.loads(meta_path.read_text()))))
    with pytest.raises(ValueError, match=rf"{meta_path}: {message}"):
        ckpt.read_meta(str(tmp_path), "iter_0000010")


# --- 8. path tricks -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pointer", ["../elsewhere/iter_0000010", "/tmp/iter_0000010", "iter_0000010/../x", "x"])
def test_latest_may_name_only_an_iter_directory_inside(tmp_path, pointer):
    d = tmp_path / "ckpt"
    save(d, 10)
    (d / "latest").write_text(pointer)
    with pytest.raises(ValueError, match=rf"--load {d}: 'latest' names .*only an iter_N directory inside"):
        ckpt.resolve_load(str(d))


def test_a_checkpoint_linked_from_outside_is_refused(tmp_path):
    outside, d = tmp_path / "outside", tmp_path / "ckpt"
    save(outside, 10)
    d.mkdir()
    (d / "iter_0000010").symlink_to(outside / "iter_0000010")
    (d / "latest").write_text("iter_0000010")
    with pytest.raises(ValueError, match="a link out of"):
        ckpt.resolve_load(str(d))


def test_a_planted_temporary_symlink_is_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "latest.tmp").symlink_to(victim)
    save(d, 10)
    assert victim.read_text() == "precious" and (d / "latest").read_text() == "iter_0000010"
    assert not (d / "latest").is_symlink()


# --- 14. --keep-last prunes only this run's checkpoints ------------------------------------------------------------
def test_keep_last_never_prunes_another_runs_checkpoints(tmp_path):
    for it in (1, 2):
        save(tmp_path, it, run_id="other-run", keep_last=1)
    lines = []
    for it in (3, 4, 5):
        save(tmp_path, it, run_id="this-run", keep_last=1, log=lines.append)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "iter_0000005", "latest"]
    assert f"--keep-last 1: kept iter_0000002 in {tmp_path} (not written by this run)" in lines
    assert (tmp_path / "latest").read_text() == "iter_0000005"
