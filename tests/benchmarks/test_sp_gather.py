"""benchmarks/parallel/sp_gather.py: its argument checks and a CPU run (2 gloo ranks) writing both variants' rows,
the FP8 gather sending 1 + 4/G bytes an element against bf16's 2."""
import json

import pytest

from benchmarks.parallel import sp_gather
from tests.benchmarks.conftest import run_module


def test_bad_arguments_are_one_error():
    with pytest.raises(SystemExit, match="error: --seq-length 65 is not divisible by --gpus 2"):
        sp_gather.parse_args(["--seq-length", "65"])
    with pytest.raises(SystemExit, match="error: --gpus must be at least 2"):
        sp_gather.parse_args(["--gpus", "1"])


@pytest.mark.slow
def test_cpu_run_writes_both_variants(tmp_path):
    out = tmp_path / "g.json"
    proc = run_module("benchmarks.parallel.sp_gather", "--gpus", "2", "--hidden-size", "128", "--seq-length", "64",
                      "--micro-batch-size", "1", "--group-size", "64", "--iters", "2", "--warmup", "1", "--out",
                      str(out), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert rows["mb1/bf16"]["bytes_per_element"] == 2
    assert rows["mb1/fp8"]["bytes_per_element"] == 1 + 4 / 64
    assert rows["mb1/fp8"]["speedup_vs_bf16_forward_backward"] > 0 and rows["mb1/bf16"]["ms_forward"] > 0
