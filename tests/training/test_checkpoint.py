"""Checkpoint mechanics without a model: atomic save (a save that dies half-way leaves the previous
checkpoint as `latest`), --keep-last pruning, the errors for a checkpoint of another model,
tokenizer or optimizer (raised before DeepSpeed reads anything), and the detour another layout takes."""
import json
import os

import pytest
import torch
import torch.distributed as dist

from megacoat.training import checkpointing as ckpt
from megacoat.training.checkpointing import Layout, TrainState

LAYOUT = Layout(world_size=1, data_parallel_size=1, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                zero_stage=0, fp8_optimizer=False)
CONFIG = {"model": {"hidden_size": 64, "num_layers": 2}}


@pytest.fixture(scope="module", autouse=True)
def world_of_one(tmp_path_factory):
    if not dist.is_initialized():
        store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield


class FakeEngine:
    """DeepSpeed's save/load surface: writes DIR/TAG/model.pt; `fail_after_write` dies mid-save."""

    def __init__(self, value=0.0, fail_after_write=False):
        self.value, self.fail_after_write, self.loaded = value, fail_after_write, None

    def save_checkpoint(self, directory, tag, client_state, save_latest):
        assert save_latest is False  # megacoat writes `latest` itself, after the rename
        os.makedirs(os.path.join(directory, tag), exist_ok=True)
        torch.save({"value": self.value}, os.path.join(directory, tag, "model.pt"))
        if self.fail_after_write:
            raise KeyboardInterrupt("killed during save")

    def load_checkpoint(self, directory, tag):
        self.loaded = torch.load(os.path.join(directory, tag, "model.pt"))["value"]
        return os.path.join(directory, tag), {}


def save(directory, iteration, value=0.0, keep_last=None, run_id="run-a", **kw):
    """One save of run `run_id` (--keep-last prunes only the checkpoints of the run that saves)."""
    return ckpt.save_checkpoint(FakeEngine(value, **kw), str(directory),
                                TrainState(iteration, 8 * iteration, run_id=run_id), CONFIG, LAYOUT,
                                keep_last=keep_last)


def test_save_is_atomic_and_a_killed_save_leaves_the_previous_checkpoint(tmp_path):
    save(tmp_path, 10, value=1.0)
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path, 20, value=2.0, fail_after_write=True)
    assert (tmp_path / "latest").read_text() == "iter_0000010"
    assert (tmp_path / ".tmp-iter_0000020").is_dir() and not (tmp_path / "iter_0000020").exists()
    engine = FakeEngine()
    path, state = ckpt.load_checkpoint(engine, str(tmp_path), CONFIG, LAYOUT)
    assert path.endswith("iter_0000010") and engine.loaded == 1.0
    assert state == TrainState(10, 80, 0)
    save(tmp_path, 20, value=2.0)  # the next save clears the dead temporary
    assert sorted(os.listdir(tmp_path)) == ["iter_0000010", "iter_0000020", "latest"]
    ckpt.load_checkpoint(engine, str(tmp_path), CONFIG, LAYOUT)
    assert engine.loaded == 2.0


def test_a_directory_without_marker_is_not_a_checkpoint(tmp_path):
    """`latest` pointing at a directory without megacoat.json (hand-edited, or a foreign DeepSpeed save)."""
    (tmp_path / "iter_0000005").mkdir()
    (tmp_path / "latest").write_text("iter_0000005")
    with pytest.raises(FileNotFoundError, match="not a complete megacoat checkpoint"):
        ckpt.load_checkpoint(FakeEngine(), str(tmp_path), CONFIG, LAYOUT)


def test_empty_directory_loads_nothing_and_missing_directory_is_an_error(tmp_path):
    assert ckpt.load_checkpoint(FakeEngine(), str(tmp_path), CONFIG, LAYOUT) is None
    with pytest.raises(FileNotFoundError, match="no such directory"):
        ckpt.load_checkpoint(FakeEngine(), str(tmp_path / "nope"), CONFIG, LAYOUT)


def test_keep_last_prunes_oldest_complete_checkpoints(tmp_path):
    for it in (1, 2, 3, 4):
        save(tmp_path, it, keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000003", "iter_0000004", "latest"]
    assert ckpt.list_checkpoints(str(tmp_path)) == ["iter_0000003", "iter_0000004"]


def test_without_latest_the_newest_complete_checkpoint_is_used(tmp_path):
    save(tmp_path, 3, value=3.0)
    save(tmp_path, 12, value=12.0)
    (tmp_path / "latest").unlink()
    engine = FakeEngine()
    path, _ = ckpt.load_checkpoint(engine, str(tmp_path), CONFIG, LAYOUT)
    assert path.endswith("iter_0000012") and engine.loaded == 12.0  # numeric order, not string order


def test_other_model_is_an_error_naming_the_field(tmp_path):
    save(tmp_path, 1)
    other = {"model": {"hidden_size": 128, "num_layers": 2}}
    with pytest.raises(ValueError, match=r"hidden_size': \(64, 128\)"):
        ckpt.load_checkpoint(FakeEngine(), str(tmp_path), other, LAYOUT)


@pytest.mark.parametrize("change, message", [
    (dict(tensor_model_parallel_size=2), "tensor_model_parallel_size: saved 1, now 2"),
    (dict(pipeline_model_parallel_size=2), "pipeline_model_parallel_size: saved 1, now 2"),
    (dict(zero_stage=1), "zero_stage: saved 0, now 1"),
])
def test_another_layout_goes_through_the_layout_free_form(tmp_path, change, message):
    """DeepSpeed is not asked to load another layout: the checkpoint is converted (training/reshard.py). The fake
    engine's files are no DeepSpeed checkpoint, so the conversion fails, naming the command that converts it."""
    save(tmp_path, 1)
    now = Layout(**{**LAYOUT.__dict__, **change})
    assert message in now.incompatibilities(LAYOUT.__dict__)
    engine = FakeEngine()
    with pytest.raises(ValueError, match="converting to the layout-free form failed") as e:
        ckpt.load_checkpoint(engine, str(tmp_path), CONFIG, now)
    assert "python tools/convert_checkpoint.py --load" in str(e.value) and engine.loaded is None


def test_another_optimizer_is_an_error_without_convert(tmp_path):
    saved = {"model": CONFIG["model"], "optim": {"fp8_optimizer": False}}
    ckpt.save_checkpoint(FakeEngine(), str(tmp_path), TrainState(1, 8), saved, LAYOUT)
    now = {"model": CONFIG["model"], "optim": {"fp8_optimizer": True, "fp8_m_dtype": "e4m3", "fp8_v_dtype": "e4m3",
                                                "fp8_group_size": 128, "fp8_expand": True}}
    engine = FakeEngine()
    with pytest.raises(ValueError, match=r"optimizer state is not this run's: fp8_optimizer: saved False, now True\. "
                                         r"Pass --override-optimizer-state convert"):
        ckpt.load_checkpoint(engine, str(tmp_path), now, LAYOUT)
    assert engine.loaded is None


def test_other_coat_settings_are_named():
    from megacoat.training.reshard import optimizer_changes

    coat = {"fp8_optimizer": True, "fp8_m_dtype": "e4m3", "fp8_v_dtype": "e4m3", "fp8_group_size": 128,
            "fp8_expand": True}
    assert optimizer_changes(coat, {**coat, "fp8_v_dtype": "e5m2", "fp8_group_size": 32}) == [
        "fp8_v_dtype: saved 'e4m3', now 'e5m2'", "fp8_group_size: saved 128, now 32"]
    assert optimizer_changes({**coat, "fp8_optimizer": False}, {**coat, "fp8_optimizer": False,
                                                                "fp8_group_size": 32}) == []


def test_zero_state_with_another_dp_size_is_refused_but_zero0_is_fine(tmp_path):
    saved = Layout(2, 2, 1, 1, 1, False)
    meta = {"layout": saved.__dict__}
    assert Layout(4, 4, 1, 1, 1, False).incompatibilities(meta["layout"]) == [
        "data_parallel_size: saved 2, now 4 (ZeRO-1 optimizer state is partitioned over the data-parallel ranks)"]
    assert Layout(4, 4, 1, 1, 0, False).incompatibilities(Layout(2, 2, 1, 1, 0, False).__dict__) == []


def test_other_tokenizer_is_an_error(tmp_path):
    tok_a, tok_b = tmp_path / "a.model", tmp_path / "b.model"
    tok_a.write_bytes(b"aaa"), tok_b.write_bytes(b"bbb")
    d = tmp_path / "ck"
    ckpt.save_checkpoint(FakeEngine(), str(d), TrainState(1, 8), CONFIG, LAYOUT, ckpt.file_identity(str(tok_a)))
    meta = json.loads((d / "iter_0000001" / "megacoat.json").read_text())
    assert meta["tokenizer"]["sha256"] == ckpt.file_identity(str(tok_a))["sha256"]
    with pytest.raises(ValueError, match="trained with tokenizer"):
        ckpt.load_checkpoint(FakeEngine(), str(d), CONFIG, LAYOUT, ckpt.file_identity(str(tok_b)))
    assert ckpt.load_checkpoint(FakeEngine(), str(d), CONFIG, LAYOUT, ckpt.file_identity(str(tok_a)))


# --- what --load names ----------------------------------------------------------------------------------------
def test_load_names_the_save_directory_or_one_checkpoint(tmp_path):
    save(tmp_path, 4)
    save(tmp_path, 8)
    assert ckpt.resolve_load(str(tmp_path)) == (str(tmp_path), "iter_0000008")  # `latest`
    for form in (tmp_path / "iter_0000004", f"{tmp_path / 'iter_0000004'}/"):
        assert ckpt.resolve_load(str(form)) == (str(tmp_path), "iter_0000004")  # DeepSpeed's tag
    engine = FakeEngine()
    path, state = ckpt.load_checkpoint(engine, str(tmp_path), CONFIG, LAYOUT, tag="iter_0000004")
    assert path.endswith("iter_0000004") and state.iteration == 4


def test_load_without_a_checkpoint_is_an_error_unless_it_is_the_save_directory(tmp_path):
    empty, other, missing = tmp_path / "empty", tmp_path / "other", tmp_path / "missing"
    empty.mkdir(), other.mkdir()
    (other / "notes.txt").write_text("x")
    for d in (empty, other):
        with pytest.raises(FileNotFoundError, match="no checkpoint in this directory"):
            ckpt.resolve_load(str(d))
        with pytest.raises(FileNotFoundError, match="no checkpoint in this directory"):
            ckpt.resolve_load(str(d), save=str(tmp_path / "elsewhere"))
    with pytest.raises(FileNotFoundError, match="no such directory"):
        ckpt.resolve_load(str(missing))
    # The first run of a job that saves and resumes in one directory: from scratch, by intent.
    assert ckpt.resolve_load(str(empty), save=str(empty)) is None
    assert ckpt.resolve_load(str(missing), save=f"{missing}/") is None


def test_an_interrupted_save_named_directly_is_not_a_checkpoint(tmp_path):
    save(tmp_path, 4)
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path, 8, fail_after_write=True)
    with pytest.raises(FileNotFoundError, match="not a complete megacoat checkpoint"):
        ckpt.resolve_load(str(tmp_path / ".tmp-iter_0000008"))
    (tmp_path / "iter_0000009").mkdir()  # a foreign or hand-made directory
    with pytest.raises(FileNotFoundError, match="not a complete megacoat checkpoint"):
        ckpt.resolve_load(str(tmp_path / "iter_0000009"))


def test_other_coat_adamw_state_format_is_refused_before_loading(tmp_path):
    optim = {"fp8_optimizer": True, "fp8_m_dtype": "e4m3", "fp8_v_dtype": "e4m3", "fp8_group_size": 128,
             "fp8_expand": True}
    layout = Layout(**{**LAYOUT.__dict__, "fp8_optimizer": True})
    ckpt.save_checkpoint(FakeEngine(), str(tmp_path), TrainState(1, 8), {**CONFIG, "optim": optim}, layout)
    meta = ckpt.read_meta(str(tmp_path), "iter_0000001")
    ckpt.check_compatible(str(tmp_path), meta, {**CONFIG, "optim": optim}, layout)
    other = {**CONFIG, "optim": {**optim, "fp8_v_dtype": "e5m2"}}
    with pytest.raises(ValueError, match=r"optimizer state is not this run's: fp8_v_dtype: saved 'e4m3', now 'e5m2'.*"
                                         r"--override-optimizer-state convert"):
        ckpt.check_compatible(str(tmp_path), meta, other, layout)
    ckpt.check_compatible(str(tmp_path), meta, other, layout, convert_optimizer=True)  # converted on load instead


def test_a_changed_scaling_switch_is_a_note_not_an_error():
    """Delayed scaling became --coat-fp8's default (auto): a run resumed from a checkpoint trained with current
    scaling says so, and how to keep current scaling, instead of switching silently."""
    meta = {"megacoat_config": {"fp8": {"grad_scaling": "current", "activation_scaling": "current"}}}
    now = {"fp8": {"grad_scaling": "delayed", "activation_scaling": "current"}}
    assert ckpt.scaling_changes(meta, now) == [
        "note: the checkpoint was trained with --fp8-grad-scaling current, this run uses delayed "
        "(pass --fp8-grad-scaling current to keep it)"]
    assert ckpt.scaling_changes(meta, {"fp8": meta["megacoat_config"]["fp8"]}) == []
    assert ckpt.scaling_changes({"megacoat_config": {"model": {}}}, now) == []  # e.g. a layout-free HF checkpoint


def test_a_changed_output_layer_is_a_note_not_an_error():
    """A run resumed with the other head (--fp8-output-layer, or its default auto, which became the default after such
    checkpoints were written) from a checkpoint trained with the BF16 head says so, and how to keep it."""
    meta = {"megacoat_config": {"fp8": {"grad_scaling": "delayed", "output_layer": False}}}
    now = {"fp8": {"grad_scaling": "delayed", "output_layer": True}}
    assert ckpt.scaling_changes(meta, now) == [
        "note: the checkpoint was trained with --fp8-output-layer off, this run uses on "
        "(pass --fp8-output-layer off to keep it)"]
