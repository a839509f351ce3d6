"""The training log: one human line per --log-interval on rank 0 and, with --log-json, one JSON object per
logged iteration (keys: iteration, loss, lr, grad_norm, tokens_per_s, tflops_per_gpu, mfu, max_memory_bytes,
max_memory_reserved_bytes (GPU only, else null), skipped_steps, plus val_loss lines at evaluations). The same
scalars go to TensorBoard (--tensorboard-dir) and wandb (--wandb-project) when asked for.

A resumed run (--load) keeps the JSON lines up to the checkpoint's iteration and appends after them, so the
file of an interrupted-and-resumed run reads like the file of an uninterrupted one.
"""
from __future__ import annotations

import json
import math
import os

SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_gpu", "mfu", "max_memory_bytes",
           "max_memory_reserved_bytes", "skipped_steps")


def _fmt_count(x: float) -> str:
    for unit, div in (("M", 1e6), ("k", 1e3)):
        if x >= div:
            return f"{x / div:.2f}{unit}"
    return f"{x:.0f}"


class TensorBoardBackend:
    def __init__(self, log_dir: str):
        from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package

        self.writer = SummaryWriter(log_dir=log_dir)

    def log(self, scalars: dict, step: int) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbBackend:
    """wandb is optional: imported only when --wandb-project is given; offline without an API key (the run
    is synced later with `wandb sync`)."""

    def __init__(self, project: str, run_name: str | None, config: dict | None, log_dir: str | None):
        try:
            import wandb
        except ImportError:
            raise RuntimeError("--wandb-project needs the `wandb` package (pip install wandb), which is not "
                               "installed") from None
        if not os.environ.get("WANDB_API_KEY") and "WANDB_MODE" not in os.environ:
            os.environ["WANDB_MODE"] = "offline"
        self.run = wandb.init(project=project, name=run_name, config=config, dir=log_dir, resume="allow")

    def log(self, scalars: dict, step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class TrainingLogger:
    def __init__(self, json_path: str | None, enabled: bool, *, resume: bool = False,
                 tensorboard_dir: str | None = None, wandb_project: str | None = None,
                 wandb_run_name: str | None = None, run_config: dict | None = None):
        """resume: keep an existing JSON log for `truncate_after` to trim once the checkpoint is known."""
        self.enabled = enabled
        self.json_path = json_path if enabled else None
        self.backends = []
        if self.json_path:
            os.makedirs(os.path.dirname(os.path.abspath(self.json_path)), exist_ok=True)
            if not resume:
                open(self.json_path, "w").close()  # a new run starts a new log
        if enabled and tensorboard_dir:
            self.backends.append(TensorBoardBackend(tensorboard_dir))
        if enabled and wandb_project:
            self.backends.append(WandbBackend(wandb_project, wandb_run_name, run_config, tensorboard_dir))

    def truncate_after(self, iteration: int) -> None:
        """Drop JSON lines past `iteration` (logged after the checkpoint a resumed run starts from)."""
        if not self.json_path or not os.path.exists(self.json_path):
            return
        with open(self.json_path) as f:
            keep = [line for line in f if line.strip() and json.loads(line).get("iteration", 0) <= iteration]
        tmp = self.json_path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(keep)
        os.replace(tmp, self.json_path)

    def _write_json(self, record: dict) -> None:
        if self.json_path:
            with open(self.json_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def _to_backends(self, scalars: dict, step: int) -> None:
        finite = {k: float(v) for k, v in scalars.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        for backend in self.backends:
            backend.log(finite, step)

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
        if record.get("max_memory_reserved_bytes") is not None:
            line += f" (reserved {record['max_memory_reserved_bytes'] / 2**30:.2f})"
        if record.get("skipped_steps"):
            line += f" | skipped {record['skipped_steps']}"
        print(line, flush=True)
        self._write_json(record)
        self._to_backends({f"train/{k}": record.get(k) for k in SCALARS}, record["iteration"])

    def log_eval(self, iteration: int, val_loss: float) -> None:
        if not self.enabled:
            return
        print(f"iter {iteration:>6} | validation loss {val_loss:.4f}", flush=True)
        self._write_json({"iteration": iteration, "val_loss": val_loss})
        self._to_backends({"eval/loss": val_loss}, iteration)

    def close(self) -> None:
        for backend in self.backends:
            backend.close()
        self.backends = []
