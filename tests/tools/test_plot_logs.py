"""tools/plot_logs.py: PNGs from JSON logs, several logs on one chart, NaN-tolerant smoothing, clear errors."""
import json
import math

import pytest

from tests.tools.conftest import load_tool


@pytest.fixture(scope="module")
def tool():
    return load_tool("plot_logs")


def _write_log(path, losses, mem_gib, val=()):
    with open(path, "w") as f:
        for i, loss in enumerate(losses, 1):
            f.write(json.dumps({"iteration": i, "loss": loss, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1e4 * i,
                                "tflops_per_gpu": None, "mfu": None, "max_memory_bytes": mem_gib * 2**30,
                                "skipped_steps": 0}) + "\n")
        for it, v in val:
            f.write(json.dumps({"iteration": it, "val_loss": v}) + "\n")


def test_two_logs_give_png_files_with_both_curves(tmp_path, tool):
    from matplotlib.image import imread

    _write_log(tmp_path / "bf16.json", [5.0, 4.0, 3.5, float("nan"), 3.0], 10, val=[(5, 3.1)])
    _write_log(tmp_path / "coat.json", [5.0, 4.1, 3.6, 3.3, 3.1], 7)
    assert tool.main([str(tmp_path / "bf16.json"), str(tmp_path / "coat.json"), "--labels", "BF16", "COAT",
                      "--output", str(tmp_path / "out"), "--smooth", "2"]) == 0
    for name in ("loss", "tokens_per_s", "memory", "summary"):
        img = imread(tmp_path / "out" / f"{name}.png")
        assert img.shape[0] > 100 and img.shape[1] > 100 and img.std() > 0.01  # a drawn figure, not blank
    log = tool.read_log(str(tmp_path / "bf16.json"))
    its, mem = tool.series(log, "memory", 1)
    assert its == [1, 2, 3, 4, 5] and mem == [10.0] * 5 and log["val"] == [(5, 3.1)]


def test_smoothing_skips_nan_from_skipped_steps(tool):
    out = tool.smooth([1.0, float("nan"), 3.0, 5.0], 2)
    assert out[0] == 1.0 and out[1] == 1.0 and out[2] == 2.0 and out[3] == 4.0
    assert all(math.isfinite(v) for v in out)


def test_bad_inputs_are_named(tmp_path, tool, capsys):
    (tmp_path / "bad.json").write_text('{"iteration": 1, "loss": 2.0}\nnot json\n')
    assert tool.main([str(tmp_path / "bad.json"), "--output", str(tmp_path / "o")]) == 1
    assert "bad.json:2: not a JSON object" in capsys.readouterr().err
    (tmp_path / "empty.json").write_text("")
    with pytest.raises(ValueError, match="no training records"):
        tool.read_log(str(tmp_path / "empty.json"))
    _write_log(tmp_path / "a.json", [1.0], 1)
    with pytest.raises(ValueError, match="2 labels for 1 logs"):
        tool.plot([str(tmp_path / "a.json")], str(tmp_path / "o"), ["x", "y"])
