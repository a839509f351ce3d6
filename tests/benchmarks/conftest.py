"""Benchmark tests: load benchmarks/*.py by path (benchmarks/ is scripts, not a package), run them as scripts,
and a tiny fidelity data set built once per session from small standard-library modules (real text)."""
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCHMARKS = os.path.join(ROOT, "benchmarks")


def load_benchmark(name):
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", os.path.join(BENCHMARKS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(*args, timeout=600):
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env,
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
    proc = run_script(os.path.join(BENCHMARKS, "fidelity_data.py"), "--out", str(out), "--packages", "none",
                      "--source-dir", *sorted(str(p) for p in src.iterdir()), "--doc-dir", "--vocab-size", "400",
                      "--valid-bytes", "1600", "--max-group-fraction", "1", "--min-valid-tokens", "300",
                      "--tokenizer-sentences", "2000", "--workers", "1")
    assert proc.returncode == 0, proc.stderr
    return str(out)
