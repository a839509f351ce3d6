"""Where a profiled step's GPU time goes, kernel by kernel: a torch.profiler Chrome trace (bench_e2e.py
`--profile --traces DIR` keeps them) summarised as GPU time per step by kernel name (kernels, device copies and
memsets), with a split into categories (FP8/BF16 GEMMs, attention, megacoat's Triton kernels, Inductor's fused
kernels, the optimizer, copies), and the same time by (kernel, the host operators that launched it): a kernel
replayed in a CUDA graph is launched by the graph, so its source names the compiled graph (forward or backward),
and an eager one names the operator. It prints the top kernels and writes the JSON.

    python -m benchmarks.trace.kernels TRACE.json.gz STEPS OUT.json   # STEPS: profiled steps in the trace (3)
"""
from __future__ import annotations

import collections
import gzip
import json
import os
import sys

from benchmarks.trace.gaps import HostStacks, launches_by_correlation, short


def category(name: str) -> str:
    low = name.lower()
    if "memcpy" in low:
        return "memcpy"
    if "memset" in low:
        return "memset"
    if any(k in low for k in ("nvjet", "gemm", "xmma", "cutlass")):
        return "gemm"
    if any(k in low for k in ("sdpa", "flash", "fmha", "attention")):
        return "attention"
    if "adamw" in low or "multi_tensor" in low:
        return "optimizer"
    if low.startswith("triton_"):
        return "inductor"
    if low.startswith("_") and "kernel" in low:
        return "megacoat_triton"
    return "other"


def kernel_table(path: str, steps: int, top: int = 150) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    table = _by_name(events, steps, top)
    table["trace"] = path
    table["by_source"] = kernels_by_source(events, steps, top)
    return table


def kernels_by_source(events: list[dict], steps: int, top: int = 400, depth: int = 4) -> list[dict]:
    """GPU time per step by (kernel name, the innermost host operators open at its launch)."""
    launches = launches_by_correlation(events)
    host = HostStacks(events)
    rows = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        launch = launches.get(e.get("args", {}).get("correlation"))
        source = short(host.at(launch.get("tid"), launch["ts"]), depth) if launch else "(launch not in trace)"
        row = rows[(e["name"][:120], source)]
        row[0] += 1
        row[1] += e.get("dur", 0)
    out = [{"name": n, "source": src, "calls_per_step": c / steps, "ms_per_step": us / 1e3 / steps}
           for (n, src), (c, us) in rows.items()]
    out.sort(key=lambda r: -r["ms_per_step"])
    return out[:top]


def _by_name(events: list[dict], steps: int, top: int) -> dict:
    by_name = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        cat = e.get("cat", "")
        if e.get("ph") != "X" or cat not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        name = e["name"] if cat == "kernel" else f"{cat}:{e['name']}"
        by_name[name][0] += 1
        by_name[name][1] += e.get("dur", 0)
    cats = collections.defaultdict(float)
    rows = []
    for name, (calls, us) in by_name.items():
        cats[category(name)] += us / 1e3 / steps
        rows.append({"name": name[:160], "calls_per_step": calls / steps, "ms_per_step": us / 1e3 / steps,
                     "cat": category(name)})
    rows.sort(key=lambda r: -r["ms_per_step"])
    return {"steps": steps, "total_ms_per_step": sum(r["ms_per_step"] for r in rows),
            "categories": dict(sorted(cats.items(), key=lambda kv: -kv[1])), "kernels": rows[:top]}


def main() -> None:
    path, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    table = kernel_table(path, steps)
    with open(out, "w") as f:
        json.dump(table, f, indent=1)
    print(path, "GPU ms per step", round(table["total_ms_per_step"], 1),
          {k: round(v, 1) for k, v in table["categories"].items()})
    for r in table["kernels"][:40]:
        print(f"{r['ms_per_step']:8.2f} {r['calls_per_step']:7.1f} {r['cat']:15s} {r['name'][:110]}")
    print("by launching host operators:")
    for r in table["by_source"][:int(os.environ.get("KERNEL_SOURCE_ROWS", 60))]:
        print(f"{r['ms_per_step']:8.2f} {r['calls_per_step']:7.1f} {r['name'][:60]:60s} [{r['source'][:100]}]")


if __name__ == "__main__":
    main()
