"""--profile-dir: a trace and the ranked operators of the profiled window, and nothing outside it."""
import json

import pytest

from megacoat.arguments import parse_config
from tests.training.test_pretrain_gpt import TINY, run


def test_profile_window_writes_trace_and_top_operators(tmp_path):
    out = tmp_path / "prof"
    _, train, _ = run(tmp_path, TINY + ["--mock-data", "--train-iters", "4", "--eval-iters", "0", "--zero-stage", "0",
                                        "--profile-dir", str(out), "--profile-step-start", "1",
                                        "--profile-step-end", "3"])
    assert len(train) == 4  # profiling does not change the run
    trace = json.loads((out / "trace_rank0.json").read_text())
    assert trace["traceEvents"]
    top = json.loads((out / "top_ops_rank0.json").read_text())
    assert top["steps"] == [2, 3] and top["time"] == "cpu"
    names = [r["name"] for r in top["top"]]
    assert any("mm" in n for n in names), names  # the GEMMs of two training steps are in the window
    shares = [r["share"] for r in top["top"]]
    assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1 + 1e-9


@pytest.mark.parametrize("start,end,iters", [(3, 3, 10), (-1, 2, 10), (2, 12, 10)])
def test_bad_profile_window_is_named(capsys, start, end, iters):
    with pytest.raises(SystemExit):
        parse_config(["--profile-dir", "p", "--profile-step-start", str(start), "--profile-step-end", str(end),
                      "--train-iters", str(iters)])
    assert "--profile-step-start" in capsys.readouterr().err
