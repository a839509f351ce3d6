"""Benchmark tests: run the benchmark modules as `python -m benchmarks.X.Y` from the repository root, and a tiny
fidelity data set built once per session from small standard-library modules (real text)."""
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_module(module, *args, timeout=600):
    """`python -m module args...` from the repository root, Triton under its interpreter."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=ROOT)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """One-file folders (each its own group) of small standard-library modules, split and tokenized."""
    src = tmp_path_factory.mktemp("sources")
    stdlib = sysconfig.get_paths()["stdlib"]
    for name in ("this", "antigravity", "keyword", "bisect", "colorsys", "glob", "fnmatch", "stat", "heapq"):
        os.makedirs(src / name)
        shutil.copy(os.path.join(stdlib, f"{name}.py"), src / name)
    out = tmp_path_factory.mktemp("data") / "fidelity_data"
    proc = run_module("benchmarks.fidelity.data", "--out", str(out), "--packages", "none",
                      "--source-dir", *sorted(str(p) for p in src.iterdir()), "--doc-dir", "--vocab-size", "400",
                      "--valid-bytes", "1600", "--max-group-fraction", "1", "--min-valid-tokens", "300",
                      "--tokenizer-sentences", "2000", "--workers", "1")
    assert proc.returncode == 0, proc.stderr
    return str(out)
