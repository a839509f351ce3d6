"""Leaving on time: SIGTERM/SIGUSR1 (what Slurm sends before a job's time limit or a preemption),
--exit-interval and --exit-duration-in-mins. The handler only sets a flag; the loop asks `should_exit` at
each iteration boundary, where every rank agrees (a MAX all-reduce), saves and exits 0."""
from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist

EXIT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class ExitConditions:
    def __init__(self, device: torch.device, exit_interval: int | None = None,
                 exit_duration_in_mins: float | None = None, install_handlers: bool = True):
        self.device = device
        self.exit_interval = exit_interval
        self.deadline = None if exit_duration_in_mins is None else time.monotonic() + 60.0 * exit_duration_in_mins
        self.received: int | None = None
        self._previous = {}
        if install_handlers:
            for sig in EXIT_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = signum  # no I/O here: the loop is mid-step; it acts at the next boundary

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def should_exit(self, iteration: int) -> str | None:
        """Collective: the reason to stop after `iteration`, the same on every rank, or None."""
        flags = [self.received is not None, self.deadline is not None and time.monotonic() >= self.deadline]
        if dist.is_initialized() and dist.get_world_size() > 1:
            # One small all-reduce per iteration: a signal delivered to one rank only (or the clock read a little
            # differently on each rank) must still stop all of them at the same iteration, or they deadlock.
            # Reading it back waits for the GPU; a world of one decides on the host and never waits.
            reduced = torch.tensor(flags, dtype=torch.int32, device=self.device)
            dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
            flags = reduced.tolist()
        signalled, timed_out = flags
        if signalled:
            name = signal.Signals(self.received).name if self.received is not None else "a signal on another rank"
            return f"received {name}"
        if timed_out:
            return "--exit-duration-in-mins reached"
        if self.exit_interval and iteration % self.exit_interval == 0:
            return f"--exit-interval {self.exit_interval} reached"
        return None
