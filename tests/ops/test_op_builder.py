"""CoatAdamWBuilder: finds the CUDA sources, copes with TORCH_CUDA_ARCH_LIST=9.0a, and the sources compile.

The CPU machine has nvcc but no GPU: the compile-only tests build the kernel object with nvcc and syntax-check the
torch binding with the host compiler, so CI catches build breaks. The GPU test JIT-builds and loads the extension.
"""
import os
import re
import shutil
import subprocess
import sys
import sysconfig

import pytest
import torch

from megacoat.ops.op_builder import CoatAdamWBuilder, kernels_dir, normalize_arch_list

NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
# The macros torch's extension build passes to nvcc: the kernel must build under them.
TORCH_NVCC_MACROS = ["-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                     "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__"]


def test_arch_list_suffix_is_normalized():
    assert normalize_arch_list("9.0a") == "9.0"
    assert normalize_arch_list("8.0;9.0a+PTX 10.0f") == "8.0;9.0+PTX 10.0"
    b = CoatAdamWBuilder()
    assert b.filter_ccs(["9.0a", "8.0+PTX"]) == [["9", "0"], ["8", "0+PTX"]]


def test_arch_flags_from_suffixed_list(monkeypatch):
    """What jit_load does on the H100 machine (TORCH_CUDA_ARCH_LIST=9.0a), minus the compiler."""
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    b = CoatAdamWBuilder()
    b.jit_mode = True
    b._jit_arch_list = normalize_arch_list(os.environ["TORCH_CUDA_ARCH_LIST"])
    assert b.compute_capability_args() == []  # jit mode: torch generates -gencode from the env var...
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0+PTX"  # ...which DeepSpeed rewrote to a form torch accepts
    b.jit_mode = False
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a;8.0")
    assert b.compute_capability_args() == ["-gencode=arch=compute_80,code=sm_80",
                                           "-gencode=arch=compute_90,code=sm_90"]


def test_sources_are_found():
    b = CoatAdamWBuilder()
    for src in b.sources():
        assert os.path.isfile(src), src
    assert (kernels_dir() / "coat_adamw.h").is_file()
    assert b.absolute_name() == "megacoat.ops.megacoat_coat_adamw_op"


def cuobjdump():
    """Triton ships cuobjdump; this machine's CUDA may not."""
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return path if os.path.isfile(path) else shutil.which("cuobjdump")


@pytest.mark.skipif(NVCC is None, reason="needs nvcc")
def test_cuda_kernel_compiles(tmp_path):
    """The kernel builds for sm_90 under torch's macros: one fp32 and one bf16 instantiation (COMPILE_CHECK)."""
    obj = tmp_path / "coat_adamw.o"
    cmd = [NVCC, "-c", "-std=c++17", "-O3", "-arch=sm_90", "-DCOAT_ADAMW_COMPILE_CHECK", *TORCH_NVCC_MACROS,
           str(kernels_dir() / "coat_adamw.cu"), "-o", str(obj)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    tool = cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump to list the kernels")
    listing = subprocess.run([tool, "-res-usage", str(obj)], capture_output=True, text=True, check=True).stdout
    rows = re.findall(r"coat_adamw_kernelILi128E(\w+?)EEv13CoatAdamWArgs:\s+REG:(\d+) STACK:\d+ SHARED:\d+ "
                      r"LOCAL:(\d+)", listing)
    assert {t for t, _, _ in rows} == {"ff", "13__nv_bfloat16S1_"}, listing
    for types, regs, local in rows:
        # __launch_bounds__(256, 4): four resident blocks need <= 64 registers; no local memory (spills)
        assert int(regs) <= 64 and int(local) == 0, (types, regs, local)


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None or shutil.which("c++") is None, reason="needs nvcc and a C++ compiler")
def test_torch_binding_compiles(tmp_path):
    """Syntax-check coat_adamw.cpp against torch's headers. A CPU-only torch lacks one generated CUDA header
    (cuda_cmake_macros.h), which the test stubs out."""
    stub = tmp_path / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    torch_inc = os.path.join(os.path.dirname(torch.__file__), "include")
    cuda_home = os.environ.get("CUDA_HOME") or os.path.dirname(os.path.dirname(os.path.realpath(NVCC)))
    cuda_inc = next((d for d in (os.path.join(cuda_home, "include"), "/usr/local/cuda/include")
                     if os.path.isfile(os.path.join(d, "cuda_runtime.h"))), None)
    if cuda_inc is None:
        pytest.skip("CUDA headers not found")
    cmd = ["c++", "-std=c++20", "-fsyntax-only", "-DTORCH_EXTENSION_NAME=megacoat_coat_adamw",
           f"-I{tmp_path}", f"-I{torch_inc}", f"-I{torch_inc}/torch/csrc/api/include", f"-I{cuda_inc}",
           f"-I{sysconfig.get_paths()['include']}", f"-I{kernels_dir()}", str(kernels_dir() / "coat_adamw.cpp")]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.gpu
def test_jit_build_and_load_with_arch_suffix(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    from megacoat.ops.coat_adamw import load_extension

    ext = load_extension()
    assert ext.chunk_elems(128) == 4096
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0a"  # restored after the build


@pytest.mark.slow
def test_plain_install_ships_the_kernels(tmp_path):
    """`pip install .` copies kernels/ into megacoat/ops/kernels/, where an installed op builder finds it."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    src = tmp_path / "src"
    shutil.copytree(root, src, ignore=shutil.ignore_patterns(".git", ".whl", ".site", "build", "*.egg-info",
                                                            "__pycache__", "benchmarks", "tests"))
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps",
                        "--target", str(target), str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    probe = ("from megacoat.ops.op_builder import kernels_dir, CoatAdamWBuilder;"
             "print(kernels_dir()); print(all(__import__('os').path.isfile(s) for s in CoatAdamWBuilder().sources()))")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path,
                       env=dict(os.environ, PYTHONPATH=str(target)))
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.split()
    assert lines[-2] == str(target / "megacoat" / "ops" / "kernels") and lines[-1] == "True"
