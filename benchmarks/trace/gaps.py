"""Where a profiled step leaves the GPU idle, and what the host was doing then: a torch.profiler Chrome trace
(bench_e2e.py `--profile --traces DIR` keeps them) read gap by gap. A gap is time between two stretches of GPU
work (kernels, copies, memsets on any stream). For each gap it finds the launch of the work that ended it (by the
kernel's correlation id) and the host operators open around that launch, and the operators open on that thread
when the gap began; gaps are summed per (phase, host stack) so that the few host paths that starve the GPU stand
out. A gap whose ending work was launched after the gap began is the host's (the GPU waited for a launch); the
rest wait on something else (an event, a copy engine) and are counted apart. Gaps of any length are also summed by
size and by the work that ended them: inside a CUDA graph each kernel boundary costs the GPU a microsecond or two,
which only fewer kernels win back. Host waits (stream, device or event
synchronizes) are listed with their stacks: each drains the GPU's queue, exposing whatever host work follows.

    python -m benchmarks.trace.gaps TRACE.json.gz STEPS OUT.json [MIN_GAP_US]   # STEPS: profiled steps (3)
"""
from __future__ import annotations

import bisect
import collections
import gzip
import json
import sys

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATEGORIES = ("cpu_op", "user_annotation", "python_function")
HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
PHASE_PREFIX = "megacoat."
GAP_BUCKETS = ((2.0, "<2us"), (5.0, "2-5us"), (10.0, "5-10us"), (50.0, "10-50us"), (float("inf"), ">=50us"))


class HostStacks:
    """The host operators open at a given time on a given thread (outermost first). Operators on one thread
    nest, so each has a parent (the innermost one open when it started); those open at t are the last one to
    start before t, if still open, and its ancestors that are."""

    def __init__(self, events: list[dict]):
        by_tid = collections.defaultdict(list)
        for e in events:
            if e.get("ph") == "X" and e.get("cat") in HOST_CATEGORIES and "ts" in e:
                by_tid[e.get("tid")].append((e["ts"], -(e["ts"] + e.get("dur", 0)), e["name"]))
        self.ops, self.starts, self.parent = {}, {}, {}
        for tid, ops in by_tid.items():
            ops.sort()  # by start, the longer (outer) first
            parents, open_ = [], []
            for i, (s, neg_end, _) in enumerate(ops):
                while open_ and -ops[open_[-1]][1] < s:
                    open_.pop()
                parents.append(open_[-1] if open_ else -1)
                open_.append(i)
            self.ops[tid], self.starts[tid], self.parent[tid] = ops, [o[0] for o in ops], parents

    def at(self, tid, t: float) -> list[str]:
        ops, parent = self.ops.get(tid, []), self.parent.get(tid, [])
        i = bisect.bisect_right(self.starts.get(tid, []), t) - 1
        stack = []
        while i >= 0:
            if -ops[i][1] >= t:
                stack.append(ops[i][2])
            i = parent[i]
        return stack[::-1]


def launches_by_correlation(events: list[dict]) -> dict:
    """The host's runtime/driver call (a kernel launch, a graph launch, a memset) behind each correlation id: the
    id a kernel, copy or memset carries back to the call that issued it."""
    return {e["args"]["correlation"]: e for e in events
            if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}


def phase_of(stack: list[str]) -> str:
    return next((n for n in stack if n.startswith(PHASE_PREFIX)), "other")


def short(stack: list[str], depth: int) -> str:
    inner = [n for n in stack if not n.startswith(PHASE_PREFIX)][-depth:]
    return " > ".join(n[:70] for n in inner) or "(no operator open)"


def gap_table(events: list[dict], steps: int, min_gap_us: float = 10.0, depth: int = 3) -> dict:
    device = sorted((e["ts"], e["ts"] + e.get("dur", 0), e) for e in events
                    if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES and "ts" in e)
    launches = launches_by_correlation(events)
    host = HostStacks(events)
    main_tid = collections.Counter(e.get("tid") for e in launches.values()).most_common(1)
    main_tid = main_tid[0][0] if main_tid else None
    by_key = collections.defaultdict(lambda: [0, 0.0])
    not_host = [0, 0.0]
    sizes = collections.Counter()  # every gap, however short, by size: the cost of a kernel boundary
    before = collections.defaultdict(lambda: [0, 0.0])  # ... and by the work that ended it
    end = None
    for start, stop, e in device:
        if end is not None and start > end:
            gap = start - end
            sizes[next(label for bound, label in GAP_BUCKETS if gap < bound)] += gap
            before[e["name"][:80]][0] += 1
            before[e["name"][:80]][1] += gap
        if end is not None and start - end >= min_gap_us:
            gap = start - end
            launch = launches.get(e.get("args", {}).get("correlation"))
            if launch is not None and launch["ts"] > end:  # the GPU waited for this launch
                at_launch = host.at(launch.get("tid"), launch["ts"])
                at_start = host.at(launch.get("tid"), end)
                key = (phase_of(at_launch), short(at_start, depth), short(at_launch, depth))
                by_key[key][0] += 1
                by_key[key][1] += gap
            else:
                not_host[0] += 1
                not_host[1] += gap
        end = stop if end is None else max(end, stop)
    rows = [{"phase": k[0], "host_at_gap_start": k[1], "launch_that_ended_it": k[2], "gaps_per_step": n / steps,
             "ms_per_step": us / 1e3 / steps} for k, (n, us) in by_key.items()]
    rows.sort(key=lambda r: -r["ms_per_step"])
    waits = collections.Counter()
    for e in events:
        if e.get("cat") == "cuda_runtime" and e.get("name") in HOST_WAITS:
            waits[(e["name"], short(host.at(e.get("tid"), e["ts"]), depth))] += 1
    small = [{"next_work": n, "gaps_per_step": c / steps, "ms_per_step": us / 1e3 / steps}
             for n, (c, us) in sorted(before.items(), key=lambda kv: -kv[1][1])[:40]]
    return {"steps": steps, "min_gap_us": min_gap_us, "main_thread": main_tid,
            "all_gaps_ms_per_step": sum(sizes.values()) / 1e3 / steps,
            "gap_ms_per_step_by_size": {label: sizes[label] / 1e3 / steps for _, label in GAP_BUCKETS},
            "gaps_by_next_work": small,
            "host_gap_ms_per_step": sum(r["ms_per_step"] for r in rows),
            "other_gap_ms_per_step": not_host[1] / 1e3 / steps, "other_gaps_per_step": not_host[0] / steps,
            "gaps": rows,
            "host_waits": [{"name": n, "stack": s, "count": c} for (n, s), c in waits.most_common()]}


def main() -> None:
    path, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    min_gap = float(sys.argv[4]) if len(sys.argv) > 4 else 10.0
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    table = gap_table(events, steps, min_gap)
    with open(out, "w") as f:
        json.dump(table, f, indent=1)
    print(path, f"GPU idle per step: {table['host_gap_ms_per_step']:.2f} ms waiting for the host, "
          f"{table['other_gap_ms_per_step']:.2f} ms otherwise (gaps >= {min_gap} us)")
    for r in table["gaps"][:30]:
        print(f"{r['ms_per_step']:8.2f} ms {r['gaps_per_step']:6.1f}x {r['phase']:18s} "
              f"[{r['host_at_gap_start']}] -> [{r['launch_that_ended_it']}]")
    print(f"all gaps: {table['all_gaps_ms_per_step']:.2f} ms per step;",
          {k: round(v, 2) for k, v in table["gap_ms_per_step_by_size"].items()})
    for r in table["gaps_by_next_work"][:25]:
        print(f"  {r['ms_per_step']:6.2f} ms {r['gaps_per_step']:7.1f}x before {r['next_work']}")
    for w in table["host_waits"]:
        print(f"host wait x{w['count']}: {w['name']} in [{w['stack']}]")


if __name__ == "__main__":
    main()
