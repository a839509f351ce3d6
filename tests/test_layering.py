"""Which way imports point inside megacoat/ (STYLE.md, "Which way imports point"), read from the source with
`ast`, so that an import against the layering fails here, on CPU, without running anything:

  * `ops` (the kernels) imports only the standard library, torch, triton, numpy, DeepSpeed's op_builder (which
    builds the CUDA kernels) and `megacoat.ops` itself;
  * `fp8` (numerics, the FP8 linear and the precision flow) imports no `model`, `training` or `parallel` code:
    converters act on the model from outside and never the other way;
  * nothing in megacoat/ imports `tools`, `benchmarks` or `tests`;
  * the subpackages' import graph has no cycle. The root modules `megacoat/config.py` and `arguments.py`, which
    gather every package's config dataclass, are not subpackages and stand outside this graph.

Every import statement counts, also one inside a function: a lazy import is still a dependency.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "megacoat"
OPS_MAY_IMPORT = {"torch", "triton", "numpy"} | set(sys.stdlib_module_names)
OPS_MAY_IMPORT_MODULES = ("deepspeed.ops.op_builder",)
FP8_MUST_NOT_IMPORT = ("model", "training", "parallel")
OUTSIDE_THE_LIBRARY = ("tools", "benchmarks", "tests")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file; `from a import b` gives `a.b` when b is a
    submodule, since the dependency is on it."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                is_module = (PACKAGE.parent / Path(*sub.split("."))).with_suffix(".py").exists() or \
                    (PACKAGE.parent / Path(*sub.split(".")) / "__init__.py").exists()
                out.append((node.lineno, sub if is_module else base))
    return out


def all_imports() -> list[tuple[str, str, str]]:
    """(importing module, imported module, 'file:line') over megacoat/."""
    return [(module_name(path), target, f"{path.relative_to(PACKAGE.parent)}:{line}")
            for path in sorted(PACKAGE.rglob("*.py")) for line, target in imports(path)]


def subpackage(module: str) -> str | None:
    """`megacoat.fp8.linear` -> `fp8`; None for a root module (megacoat.config) or outside megacoat."""
    parts = module.split(".")
    if parts[0] != "megacoat" or len(parts) < 2 or not (PACKAGE / parts[1]).is_dir():
        return None
    return parts[1]


def violations(edges) -> list[str]:
    found = []
    for src, dst, where in edges:
        pkg, top = subpackage(src), dst.split(".")[0]
        if pkg == "ops" and top != "megacoat" and top not in OPS_MAY_IMPORT \
                and not dst.startswith(OPS_MAY_IMPORT_MODULES):
            found.append(f"{where}: ops imports {dst} (ops may import only stdlib/torch/triton/numpy/op_builder)")
        if pkg == "ops" and top == "megacoat" and subpackage(dst) != "ops":
            found.append(f"{where}: ops imports {dst} (ops may import only megacoat.ops)")
        if pkg == "fp8" and subpackage(dst) in FP8_MUST_NOT_IMPORT:
            found.append(f"{where}: fp8 imports {dst} (fp8 knows no model, training or parallel code)")
        if top in OUTSIDE_THE_LIBRARY:
            found.append(f"{where}: {src} imports {dst} (the library never imports {top}/)")
    return found


def package_cycles(edges) -> list[str]:
    """Each cycle of the subpackage graph once, with a file that makes each of its edges."""
    graph: dict[str, dict[str, str]] = {}
    for src, dst, where in edges:
        a, b = subpackage(src), subpackage(dst)
        if a and b and a != b:
            graph.setdefault(a, {}).setdefault(b, where)
    cycles, seen = [], set()

    def visit(node, path):
        for nxt in sorted(graph.get(node, {})):
            if nxt in path:
                cycle = path[path.index(nxt):] + [nxt]
                key = frozenset(cycle)
                if key not in seen:
                    seen.add(key)
                    cycles.append(" -> ".join(cycle) + " (" + ", ".join(
                        graph[x][y] for x, y in zip(cycle, cycle[1:])) + ")")
            elif len(path) < len(graph) + 1:
                visit(nxt, path + [nxt])

    for start in sorted(graph):
        visit(start, [start])
    return cycles


def test_imports_point_the_intended_way():
    found = violations(all_imports())
    assert not found, "imports against the layering:\n" + "\n".join(found)


def test_no_import_cycle_between_subpackages():
    cycles = package_cycles(all_imports())
    assert not cycles, "import cycles between megacoat's subpackages:\n" + "\n".join(cycles)


def test_the_checks_see_forbidden_imports():
    """The checks flag each kind of edge they exist for (so a silent parser cannot pass the tests above)."""
    edges = [("megacoat.fp8.blocks", "megacoat.model.gpt", "a:1"), ("megacoat.ops.rope", "megacoat.fp8.formats", "b:2"),
             ("megacoat.ops.rope", "transformers", "c:3"), ("megacoat.training.trainer", "benchmarks.bench", "d:4"),
             ("megacoat.ops.rope", "deepspeed.ops.op_builder.builder", "e:5")]
    assert [v.split(":")[0] for v in violations(edges)] == ["a", "b", "c", "d"]
    assert package_cycles([("megacoat.fp8.x", "megacoat.parallel.y", "f:1"),
                           ("megacoat.parallel.y", "megacoat.fp8.z", "g:2")]) == ["fp8 -> parallel -> fp8 (f:1, g:2)"]
    found = {dst for _, dst, _ in all_imports()}
    assert {"megacoat.ops.attention", "torch", "megacoat.fp8.linear"} <= found  # the parser reads real files
