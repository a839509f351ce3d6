"""Run named benchmarks of the suite (benchmarks/suite.py), each in its own process with its time limit.

    python -m benchmarks.run --list
    python -m benchmarks.run e2e-1p3b-mb8 memory-1p3b --out results_dir
    python -m benchmarks.run gpu-tests --dry-run          # print the commands only

Each run writes its JSON into --out (default $OUT, else ./bench_out) and appends its output to run.log there: at
most 8 files, what the device machine sends back. A run that needs more GPUs than the machine has is skipped with
a line in the log; the exit status is 1 when any run failed or was skipped. On the lent GPU machine start it
through benchmarks/device.sh, which installs the carried wheels and sets the build environment first.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from benchmarks.suite import BY_NAME, SUITE, Run

MAX_FILES = 8  # what one device call returns
LOG = "run.log"


def command(run: Run, out_dir: str) -> list[str]:
    cmd = [sys.executable, "-m", run.module, *run.args]
    return cmd + (["--out", os.path.join(out_dir, run.out)] if run.out else [])


def gpus_here() -> int:
    import torch

    return torch.cuda.device_count()


def execute(runs: list[Run], out_dir: str) -> int:
    os.makedirs(out_dir, exist_ok=True)
    failed = 0
    with open(os.path.join(out_dir, LOG), "a") as log:
        for run in runs:
            cmd = command(run, out_dir)
            log.write(f"=== {run.name} (limit {run.limit_s}s): {' '.join(cmd[1:])}\n")
            log.flush()
            if run.gpus > gpus_here():
                log.write(f"=== {run.name}: skipped, needs {run.gpus} GPUs, this machine has {gpus_here()}\n")
                print(f"{run.name}: skipped (needs {run.gpus} GPUs)", flush=True)
                failed += 1
                continue
            t0 = time.perf_counter()
            try:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=run.limit_s).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            log.write(f"=== {run.name}: rc={rc} after {time.perf_counter() - t0:.0f}s\n")
            log.flush()
            print(f"{run.name}: rc={rc} after {time.perf_counter() - t0:.0f}s", flush=True)
            failed += rc != 0
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", metavar="NAME", help="named runs of benchmarks/suite.py")
    p.add_argument("--list", action="store_true", help="list the named runs")
    p.add_argument("--dry-run", action="store_true", help="print each run's command, run nothing")
    p.add_argument("--out", default=os.environ.get("OUT") or "bench_out", help="output folder (default $OUT)")
    args = p.parse_args(argv)
    if args.list:
        for run in SUITE:
            print(f"{run.name:22s} {run.gpus} GPU{'s' if run.gpus > 1 else ' '} {run.about}")
        return 0
    unknown = [name for name in args.names if name not in BY_NAME]
    if unknown or not args.names:
        print(f"error: unknown run {unknown[0]!r} (see --list)" if unknown else "error: name a run (see --list)",
              file=sys.stderr)
        return 2
    runs = [BY_NAME[name] for name in dict.fromkeys(args.names)]
    if sum(run.out is not None for run in runs) + 1 > MAX_FILES:
        print(f"error: {len(runs)} runs write more than {MAX_FILES} files with the log: split them", file=sys.stderr)
        return 2
    if args.dry_run:
        for run in runs:
            print(" ".join(command(run, args.out)))
        return 0
    return execute(runs, args.out)


if __name__ == "__main__":
    sys.exit(main())
