"""Static SASS of a Triton kernel compiled for Hopper (sm_90) on a machine without a GPU.

An instruction-bound kernel runs at about (SMs x 4 schedulers x 32 lanes x clock) / (instructions per element):
on an H100/H200 ~33 T lane-instructions/s, so 80% of a 3-4 TB/s copy needs <= ~40-50 SASS instructions per
element. Counting them here lets a kernel change be judged before device time is spent on it; the device run
still decides. Triton's own cuobjdump/nvdisasm are used (the CPU machine's CUDA has neither).

    python -m benchmarks.kernels.sass megacoat.ops.cast_transpose:_cast_transpose_kernel \\
        --sig x_ptr=*bf16:16,amax_ptr=*bf16,scale_ptr=*fp32,out_ptr=*fp8e4nv:16,outt_ptr=*fp8e4nv:16,M=i32:16,\\
N=i32:16,fmax=fp32,amax_floor=fp32 --const FROM_AMAX=True,ROWWISE=True,TRANSPOSE=True,BM=64,BN=64 \\
        --warps 4 --elements 4096 [--dump]

Prints registers, spills, shared memory, the static instruction count and its breakdown (MUFU, FP32, integer,
memory, conversions, shuffles), and per element when --elements (elements one program handles) is given.
A static count is not a dynamic one: loops count once (pass --elements per loop trip), both sides of a branch
count, slow-path subroutines after the last EXIT do not. Use it to compare two versions of one kernel, not as a
speed. The device runs Triton 3.6 (this machine 3.9, whose code differs): for counts that match the device,
`pip install --no-deps --target /work/triton36 triton==3.6.0` and put it first on PYTHONPATH.
"""
from __future__ import annotations

import argparse
import collections
import importlib
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)")
CLASSES = {  # first word of the opcode -> class; anything else is "other"
    "MUFU": "mufu", "FFMA": "fp32", "FADD": "fp32", "FMUL": "fp32", "FMNMX": "fp32", "FSETP": "fp32",
    "FSEL": "fp32", "FCHK": "fp32", "IMAD": "int", "IADD3": "int", "LEA": "int", "SHF": "int", "LOP3": "int",
    "ISETP": "int", "IABS": "int", "SEL": "int", "PRMT": "int", "IMNMX": "int", "VIMNMX": "int", "MOV": "move",
    "LDG": "mem", "STG": "mem", "LDS": "mem", "STS": "mem", "LDC": "mem", "ULDC": "mem", "F2FP": "cvt",
    "F2F": "cvt", "I2F": "cvt", "F2I": "cvt", "SHFL": "shfl", "BAR": "sync", "BRA": "branch", "EXIT": "branch",
    "HADD2": "fp16x2", "HMUL2": "fp16x2", "HFMA2": "fp16x2",
}


def tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _parse_kv(text: str | None, convert) -> dict:
    out = {}
    for item in filter(None, (text or "").split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"expected name=value, got {item!r}")
        out[key.strip()] = convert(value.strip())
    return out


def _const(value: str):
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return {"True": True, "False": False}.get(value, value)


def compile_sm90(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int = 3):
    """The compiled kernel (triton.compile for sm_90); constexprs also appear in the signature as 'constexpr'.
    A type ending in ':16' marks the argument divisible by 16, as Triton's launcher specializes 16-aligned
    pointers and integers at run time (without it loads through computed offsets come out scalar)."""
    sig = {k: v.partition(":")[0] for k, v in signature.items()}
    attrs = {(fn.arg_names.index(k),): [["tt.divisibility", 16]] for k, v in signature.items() if v.endswith(":16")}
    sig.update({k: "constexpr" for k in constexprs})
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def sass_stats(kernel, elements: int | None = None) -> dict:
    """Register/spill figures from ptxas and the static SASS instruction mix of a compiled kernel."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        sass = subprocess.run([tool("nvdisasm"), "-c", path], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([tool("cuobjdump"), "-res-usage", path], capture_output=True, text=True).stdout
    lines = sass.splitlines()
    exits = [i for i, line in enumerate(lines) if re.search(r"\bEXIT\b", line)]
    body = lines[: exits[-1] + 1] if exits else lines  # after the last EXIT: slow-path subroutines (div_rn, ...)
    ops = [m.group(1) for m in map(INSTR.search, body) if m]
    mix = collections.Counter(CLASSES.get(op.split(".")[0], "other") for op in ops if op != "NOP")
    usage = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", res))
    stats = {
        "registers": int(usage.get("REG", -1)),
        "stack_local_bytes": int(usage.get("STACK", 0)) + int(usage.get("LOCAL", 0)),  # > 0: spills
        "shared_bytes": kernel.metadata.shared,
        "num_warps": kernel.metadata.num_warps,
        "instructions": sum(mix.values()),
        "mix": dict(mix.most_common()),
    }
    if elements:
        per_thread = elements / (32 * kernel.metadata.num_warps)
        stats["instructions_per_element"] = stats["instructions"] / per_thread
        stats["mix_per_element"] = {k: v / per_thread for k, v in stats["mix"].items()}
    stats["_sass"] = sass
    return stats


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kernel", help="module:function of an @triton.jit kernel")
    p.add_argument("--sig", required=True, help="arg=type,... for the runtime arguments (*fp32, *bf16, i32, ...); "
                   "type:16 marks one divisible by 16, as the launcher does for aligned pointers and sizes")
    p.add_argument("--const", default="", help="NAME=value,... for the tl.constexpr arguments")
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--elements", type=int, default=None, help="elements one program handles (for per-element)")
    p.add_argument("--dump", action="store_true", help="print the SASS too")
    args = p.parse_args(argv)
    module, _, name = args.kernel.partition(":")
    fn = getattr(importlib.import_module(module), name)
    kernel = compile_sm90(fn, _parse_kv(args.sig, str), _parse_kv(args.const, _const), args.warps, args.stages)
    stats = sass_stats(kernel, args.elements)
    sass = stats.pop("_sass")
    if args.dump:
        print(sass)
    for key, value in stats.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in value.items())
        elif isinstance(value, float):
            value = f"{value:.1f}"
        print(f"{key:>26}: {value}")


if __name__ == "__main__":
    main()
