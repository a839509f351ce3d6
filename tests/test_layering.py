"""Which way imports point inside megacoat/, read from the source with `ast`, so that an import against the layering
fails here, on CPU, without running anything. The rule, top to bottom: `pretrain_gpt.py` -> `megacoat/arguments.py`
(the command line) -> `training` -> `megacoat/config.py` and the packages (`model`, `parallel`, `optim`, `data`,
the FP8 method `coat`, `checkpoint`) -> `ops` (the kernels). Checked:

  * `ops` imports only the standard library, torch, triton, numpy, DeepSpeed's op_builder (which builds the CUDA
    kernels) and `megacoat.ops` itself;
  * the FP8 method (`coat`, formerly `fp8`) imports no `model`, `training` or `parallel` code: converters act on
    the model from outside and never the other way;
  * nothing below `training` imports it: no package and not `megacoat/config.py`; only the command line may;
  * nothing in megacoat/ imports `tools`, `benchmarks` or `tests`;
  * the import graph of the packages and the root modules (`config`, `arguments`), read from the tree, has no cycle.

Every import statement counts, also one inside a function or under `if`: a lazy import is still a dependency.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "megacoat"
OPS_MAY_IMPORT = {"torch", "triton", "numpy"} | set(sys.stdlib_module_names)
OPS_MAY_IMPORT_MODULES = ("deepspeed.ops.op_builder",)
FP8_PACKAGES = ("coat", "fp8")  # the FP8 method's package, under its name before and after the move to coat/
FP8_MUST_NOT_IMPORT = ("model", "training", "parallel")
ABOVE_TRAINING = ("training", "arguments", "cli")  # the loop itself and the command line that starts it
OUTSIDE_THE_LIBRARY = ("tools", "benchmarks", "tests")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = PACKAGE.parent / Path(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports_in(source: str, name: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import statement anywhere in `source` (module `name`), function
    bodies included; `from a import b` gives `a.b` when b is a submodule, since the dependency is on it."""
    package = name if is_package else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source, name)):
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
                out.append((node.lineno, sub if is_module(sub) else base))
    return out


def all_imports() -> list[tuple[str, str, str]]:
    """(importing module, imported module, 'file:line') over megacoat/."""
    return [(module_name(path), target, f"{path.relative_to(PACKAGE.parent)}:{line}")
            for path in sorted(PACKAGE.rglob("*.py"))
            for line, target in imports_in(path.read_text(), module_name(path), path.name == "__init__.py")]


def unit(module: str) -> str | None:
    """The node of the layering a module belongs to: its subpackage (`megacoat.coat.linear` -> `coat`) or, for a
    root module, its own name (`megacoat.config` -> `config`); None for megacoat/__init__.py or outside megacoat."""
    parts = module.split(".")
    if parts[0] != "megacoat" or len(parts) < 2:
        return None
    if (PACKAGE / parts[1]).is_dir() or (PACKAGE / f"{parts[1]}.py").exists():
        return parts[1]
    return None


def violations(edges) -> list[str]:
    found = []
    for src, dst, where in edges:
        pkg, top, target = unit(src), dst.split(".")[0], unit(dst)
        if pkg == "ops" and top != "megacoat" and top not in OPS_MAY_IMPORT \
                and not dst.startswith(OPS_MAY_IMPORT_MODULES):
            found.append(f"{where}: ops imports {dst} (ops may import only stdlib/torch/triton/numpy/op_builder)")
        if pkg == "ops" and top == "megacoat" and target != "ops":
            found.append(f"{where}: ops imports {dst} (ops may import only megacoat.ops)")
        if pkg in FP8_PACKAGES and target in FP8_MUST_NOT_IMPORT:
            found.append(f"{where}: {pkg} imports {dst} ({pkg} knows no model, training or parallel code)")
        if pkg is not None and pkg not in ABOVE_TRAINING and target == "training":
            found.append(f"{where}: {src} imports {dst} (nothing below training/ imports it)")
        if top in OUTSIDE_THE_LIBRARY:
            found.append(f"{where}: {src} imports {dst} (the library never imports {top}/)")
    return found


def package_cycles(edges) -> list[str]:
    """Each cycle of the graph of packages and root modules once, with a file that makes each of its edges."""
    graph: dict[str, dict[str, str]] = {}
    for src, dst, where in edges:
        a, b = unit(src), unit(dst)
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


def test_no_import_cycle_between_packages_and_root_modules():
    cycles = package_cycles(all_imports())
    assert not cycles, "import cycles in megacoat/:\n" + "\n".join(cycles)


def test_the_checks_see_forbidden_imports():
    """The checks flag each kind of edge they exist for (so a silent parser cannot pass the tests above)."""
    edges = [("megacoat.coat.flow", "megacoat.model.gpt", "a:1"), ("megacoat.ops.rope", "megacoat.coat.linear", "b:2"),
             ("megacoat.ops.rope", "transformers", "c:3"), ("megacoat.training.trainer", "benchmarks.bench", "d:4"),
             ("megacoat.ops.rope", "deepspeed.ops.op_builder.builder", "e:5"),
             ("megacoat.data.sampler", "megacoat.training.trainer", "f:6"),
             ("megacoat.config", "megacoat.training", "g:7"),
             ("megacoat.arguments", "megacoat.training.errors", "h:8"),
             ("megacoat.training.trainer", "megacoat.config", "i:9")]
    assert [v.split(":")[0] for v in violations(edges)] == ["a", "b", "c", "d", "f", "g"]
    assert package_cycles([("megacoat.coat.x", "megacoat.parallel.y", "f:1"),
                           ("megacoat.parallel.y", "megacoat.coat.z", "g:2")]) == ["coat -> parallel -> coat (f:1, g:2)"]
    # a root module is a node too: the loop config <-> training is a cycle
    assert package_cycles([("megacoat.config", "megacoat.training", "g:7"), ("megacoat.training.trainer",
                                                                           "megacoat.config", "i:9")]) == [
        "config -> training -> config (g:7, i:9)"]
    found = {dst for _, dst, _ in all_imports()}
    assert {"megacoat.ops.attention", "torch", "megacoat.config"} <= found  # the parser reads real files


def test_imports_inside_functions_count():
    source = ("import os\n\n\ndef f():\n    if True:\n        from megacoat.training import trainer\n"
              "    from . import sampler\n\n\nclass C:\n    def g(self):\n        import megacoat.parallel.state\n")
    assert sorted(imports_in(source, "megacoat.data.builders", is_package=False)) == [
        (1, "os"), (6, "megacoat.training.trainer"), (7, "megacoat.data.sampler"), (12, "megacoat.parallel.state")]
