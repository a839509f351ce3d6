"""--profile-dir: torch.profiler over a window of training steps (Megatron's --profile-step-start/-end).

Each rank writes into the folder:
  trace_rank<r>.json      a Chrome/Perfetto trace of the window (open in ui.perfetto.dev)
  top_ops_rank<r>.json    operators and kernels ranked by self device time (CPU time without a GPU), with calls
                          and share of the window, and the window's `device` summary (`device_summary`): the
                          GPU-busy fraction, kernel launches and host synchronisations per step, and the GPU's
                          idle time split by the phase the host was in (`annotate_engine`).

The window starts and ends with the GPU drained, so its wall time holds exactly its steps. The profiler's own
bookkeeping slows the host a little: compare modes profiled the same way.
"""
from __future__ import annotations

import json
import os
import time

import functools

import torch
from torch.profiler import ProfilerActivity, profile, record_function

PHASE_PREFIX = "megacoat."  # record_function names of the training phases (annotate_engine, plain loops)


class StepProfiler:
    """Profiles iterations start < it <= end: call `step(it)` after every training iteration."""

    def __init__(self, directory: str | None, start: int, end: int, rank: int, top: int = 40):
        self.directory, self.start, self.end, self.rank, self.top = directory, start, end, rank, top
        self._prof = None
        if directory is not None and start == 0:
            self._begin()

    def _begin(self) -> None:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._prof = profile(activities=activities, record_shapes=False)
        self._prof.__enter__()
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # nothing queued before the window runs inside it
        self._t0 = time.perf_counter()

    def step(self, iteration: int) -> bool:
        """True when this call closed the window and wrote its files (time the caller should not count)."""
        if self.directory is None:
            return False
        if iteration == self.start and self._prof is None:
            self._begin()
        elif iteration == self.end and self._prof is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            wall_us = (time.perf_counter() - self._t0) * 1e6
            self._prof.__exit__(None, None, None)
            self._write(self._prof, wall_us)
            self._prof = None
            return True
        return False

    def _write(self, prof, wall_us: float) -> None:
        os.makedirs(self.directory, exist_ok=True)
        trace_path = os.path.join(self.directory, f"trace_rank{self.rank}.json")
        prof.export_chrome_trace(trace_path)
        with open(trace_path) as f:
            events = json.load(f).get("traceEvents", [])
        on_device = torch.cuda.is_available()
        rows = []
        for e in prof.key_averages():
            self_us = e.self_device_time_total if on_device else e.self_cpu_time_total
            if self_us > 0:
                rows.append({"name": e.key, "calls": e.count, "self_us": self_us,
                             "self_cpu_us": e.self_cpu_time_total})
        rows.sort(key=lambda r: -r["self_us"])
        total = sum(r["self_us"] for r in rows) or 1.0
        for r in rows:
            r["share"] = r["self_us"] / total
        device = device_summary(events, wall_us, self.end - self.start, own_waits=2 if on_device else 0)
        summary = {"steps": [self.start + 1, self.end], "time": "device" if on_device else "cpu",
                   "total_self_us": total, "device": device, "top": rows[: self.top]}
        tmp = os.path.join(self.directory, f".top_ops_rank{self.rank}.json.tmp")
        with open(tmp, "w") as f:
            json.dump(summary, f, indent=1)
        os.replace(tmp, os.path.join(self.directory, f"top_ops_rank{self.rank}.json"))


# Trace categories of work that occupies the GPU, and runtime calls that make the host wait for it.
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals: time during which at least one of them runs (kernels on
    several streams overlap; counting each would exceed the wall time)."""
    return sum(b - a for a, b in merged(intervals))


def device_summary(events: list[dict], wall_us: float, steps: int, own_waits: int = 0) -> dict:
    """What the window's trace says about feeding the GPU: its busy fraction (union of kernel, copy and memset
    time over wall time; None without GPU events), kernels and host waits (stream/device/event synchronize,
    less `own_waits`, the profiler's own synchronizes that bound the window) per step. A host-bound step has a
    low busy fraction and, usually, many short kernels; a host wait drains the GPU's queue."""
    device = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in events
              if e.get("cat") in DEVICE_CATEGORIES and "ts" in e]
    kernels = sum(1 for e in events if e.get("cat") == "kernel")
    waits = sum(1 for e in events if e.get("cat") == "cuda_runtime" and e.get("name") in HOST_WAITS)
    busy = busy_us(device)
    phases = [(e["name"], e["ts"], e["ts"] + e.get("dur", 0)) for e in events
              if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(PHASE_PREFIX)]
    return {"wall_us": wall_us, "steps": steps,
            "gpu_busy_us": busy if device else None,
            "gpu_busy_fraction": busy / wall_us if device and wall_us > 0 else None,
            "kernels_per_step": kernels / steps, "host_waits_per_step": max(waits - own_waits, 0) / steps,
            "gpu_idle_ms_per_step_by_phase": {name: us / 1e3 / steps
                                              for name, us in idle_by_phase(device, phases).items()}}


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def idle_by_phase(device: list[tuple[float, float]], phases: list[tuple[str, float, float]]) -> dict[str, float]:
    """The GPU's idle time between its first and last activity, split by the host phase it overlaps (name ->
    microseconds; "other" where no phase was open: the loop's own work). Phases do not nest."""
    busy = merged(device)
    gaps = [(a_end, b_start) for (_, a_end), (b_start, _) in zip(busy, busy[1:])]
    out: dict[str, float] = {}
    for g0, g1 in gaps:
        left = g1 - g0
        for name, p0, p1 in phases:
            overlap = min(g1, p1) - max(g0, p0)
            if overlap > 0:
                out[name] = out.get(name, 0.0) + overlap
                left -= overlap
        if left > 0:
            out["other"] = out.get("other", 0.0) + left
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def annotate_engine(engine) -> None:
    """Name the engine's forward, backward and step in profiler traces (megacoat.forward/backward/step), so
    the device summary can say in which phase the GPU waited for the host. record_function costs a few
    microseconds per call; the trainer applies this only when it profiles."""
    for name in ("forward", "backward", "step"):
        method = getattr(engine, name)

        @functools.wraps(method)
        def annotated(*args, _method=method, _label=PHASE_PREFIX + name, **kwargs):
            with record_function(_label):
                return _method(*args, **kwargs)
        setattr(engine, name, annotated)
