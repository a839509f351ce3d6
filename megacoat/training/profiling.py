"""--profile-dir: torch.profiler over a window of training steps (Megatron's --profile-step-start/-end).

Each rank writes into the folder:
  trace_rank<r>.json      a Chrome/Perfetto trace of the window (open in ui.perfetto.dev)
  top_ops_rank<r>.json    the operators and kernels ranked by self device time (CPU time where there is no GPU),
                          with calls and the share of the window: where the step's time goes, in numbers
                          that a benchmark can keep beside its throughput.
"""
from __future__ import annotations

import json
import os

import torch
from torch.profiler import ProfilerActivity, profile


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

    def step(self, iteration: int) -> bool:
        """True when this call closed the window and wrote its files (time the caller should not count)."""
        if self.directory is None:
            return False
        if iteration == self.start and self._prof is None:
            self._begin()
        elif iteration == self.end and self._prof is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self._prof.__exit__(None, None, None)
            self._write(self._prof)
            self._prof = None
            return True
        return False

    def _write(self, prof) -> None:
        os.makedirs(self.directory, exist_ok=True)
        prof.export_chrome_trace(os.path.join(self.directory, f"trace_rank{self.rank}.json"))
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
        summary = {"steps": [self.start + 1, self.end], "time": "device" if on_device else "cpu",
                   "total_self_us": total, "top": rows[: self.top]}
        tmp = os.path.join(self.directory, f".top_ops_rank{self.rank}.json.tmp")
        with open(tmp, "w") as f:
            json.dump(summary, f, indent=1)
        os.replace(tmp, os.path.join(self.directory, f"top_ops_rank{self.rank}.json"))
