"""What the benchmark scripts share: the repository's paths, a run's environment record, atomic JSON writes,
tools/ scripts by name, and the per-call kernel sweeps' helpers (one call's time, the byte comparison every swept
setting must pass, tile parsing, the fastest setting per group, `SweepLog`).

Scripts run as modules from the repository root (`python -m benchmarks.kernels.cast_transpose`) and import this
first: under --cpu-smoke it sets TRITON_INTERPRET=1 before anything defines a Triton kernel."""
from __future__ import annotations

import os
import sys

if "--cpu-smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton and megacoat's kernels are imported

import importlib.util  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def environment() -> dict:
    """Versions, device and command of a run, for its JSON."""
    env = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
           "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
           "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        import deepspeed

        env["deepspeed"] = deepspeed.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        env.update(device=torch.cuda.get_device_name(), gpus_on_host=torch.cuda.device_count(), cuda=torch.version.cuda)
    return env


def free_port() -> int:
    """A TCP port free on this host now, for a launcher's rendezvous (a fixed one may still be held by an earlier
    run in TIME_WAIT)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def load_tool(name: str):
    """A script of tools/ (a folder of scripts, not a package) by its file name, loaded once."""
    module_name = f"_tools_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, os.path.join(ROOT, "tools", f"{name}.py"))
        sys.modules[module_name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[module_name])
    return sys.modules[module_name]


def fixed_recipe(mode: str, **choices):
    """A resolved CoatRecipe with COAT's just-in-time (current) scaling and the BF16 head unless `choices` say
    otherwise: what the per-layer and per-checkpoint measurements run, whatever the trainer's defaults are."""
    from megacoat.coat.recipe import CoatRecipe

    return CoatRecipe(**{"mode": mode, "grad_scaling": "current", "activation_scaling": "current",
                         "output_layer": False, **choices})


def saved_activation_bytes(fn, params=()) -> tuple[int, dict]:
    """Bytes autograd keeps for backward while fn() runs, over unique storages, parameters (and their views) left
    out: (total, {dtype name: bytes})."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, tuple[int, torch.dtype]] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip and storage.data_ptr() != 0:
            seen[storage.data_ptr()] = (storage.nbytes(), t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    by_dtype: dict[str, int] = {}
    for nbytes, dtype in seen.values():
        name = str(dtype).replace("torch.", "")
        by_dtype[name] = by_dtype.get(name, 0) + nbytes
    del out
    return sum(n for n, _ in seen.values()), by_dtype


def time_call_ms(fn, device: str, eager: bool = False) -> float:
    """Median milliseconds of one call: inside a CUDA graph (do_bench_cudagraph: many calls captured, so Python's
    launch cost is not timed), launched from Python with `eager`, or one wall-clock call under the interpreter."""
    if device == "cuda" and eager:
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    if device == "cuda":
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def sweep_device(cpu_smoke: bool) -> str | None:
    """"cpu" for --cpu-smoke, "cuda" where a GPU is; None after one error line when neither (exit 2)."""
    if cpu_smoke:
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    print("error: needs a CUDA GPU (or --cpu-smoke)", file=sys.stderr)
    return None


def start(cpu_smoke: bool, settings):
    """A sweep's settings (settings(): the library's and the swept ones, parsed; ValueError for a bad one) and its
    device: (device, settings), or None after one error line (a bad setting, no GPU), for the script's exit 2."""
    try:
        chosen = settings()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    device = sweep_device(cpu_smoke)
    return None if device is None else (device, chosen)


def same_bytes(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Equal bytes (FP8 codes compared as uint8, so NaN codes compare too), or both absent."""
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype.itemsize == 1 else torch.equal(a, b)


def parse_tile(text: str, flag: str, names: tuple[str, ...], max_warps: int) -> tuple[int, ...]:
    """A sweep's tile 'A:...:WARPS': every field but the last a power of two >= 16, the last a warp count (a power
    of two up to max_warps); anything else is one error naming the flag."""
    try:
        values = tuple(int(x) for x in text.split(":"))
    except ValueError:
        values = ()
    *sizes, warps = values or (0,)
    if (len(values) != len(names) or any(s < 16 or s & (s - 1) for s in sizes) or warps < 1 or warps & (warps - 1)
            or warps > max_warps):
        raise ValueError(f"{flag} takes {':'.join(names)}, {'/'.join(names[:-1])} a power of two >= 16, "
                         f"{names[-1]} a power of two up to {max_warps}: got {text!r}")
    return values


def best_rows(rows: list[dict], group, ms, is_library) -> list[tuple]:
    """Per group (in order of first appearance): (group, the fastest row that wrote the right bytes, its speedup
    over the library's row, how many rows with the right bytes the group has); groups without a library row are
    left out."""
    out = []
    for key in dict.fromkeys(map(group, rows)):
        ok = [r for r in rows if group(r) == key and r["same_bytes"]]
        library = [r for r in ok if is_library(r)]
        if library:
            best = min(ok, key=ms)
            out.append((key, best, ms(library[0]) / ms(best), len(ok)))
    return out


def run_fields(device: str) -> dict:
    """What every sweep's JSON records about its run: the command, the device, torch's and Triton's versions."""
    return {"command": "python " + " ".join(sys.argv),
            "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "triton": triton.__version__}


class SweepLog:
    """One sweep's rows and its JSON, written again after every row: a step that runs out of time keeps the rows it
    measured."""

    def __init__(self, path: str, device: str, what: str, timing: str = "cuda graph", **fields):
        self.path, self.rows = path, []
        self.head = {"what": what, **run_fields(device), **fields, "timing": timing}

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self.write(complete=False)

    def write(self, complete: bool) -> None:
        write_json(self.path, {**self.head, "results": self.rows, "complete": complete})

    def finish(self, lines: list[str]) -> int:
        """The whole JSON, then the summary lines; the exit status is 1 where a setting wrote other bytes than the
        library's."""
        self.write(complete=True)
        for line in lines:
            print(line)
        print("wrote", self.path)
        return 0 if all(r["same_bytes"] for r in self.rows) else 1


def write_json(path: str, result: dict) -> None:
    """Atomically (a temporary file, then a rename): a run stopped mid-write leaves the previous rows, never half
    a file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as fh:
        json.dump(result, fh, indent=1)
    os.replace(path + ".tmp", path)
