"""benchmarks/run.py and the suite it runs: names, commands, the output limit, one-line user errors."""
import pytest

from benchmarks import run as runner
from benchmarks.suite import BY_NAME, SUITE
from tests.benchmarks.conftest import run_module


def test_the_suite_holds_the_required_runs():
    assert {"gpu-tests", "e2e-1p3b-mb8", "memory-1p3b"} <= set(BY_NAME)
    assert len(BY_NAME) == len(SUITE)  # no name twice
    e2e = BY_NAME["e2e-1p3b-mb8"].args
    assert e2e[e2e.index("--modes") + 1:e2e.index("--modes") + 3] == ["bf16", "coat"]
    assert int(e2e[e2e.index("--iters") + 1]) >= 30 and e2e[e2e.index("--repeats") + 1] == "2"
    for run in SUITE:
        if run.module == "benchmarks.parallel.speed":
            assert int(run.args[run.args.index("--iters") + 1]) >= 20 and run.args[run.args.index("--repeats") + 1] == "2"


def test_list_and_dry_run(tmp_path):
    proc = run_module("benchmarks.run", "--list", timeout=120)
    assert proc.returncode == 0 and all(run.name in proc.stdout for run in SUITE)
    proc = run_module("benchmarks.run", "e2e-1p3b-mb8", "gpu-tests", "--dry-run", "--out", str(tmp_path), timeout=120)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and len(lines) == 2 and not any(tmp_path.iterdir())  # nothing ran
    assert "-m benchmarks.e2e.speed" in lines[0] and lines[0].endswith(f"--out {tmp_path}/e2e_1p3b_mb8.json")
    assert "-m pytest" in lines[1] and "-m gpu" in lines[1] and "--out" not in lines[1]


@pytest.mark.parametrize("names, message", [(["bogus"], "unknown run 'bogus'"), ([], "name a run")])
def test_user_errors_are_one_line(names, message):
    proc = run_module("benchmarks.run", *names, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == f"error: {message} (see --list)"


def test_more_files_than_a_device_call_returns_is_refused(monkeypatch, capsys):
    many = [runner.Run(f"r{i}", "", "m", out=f"r{i}.json") for i in range(8)]
    monkeypatch.setattr(runner, "BY_NAME", {r.name: r for r in many})
    assert runner.main([r.name for r in many]) == 2
    assert "more than 8 files" in capsys.readouterr().err


def test_a_run_needing_more_gpus_is_skipped_and_logged(monkeypatch, tmp_path):
    monkeypatch.setattr(runner, "gpus_here", lambda: 0)
    assert runner.execute([BY_NAME["e2e-1p3b-mb8"]], str(tmp_path)) == 1
    log = (tmp_path / "run.log").read_text()
    assert "e2e-1p3b-mb8: skipped, needs 1 GPUs" in log and [p.name for p in tmp_path.iterdir()] == ["run.log"]
