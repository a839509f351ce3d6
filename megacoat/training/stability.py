"""The stability guard: a step whose loss or gradients are not finite is skipped (the weights, optimizer
state and LR schedule stay as they were), counted in the log, and after --max-skipped-steps skips in a row
the run stops without saving, so the last good checkpoint stays the newest.

Who skips: DeepSpeed's ZeRO-1/2 and bf16 optimizers already refuse a non-finite gradient norm (they report
it as an overflow: `engine.was_step_applied()` is False and the LR scheduler does not move). In bf16 under
ZeRO-1/2 the refusal is decided on the device instead (deepspeed_patches.py: the weights and moments stay, the LR
schedule moves on), and the guard learns of it when the trainer reads the counts (`absorb`). Plain fp32
data parallelism (ZeRO-0 without bf16) hands the step straight to the torch optimizer, which would write NaN
into the weights; `skip_fp32_step` makes that step a no-op the same way DeepSpeed's own skip behaves, so
DeepSpeed's micro/global step counters stay consistent in every mode.
"""
from __future__ import annotations


def skip_fp32_step(engine) -> None:
    """Make the coming `engine.step()` of a plain (non-ZeRO, non-bf16) engine apply nothing. DeepSpeed still
    clips (so the gradients become finite zeros rather than disappear), calls the optimizer (a no-op for this
    one step) and then reads an `overflow` flag on it: that is how its engine learns that a step was skipped
    (it counts it and holds the LR scheduler, as for its own ZeRO/bf16 skips)."""
    for p in engine.module.parameters():
        if p.grad is not None:
            p.grad.zero_()
    engine.optimizer.step = _no_step
    engine.optimizer.overflow = True


def _no_step(*args, **kwargs):
    return None


def clear_skip_flag(engine) -> None:
    """Undo skip_fp32_step after the step (no-op otherwise)."""
    if engine.optimizer.__dict__.get("step") is _no_step:
        del engine.optimizer.step
        del engine.optimizer.overflow


class StabilityGuard:
    def __init__(self, max_skipped_steps: int | None):
        self.max_skipped_steps = max_skipped_steps
        self.consecutive = 0
        self.longest = 0  # the longest run in a row seen (runs counted on the device end between two reads)
        self.since_log = 0

    def record(self, skipped: bool, iteration: int, loss, grad_norm: float | None) -> None:
        """Count a step (the log reads the count before `check` may stop the run)."""
        if not skipped:
            self.consecutive = 0
            return
        self.consecutive += 1
        self.longest = max(self.longest, self.consecutive)
        self.since_log += 1
        self.last = (iteration, loss, grad_norm)

    def absorb(self, refused: int, run: int, longest: int, iteration: int) -> None:
        """Counts read from the device (deepspeed_patches.SkipCounter.read) at `iteration`: refused steps since the last
        read, the run in a row at its end, and the longest run. Which steps they were, and their loss, stay on the
        device: the stop message names the iteration of the read."""
        if refused:
            self.since_log += refused
            self.last = (iteration, None, None)
        self.consecutive = run
        self.longest = max(self.longest, longest)

    def check(self) -> None:
        """Raise once --max-skipped-steps steps in a row were skipped."""
        if self.max_skipped_steps is not None and self.longest >= self.max_skipped_steps:
            iteration, loss, grad_norm = self.last
            if loss is None:  # counted on the device: which steps they were, and their loss, were never read
                what = (f"by iteration {iteration}: {self.longest} steps in a row skipped for a non-finite loss or "
                        "gradient")
            else:
                grad_norm = None if grad_norm is None else float(grad_norm)  # a device tensor until read here
                what = (f"iteration {iteration}: {self.longest} steps in a row skipped for a non-finite loss or "
                        f"gradient (loss {float(loss)}, grad norm {grad_norm})")
            raise NonFiniteTrainingError(f"{what}; stopping (--max-skipped-steps {self.max_skipped_steps}). "
                                         "No checkpoint was written after the last good one.")

    def pop_since_log(self) -> int:
        n, self.since_log = self.since_log, 0
        return n


class NonFiniteTrainingError(RuntimeError):
    pass
