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
    """Every kernel variant (kernels/coat_adamw.h, kVariant*) is built: the runtime switch instantiates each."""
    obj = tmp_path / "coat_adamw.o"
    cmd = [NVCC, "-c", "-std=c++17", "-O3", "-arch=sm_90", "-DCOAT_ADAMW_COMPILE_CHECK", *TORCH_NVCC_MACROS,
           str(kernels_dir() / "coat_adamw.cu"), "-o", str(obj)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    tool = cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump to list the kernels")
    listing = subprocess.run([tool, "-res-usage", str(obj)], capture_output=True, text=True, check=True).stdout
    # kernel name, element types, STEP (v3) or blocks per SM (v4) of each G = 128 instantiation
    found = set(re.findall(r"(coat_adamw_kernel(?:_v4)?)ILi128E(\w+?)Li(\d)E(?:Lb0E)?E", listing))
    from megacoat.ops.coat_adamw_cuda import CUDA_VARIANTS

    variants = {("coat_adamw_kernel", "1"), ("coat_adamw_kernel", "2"), ("coat_adamw_kernel_v4", "3"),
                ("coat_adamw_kernel_v4", "2")}
    assert len(variants) == len(CUDA_VARIANTS)
    for types in ("ff", "13__nv_bfloat16S1_"):
        assert {(k, n) for k, t, n in found if t == types} == variants, sorted(found)
    # bf16 parameters with fp32-master remainders (REM = true): v3 only, bf16 and fp32 gradients
    with_remainders = set(re.findall(r"coat_adamw_kernelILi128E13__nv_bfloat16(\w+?)Li(\d)ELb1EE", listing))
    assert with_remainders == {(g, s) for g in ("S1_", "f") for s in ("1", "2")}, sorted(with_remainders)


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
    from megacoat.ops.coat_adamw_cuda import load_extension

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


_TRITON_SM90_PROBE = r"""
import inspect, os, subprocess, sys, tempfile
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megacoat.ops import coat_adamw_triton as kt

fn = kt._coat_adamw_kernel
for variant in kt.TRITON_VARIANTS:
    warps, hw = kt.triton_variant(variant)
    const = dict(M_MBITS=3, V_MBITS=2, P_DT=tl.float32, G_DT=tl.bfloat16, M_DT=tl.float8e4nv, V_DT=tl.float8e5,
                 G=128, GPC=32, EXPAND=True, COUNT=True, K_LO=0.0625, K_HI=64.0, ALIGNED=True, HW=hw)
    sig = {"ptr_table": "*i64", "chunk_table": "*i32", "nonfinite_ptr": "*i32"}
    sig.update({k: "fp32" for k in inspect.signature(fn.fn).parameters if k not in sig and k not in const})
    sig.update({k: "constexpr" for k in const})
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"]); f.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
        sass = subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True).stdout
    print(variant, sass.count("MUFU.LG2"))
"""


@pytest.mark.skipif(cuobjdump() is None, reason="needs Triton's NVIDIA tools")
def test_triton_kernel_variants_compile_for_sm90(tmp_path):
    """The Triton kernel's GPU-only paths (inline PTX: the "hw" variants) cannot run under the interpreter: compile
    every variant for sm_90 here (a fresh process: the tests set TRITON_INTERPRET), and check that the "hw" ones
    take the hardware lg2 per element (4 per element: m and v, dequantize and quantize) while "libm" does not."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", _TRITON_SM90_PROBE], capture_output=True, text=True, cwd=root, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    lg2 = {line.split()[0]: int(line.split()[1]) for line in r.stdout.split("\n") if line.strip()}
    from megacoat.ops.coat_adamw_triton import TRITON_VARIANTS

    assert set(lg2) == set(TRITON_VARIANTS)
    for variant, count in lg2.items():
        per_thread = 4096 // (32 * (16 if variant.endswith("w16") else 8))
        if variant.startswith("hw"):
            assert count >= 4 * per_thread, (variant, count)  # masked and unmasked bodies may both hold them
        else:
            assert count < per_thread, (variant, count)  # libm: a polynomial, no MUFU.LG2 per element
