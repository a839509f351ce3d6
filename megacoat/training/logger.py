"""The training log: one human line per --log-interval on rank 0 and, with --log-json, one JSON object per
logged iteration (keys: iteration, loss, lr, grad_norm, tokens_per_s, tflops_per_gpu, mfu, max_memory_bytes,
plus val_loss lines at evaluations)."""
from __future__ import annotations

import json
import os


def _fmt_count(x: float) -> str:
    for unit, div in (("M", 1e6), ("k", 1e3)):
        if x >= div:
            return f"{x / div:.2f}{unit}"
    return f"{x:.0f}"


class TrainingLogger:
    def __init__(self, json_path: str | None, enabled: bool):
        self.enabled = enabled
        self.json_path = json_path if enabled else None
        if self.json_path:
            os.makedirs(os.path.dirname(os.path.abspath(self.json_path)), exist_ok=True)
            open(self.json_path, "w").close()  # a new run starts a new log (resume appends after this)

    def _write_json(self, record: dict) -> None:
        if self.json_path:
            with open(self.json_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def info(self, message: str) -> None:
        if self.enabled:
            print(message, flush=True)

    def log_train(self, record: dict, train_iters: int) -> None:
        if not self.enabled:
            return
        mfu = "-" if record["mfu"] is None else f"{100 * record['mfu']:.1f}%"
        tflops = "-" if record["tflops_per_gpu"] is None else f"{record['tflops_per_gpu']:.2f}"
        line = (f"iter {record['iteration']:>6}/{train_iters} | loss {record['loss']:.4f} | lr {record['lr']:.3e} | "
                f"grad norm {record['grad_norm']:.3f} | {_fmt_count(record['tokens_per_s'])} tok/s | "
                f"{tflops} TFLOP/s/GPU | MFU {mfu} | mem {record['max_memory_bytes'] / 2**30:.2f} GiB")
        if record.get("skipped_steps"):
            line += f" | skipped {record['skipped_steps']}"
        print(line, flush=True)
        self._write_json(record)

    def log_eval(self, iteration: int, val_loss: float) -> None:
        if not self.enabled:
            return
        print(f"iter {iteration:>6} | validation loss {val_loss:.4f}", flush=True)
        self._write_json({"iteration": iteration, "val_loss": val_loss})
