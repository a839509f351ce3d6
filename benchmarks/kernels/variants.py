"""Source-level variants of megacoat's bandwidth-bound kernels, timed against the library's. Each delayed-scaling
kernel the default runs per layer (SwiGLU's forward and backward, the norm's forward with the residual add, its
backward and its transposed output, the [q|k|v] gradient's RoPE pass and byte transpose, an output gradient's cast
into both layouts) is timed per call with the library's kernels and with
copies of them made from their own source (the AST, rewritten), so nothing else differs:
  evict_first   every `tl.load` reads with eviction_policy="evict_first";
  streaming     every `tl.store` writes with cache_modifier=".cs";
  both          the two;
  columns_first the 2-D grids of the tiled kernels (SwiGLU's cast pass, the byte transpose, the norm's
                transposed output) swapped, so consecutive programs take the column tiles of
                one row block instead of the row blocks of one column;
  grouped4/8/16 the same kernels on a 1-D grid in super-rows of 4, 8 or 16 row blocks (column tile by column tile
                within one), as Triton's matmul tutorial orders its tiles.
`--norm-out-tiles BM:WARPS ...` adds variants that keep the library's kernels and launch the norm's output pass with
another tile (rmsnorm._OUT_BM, _OUT_WARPS), interleaved with the rest. Every variant must write the library's bytes.

    python -m benchmarks.kernels.variants [--repeats 3] [--variants ...] [--out ...]
    python -m benchmarks.kernels.variants --cpu-smoke   # the interpreter at a tiny shape: the script's check

Each row: one op at one shape under one variant, the median of the repeats (interleaved over the variants, each
timed in a CUDA graph), GB/s by the bytes the op moves, and whether the bytes equal the library's.
"""
from __future__ import annotations

# first: under --cpu-smoke it sets TRITON_INTERPRET before any kernel is defined
from benchmarks.common import SweepLog, parse_tile, same_bytes, start, time_call_ms

import argparse
import ast
import importlib.util
import inspect
import os
import statistics
import sys
import tempfile

import torch

import bench_delayed_scaling as bds
from megacoat.ops import cast_transpose, rmsnorm, rope, swiglu

GROUP = 128
E5M2 = torch.float8_e5m2
# (name, tokens, hidden, ffn): the 1.3 B model of bench_e2e.py at micro-batch 32 and 8 (seq 2048)
SHAPES = [("1.3B mb32", 32 * 2048, 2048, 5632), ("1.3B mb8", 8 * 2048, 2048, 5632)]
SMOKE = [("smoke", 320, 256, 256)]  # 5 row blocks of 64: a short last super-row of 4
MODULES = (swiglu, rmsnorm, rope, cast_transpose)
EVICT = {"load": ("eviction_policy", "evict_first")}
STREAM = {"store": ("cache_modifier", ".cs")}
# The tiled kernels with a 2-D grid (row blocks on axis 0, column tiles on axis 1), whose program order the
# columns_first and grouped variants change. SwiGLU's forward and the cast into both layouts took a 1-D grid, column
# tiles fastest, by this script's figures (benchmarks/results/bench_kernel_variants_notes.md): no order variant
# applies to them any more.
TILED = {"megacoat.ops.swiglu": {"_bwd_cast_kernel"}, "megacoat.ops.rmsnorm": {"_out_kernel"},
         "megacoat.ops.cast_transpose": {"_transpose_bytes_kernel"}}
VARIANTS = {"library": None, "evict_first": {"hint": EVICT}, "streaming": {"hint": STREAM},
            "both": {"hint": {**EVICT, **STREAM}}, "columns_first": {"order": "swap"},
            "grouped4": {"order": 4}, "grouped8": {"order": 8}, "grouped16": {"order": 16}}
# grouped GM: a 1-D grid over super-rows of GM row blocks, the GM row blocks of one column tile consecutive, then the
# next column tile (Triton's matmul tutorial's order): the programs in flight cover whole rows of a few super-rows
# (row-major streams) and write GM row blocks' contiguous span of each transposed row.
_GROUPED = """
_pid = tl.program_id(0)
_width = GM * _N1
_first = _pid // _width * GM
_gm = tl.minimum(_N0 - _first, GM)
_P0 = _first + _pid % _width % _gm
_P1 = _pid % _width // _gm
"""


def _is_jit(node: ast.AST) -> bool:
    return isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list)


class _Rewrite(ast.NodeTransformer):
    """hint: {"load"/"store": (keyword, value)} added to those tl calls; order "swap": tl.program_id /
    tl.num_programs axes 0 and 1 exchanged; order GM (an int): they become _P0/_P1 and _N0/_N1 (see _GROUPED)."""
    def __init__(self, hint: dict, order):
        self.hint, self.order = hint, order

    def visit_Call(self, node):
        self.generic_visit(node)
        f = node.func
        if not (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "tl"):
            return node
        if f.attr in self.hint:
            key, value = self.hint[f.attr]
            node.keywords.append(ast.keyword(arg=key, value=ast.Constant(value)))
        if self.order is not None and f.attr in ("program_id", "num_programs") and isinstance(node.args[0], ast.Constant):
            axis = node.args[0].value
            if self.order == "swap":
                node.args[0] = ast.Constant(1 - axis)
            else:
                return ast.Name(id=("_P" if f.attr == "program_id" else "_N") + str(axis), ctx=ast.Load())
        return node


def _rewrite(node, hint: dict, order):
    node = _Rewrite(hint, order).visit(node)
    if isinstance(order, int):
        node.args.args += [ast.arg(arg="_N0"), ast.arg(arg="_N1")]
        at = 1 if ast.get_docstring(node) else 0
        node.body[at:at] = ast.parse(_GROUPED.replace("GM", str(order))).body
    return node


class _Reordered:
    """A kernel whose program order was changed, launched with the library's 2-D grid: kernel[grid] launches it
    with the axes swapped, or (grouped) on a 1-D grid with the two extents as arguments."""
    def __init__(self, kernel, order):
        self.kernel, self.fn, self.order = kernel, kernel.fn, order

    def __getitem__(self, grid):
        n0, n1 = grid  # every TILED kernel launches a 2-D grid
        if self.order == "swap":
            return self.kernel[(n1, n0)]
        return lambda *a, **k: self.kernel[(n0 * n1,)](*a, **k, _N0=n0, _N1=n1)


def _variant(module, spec: dict, folder: str, tag: str) -> dict:
    """{name: kernel} of `module`'s kernels, compiled from a copy of its source rewritten by spec (hint: on each
    load and store; order: the TILED kernels' program order). Only the imports and the jitted functions are copied:
    the copy registers no operator."""
    tree = ast.parse(inspect.getsource(module))
    keep = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)) or _is_jit(n)]
    order = spec.get("order")
    tiled = TILED.get(module.__name__, set()) if order is not None else set()
    body = ast.Module(body=[_rewrite(n, spec.get("hint", {}), order if getattr(n, "name", "") in tiled else None)
                            for n in keep], type_ignores=[])
    name = f"_variant_{tag}_{module.__name__.rsplit('.', 1)[-1]}"
    path = os.path.join(folder, name + ".py")
    with open(path, "w") as fh:
        fh.write(ast.unparse(ast.fix_missing_locations(body)) + "\n")
    loader = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(loader)
    sys.modules[name] = mod  # Triton resolves a kernel's globals through its module
    loader.loader.exec_module(mod)
    return {k: _Reordered(v, order) if k in tiled else v for k, v in _kernels(mod).items()}


def _kernels(module) -> dict:
    """{name: kernel} of the Triton functions `module` defines (jitted, or interpreted under --cpu-smoke)."""
    return {k: v for k, v in vars(module).items()
            if getattr(getattr(v, "fn", None), "__module__", None) == module.__name__}


def _use(kernels: dict) -> None:
    """Point the library's launch sites at these kernels and tile settings (each launch reads its module's
    globals)."""
    for module in MODULES:
        for k, v in kernels.get(module.__name__, {}).items():
            setattr(module, k, v)


def _norm_fwd(m, h, f, device):
    x, add = ((torch.randn(m, h, device=device) * 3).to(torch.bfloat16) for _ in range(2))
    w = (1 + 0.2 * torch.randn(h, device=device)).to(torch.bfloat16)
    hist = torch.zeros(16, device=device)
    rmsnorm.rmsnorm_fp8_fwd_delayed_triton(x, w, hist, 1e-5, GROUP, bootstrap=True, add=add)
    n = m * h  # x, add 2 B each read; h 2 B, x8 1 B, y 1 B written
    return (lambda: rmsnorm.rmsnorm_fp8_fwd_delayed_triton(x, w, hist, 1e-5, GROUP, add=add)), 8 * n


def _norm_bwd(m, h, f, device):
    x = (torch.randn(m, h, device=device) * 3).to(torch.bfloat16)
    w = (1 + 0.2 * torch.randn(h, device=device)).to(torch.bfloat16)
    x8, xs, rstd = rmsnorm.rmsnorm_fp8_fwd_triton(x, w, 1e-5, GROUP)[:3]
    dy, res = ((torch.randn(m, h, device=device) * 1e-3).to(torch.bfloat16) for _ in range(2))
    n = m * h  # dy 2 B, x8 1 B, the residual's gradient 2 B read; dx 2 B written
    return (lambda: rmsnorm.rmsnorm_fp8_bwd_triton(dy, x8, xs, rstd, w, GROUP, residual_grad=res, dx_amax=True)), 7 * n


def _cast_both(m, h, f, device):
    """An output gradient's cast into both layouts (dgrad's and wgrad's operands), as the blocks' linears make it."""
    x = (torch.randn(m, h, device=device) * 1e-3).to(torch.bfloat16)
    hist = torch.zeros(16, device=device)
    cast_transpose.cast_transpose_delayed_triton(x, hist, E5M2, bootstrap=True)
    return (lambda: cast_transpose.cast_transpose_delayed_triton(x, hist, E5M2)), 4 * m * h  # 2 B read, 1 + 1 written


def _norm_out_t(m, h, f, device):
    """The norm's output remade transposed in backward (the next GEMM's wgrad operand) from the saved FP8 input."""
    x = (torch.randn(m, h, device=device) * 3).to(torch.bfloat16)
    w = (1 + 0.2 * torch.randn(h, device=device)).to(torch.bfloat16)
    x8, xs, rstd, y_scale = rmsnorm.rmsnorm_fp8_fwd_triton(x, w, 1e-5, GROUP)[:4]
    return (lambda: rmsnorm.rmsnorm_fp8_out_triton(x8, xs, rstd, w, y_scale, GROUP, True)), 2 * m * h  # 1 B + 1 B


def _from_bds(op):
    def build(m, h, f, device):
        _, delayed, moved = bds.OPS[op](m, h, f, device)
        hist = torch.zeros(16, device=device)
        delayed(hist, True)
        return (lambda: delayed(hist)), moved["delayed"]
    return build


OPS = {"swiglu_bwd": _from_bds("swiglu_bwd"), "swiglu_fwd": _from_bds("swiglu_fwd"), "norm_fwd_add": _norm_fwd,
       "norm_bwd_res": _norm_bwd, "rope_qkv_bwd": _from_bds("rope_qkv_bwd"), "cast_both": _cast_both,
       "norm_out_t": _norm_out_t}


def _outputs(fn) -> list:
    out = fn()
    return [t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ops", nargs="*", default=list(OPS), choices=list(OPS))
    p.add_argument("--variants", nargs="*", default=list(VARIANTS)[1:], choices=list(VARIANTS)[1:])
    p.add_argument("--norm-out-tiles", nargs="*", default=[], metavar="BM:WARPS")
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--out", default="benchmarks/results/bench_kernel_variants.json")
    args = p.parse_args()
    started = start(args.cpu_smoke, lambda: [parse_tile(t, "--norm-out-tiles", ("BM", "warps"), 16)
                                             for t in args.norm_out_tiles])
    if started is None:
        return 2
    device, tiles = started
    folder = tempfile.mkdtemp(prefix="megacoat_variants_")
    tile = {"_OUT_BM": rmsnorm._OUT_BM, "_OUT_WARPS": rmsnorm._OUT_WARPS}  # the library's, set by every variant
    kernels = {"library": {m.__name__: _kernels(m) for m in MODULES},
               **{v: {m.__name__: _variant(m, VARIANTS[v], folder, v) for m in MODULES} for v in args.variants}}
    specs = {v: VARIANTS[v] for v in kernels}
    for ks in kernels.values():
        ks[rmsnorm.__name__].update(tile)
    for bm, warps in tiles:
        name = f"norm_out {bm}x{warps}"
        library = kernels["library"]
        kernels[name] = {**library, rmsnorm.__name__: {**library[rmsnorm.__name__], "_OUT_BM": bm, "_OUT_WARPS": warps}}
        specs[name] = {"norm_out_tile": [bm, warps]}
    log = SweepLog(args.out, device, "the default's bandwidth-bound kernels per call, the library's against "
                   "source-level variants (cache hints on every load and store, the tiled kernels' program order) "
                   "and other tiles of the norm's output pass", group_size=GROUP, variants=specs)
    shapes = SMOKE if args.cpu_smoke else SHAPES
    repeats = 1 if args.cpu_smoke else args.repeats
    for op in args.ops:
        for name, m, h, f in shapes:
            torch.manual_seed(0)
            _use(kernels["library"])
            fn, moved = OPS[op](m, h, f, device)
            want = _outputs(fn)
            same = {}
            for v in kernels:
                _use(kernels[v])
                same[v] = all(same_bytes(a, b) for a, b in zip(want, _outputs(fn)))
            del want
            times = {v: [] for v in kernels}
            for _ in range(repeats):
                for v in kernels:  # interleaved: drift touches every variant alike
                    _use(kernels[v])
                    times[v].append(time_call_ms(fn, device))
            _use(kernels["library"])
            lib = statistics.median(times["library"])
            for v in kernels:
                ms = statistics.median(times[v])
                log.add({"op": op, "shape": name, "tokens": m, "variant": v, "ms": ms, "ms_repeats": times[v],
                         "speedup": lib / ms, "bytes": moved, "gb_per_s": moved / (ms * 1e-3) / 1e9,
                         "same_bytes": same[v]})
                print(f"{op:13s} {name:10s} {v:15s} {ms * 1e3:9.1f} us  {moved / (ms * 1e-3) / 1e9:7.0f} GB/s  "
                      f"x{lib / ms:.3f}  same bytes: {same[v]}", flush=True)
            del fn
    return log.finish([])


if __name__ == "__main__":
    sys.exit(main())
