"""Preprocessing throughput against raw sentencepiece, and the GPT dataset's read rate (CPU).

    python -m benchmarks.data.preprocess [--rounds 3] [--out benchmarks/results/bench_preprocess.json]

Corpus: the default corpus's text (the Python stdlib sources) written as JSONL, tokenized with its tokenizer.
Each round times, back to back, raw single-threaded `sentencepiece` encoding of the same documents (already in
memory: no reading, no JSON) and the preprocessor with 1 and 2 workers (reading, JSON, tokenizing, writing
shards, process start-up included). Medians over rounds; the per-worker ratio is
(preprocessor tokens/s / workers) / raw tokens/s, target >= 0.8. The read rate is tokens/s of
`GPTDataset[i]` over shuffled samples, files in the page cache, target >= 10 M tokens/s.
The machine may be shared: the JSON records the load average, and tokens per CPU-second (which other jobs
barely move) beside the wall-clock rates. With Linux's sched_autogroup (recorded too), all processes of one
session share one CPU share: while other sessions keep the cores busy, extra workers add CPU time to the
session's group, not throughput, and only the 1-worker and CPU-second figures are meaningful.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time

import numpy as np  # noqa: E402
import sentencepiece as spm  # noqa: E402

from benchmarks.common import RESULTS  # noqa: E402

from megacoat.data.default_corpus import prepare_default_corpus, stdlib_source_files  # noqa: E402
from megacoat.data.gpt_dataset import GPTDataset  # noqa: E402
from megacoat.data.indexed_dataset import IndexedDataset  # noqa: E402
from megacoat.data.preprocessing import preprocess  # noqa: E402
from megacoat.data.sources import iter_documents  # noqa: E402


def cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the preprocessor's workers, once joined)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def raw_sentencepiece(model: str, docs: list[str]) -> tuple[float, float, int]:
    sp = spm.SentencePieceProcessor(model_file=model)
    t, c = time.perf_counter(), cpu_seconds()
    ids = sp.encode(docs, num_threads=1)
    return time.perf_counter() - t, cpu_seconds() - c, sum(len(x) for x in ids)


def preprocessor(model: str, jsonl: str, out: str, workers: int) -> tuple[float, float, int]:
    t, c = time.perf_counter(), cpu_seconds()
    r = preprocess([jsonl], out, model, workers=workers, progress=False)
    return time.perf_counter() - t, cpu_seconds() - c, r.num_tokens


def read_rate(prefix: str, seq_length: int, num_samples: int) -> dict:
    ds = GPTDataset(IndexedDataset(prefix), 0, len(IndexedDataset(prefix)), seq_length, num_samples, seed=0)
    for i in range(min(num_samples, 2000)):  # warm the page cache and the code path
        ds[i]
    best = None
    for _ in range(3):
        t = time.perf_counter()
        n = 0
        for i in range(num_samples):
            n += len(ds[i])
        dt = time.perf_counter() - t
        best = dt if best is None else min(best, dt)
    return dict(seq_length=seq_length, samples=num_samples, seconds=round(best, 4),
                tokens_per_s=round(num_samples * (seq_length + 1) / best), samples_per_s=round(num_samples / best))


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=os.path.join(RESULTS, "data_preprocess.json"))
    args = p.parse_args()

    corpus = prepare_default_corpus(progress=False)
    model = corpus.tokenizer_model
    docs = [d for d in iter_documents(stdlib_source_files(), input_format="text") if d]
    work = tempfile.mkdtemp(prefix="bench_preprocess_")
    jsonl = os.path.join(work, "stdlib.jsonl")
    with open(jsonl, "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    print(f"corpus: {len(docs)} documents, {os.path.getsize(jsonl) / 1e6:.1f} MB of JSONL; "
          f"tokenizer vocab {spm.SentencePieceProcessor(model_file=model).get_piece_size()}")

    rows = {"raw": [], "w1": [], "w2": []}
    cpu_rows = {"raw": [], "w1": [], "w2": []}  # tokens per CPU-second: robust to other load on the machine
    load = []
    for r in range(args.rounds):
        load.append(os.getloadavg()[0])
        dt, cpu, n_raw = raw_sentencepiece(model, docs)
        rows["raw"].append(n_raw / dt)
        cpu_rows["raw"].append(n_raw / cpu)
        for w in (1, 2):
            dt, cpu, n = preprocessor(model, jsonl, os.path.join(work, f"out{w}"), w)
            rows[f"w{w}"].append((n - len(docs)) / dt)  # content tokens only: the EOD ids are not encoded
            cpu_rows[f"w{w}"].append((n - len(docs)) / cpu)
        print(f"round {r}: raw {rows['raw'][-1] / 1e6:.3f}  1 worker {rows['w1'][-1] / 1e6:.3f}  "
              f"2 workers {rows['w2'][-1] / 1e6:.3f} M tokens/s  (load average {load[-1]:.1f})")
    med = {k: statistics.median(v) for k, v in rows.items()}
    ratios_per_round = {w: [rows[f"w{w}"][i] / w / rows["raw"][i] for i in range(args.rounds)] for w in (1, 2)}
    result_pre = {
        "raw_sentencepiece_tokens_per_s": round(med["raw"]),
        "preprocess_1_worker_tokens_per_s": round(med["w1"]),
        "preprocess_2_workers_tokens_per_s": round(med["w2"]),
        "per_worker_ratio_1": round(statistics.median(ratios_per_round[1]), 3),
        "per_worker_ratio_2": round(statistics.median(ratios_per_round[2]), 3),
        "per_round": {k: [round(x) for x in v] for k, v in rows.items()},
        # Tokens per CPU-second of all processes involved (main + workers) over raw sentencepiece's: the
        # pipeline's overhead without the noise of other jobs competing for the cores.
        "cpu_efficiency_1_worker": round(statistics.median(
            [a / b for a, b in zip(cpu_rows["w1"], cpu_rows["raw"])]), 3),
        "cpu_efficiency_2_workers": round(statistics.median(
            [a / b for a, b in zip(cpu_rows["w2"], cpu_rows["raw"])]), 3),
        "per_round_tokens_per_cpu_s": {k: [round(x) for x in v] for k, v in cpu_rows.items()},
        "target_per_worker_ratio": 0.8,
    }
    prefix = os.path.join(work, "out1")
    reads = [read_rate(prefix, s, n) for s, n in ((2048, 3000), (512, 10000), (128, 20000))]
    for r in reads:
        print(f"read: seq {r['seq_length']}: {r['tokens_per_s'] / 1e6:.1f} M tokens/s "
              f"({r['samples_per_s']} samples/s)")
    print(f"per-worker ratio (wall): 1 worker {result_pre['per_worker_ratio_1']}, 2 workers "
          f"{result_pre['per_worker_ratio_2']} (target >= 0.8); CPU efficiency: 1 worker "
          f"{result_pre['cpu_efficiency_1_worker']}, 2 workers {result_pre['cpu_efficiency_2_workers']}")
    out = {
        "benchmark": "bench_preprocess",
        "command": " ".join([sys.executable.split("/")[-1]] + sys.argv),
        "device": f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "load_average_during_rounds": [round(x, 2) for x in load],
        "sched_autogroup": _read("/proc/sys/kernel/sched_autogroup_enabled"),
        "versions": {"python": platform.python_version(), "sentencepiece": spm.__version__,
                     "numpy": np.__version__},
        "corpus": {"documents": len(docs), "jsonl_bytes": os.path.getsize(jsonl),
                   "tokens": int(IndexedDataset(prefix).num_tokens)},
        "preprocess": result_pre,
        "read": reads,
        "target_read_tokens_per_s": 10_000_000,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
