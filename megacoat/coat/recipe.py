"""CoatRecipe: every FP8 choice of a run (activations, scaling, head, weight copies, optimizer), frozen.

Its defaults are the trainer's: `auto` fields are resolved once, at start-up, by `for_layout` (delayed scaling in
coat mode, the FP8 head wherever it runs); `convert_to_coat` takes resolved recipes only. RECIPES names the
recipes the CLI (`--fp8-recipe`), the benchmarks and the tests start from.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from megacoat.coat.group_scaling import GROUP_SIZES
from megacoat.ops.formats import FP8_GEMM_MULTIPLE

# bf16: no FP8. fp8-linear: FP8 GEMMs, BF16 activations saved. coat: the full FP8 precision flow (megacoat.coat.flow).
ACTIVATION_MODES = ("bf16", "fp8-linear", "coat")
FP8_DTYPES = ("e4m3", "e5m2")
# step: W8 and W8^T live from one optimizer step to the next; rowwise: W8 only, backward transposes its bytes (the
# same results); none: made per use (megacoat.coat.linear.Fp8WeightCache).
WEIGHT_CACHES = ("step", "rowwise", "none")
DEFAULT_WEIGHT_CACHE = "rowwise"
# current: COAT's just-in-time scaling; delayed: from an amax history (megacoat.coat.delayed_scaling).
GRAD_SCALINGS = ("current", "delayed")
ACTIVATION_SCALINGS = ("current", "delayed")
AUTO = "auto"
OUTPUT_LAYER_CHOICES = (AUTO, "on", "off")
DEFAULT_OUTPUT_LAYER = AUTO


def fp8_head_obstacle(tensor_model_parallel_size: int, vocab_size: int, hidden_size: int) -> str | None:
    """Why the FP8 head cannot run in this layout, in words for the banner, or None where it can (under pipeline
    parallelism it runs on the last stage, under tensor parallelism over vocabulary slices: megacoat.coat.head)."""
    if vocab_size % FP8_GEMM_MULTIPLE or hidden_size % FP8_GEMM_MULTIPLE:
        return f"the FP8 head needs vocabulary and hidden sizes that are multiples of {FP8_GEMM_MULTIPLE}"
    if vocab_size % (FP8_GEMM_MULTIPLE * tensor_model_parallel_size):
        return (f"the FP8 head needs each tensor-parallel rank's vocabulary slice to be a multiple of "
                f"{FP8_GEMM_MULTIPLE}")
    return None


@dataclass(frozen=True)
class CoatRecipe:
    mode: str = "bf16"  # ACTIVATION_MODES
    optimizer: bool = False  # CoatAdamW: FP8 Adam moments
    grad_dtype: str = "e5m2"  # output gradients fed to the backward GEMMs
    group_size: int = 128  # 1xG groups (non-linear layers and optimizer moments)
    weight_cache: str = DEFAULT_WEIGHT_CACHE
    fast_accum: bool = False  # forward GEMMs without fp32 promotion of their accumulators; backward always promotes
    grad_scaling: str = AUTO  # GRAD_SCALINGS or auto
    activation_scaling: str = AUTO  # ACTIVATION_SCALINGS or auto
    amax_history_len: int = 16  # delayed scaling: calls (micro-batches) whose amaxes set the scale
    output_layer: bool | str = AUTO  # the vocabulary head in FP8 (megacoat.coat.head): True, False or auto
    m_dtype: str = "e4m3"  # CoatAdamW's first moment
    v_dtype: str = "e4m3"  # and second moment
    expand: bool = True  # CoatAdamW's dynamic range expansion (megacoat.coat.expansion)

    def __post_init__(self):
        for name, value, allowed in (("--fp8-activations", self.mode, ACTIVATION_MODES),
                                     ("--fp8-grad-dtype", self.grad_dtype, FP8_DTYPES),
                                     ("--fp8-weight-cache", self.weight_cache, WEIGHT_CACHES),
                                     ("--fp8-grad-scaling", self.grad_scaling, (AUTO, *GRAD_SCALINGS)),
                                     ("--fp8-activation-scaling", self.activation_scaling,
                                      (AUTO, *ACTIVATION_SCALINGS)),
                                     ("--fp8-output-layer", self.output_layer, (AUTO, True, False)),
                                     ("--fp8-m-dtype", self.m_dtype, FP8_DTYPES),
                                     ("--fp8-v-dtype", self.v_dtype, FP8_DTYPES)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        for flag, choice in (("--fp8-activation-scaling", self.activation_scaling),
                             ("--fp8-grad-scaling", self.grad_scaling)):
            if choice == "delayed" and self.mode != "coat":
                raise ValueError(f"{flag} delayed applies to the coat precision flow: add --coat-fp8 or "
                                 f"--fp8-activations coat (the mode is {self.mode})")
        if self.amax_history_len < 1:
            raise ValueError(f"--fp8-amax-history-len must be at least 1, got {self.amax_history_len}")
        if self.output_layer is True and self.mode == "bf16":
            raise ValueError("--fp8-output-layer needs FP8 GEMMs: add --coat-fp8 or --fp8-activations")
        if self.fast_accum and self.mode == "bf16":
            raise ValueError("--fp8-fast-accum needs FP8 GEMMs: add --coat-fp8 or --fp8-activations")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"--fp8-group-size must be one of {'/'.join(map(str, GROUP_SIZES))}, "
                             f"got {self.group_size}")

    @property
    def enabled(self) -> bool:
        """Whether the model runs FP8 GEMMs."""
        return self.mode != "bf16"

    @property
    def resolved(self) -> bool:
        return AUTO not in (self.grad_scaling, self.activation_scaling, self.output_layer)

    def check_micro_batch(self, micro_batch_size: int, seq_length: int) -> None:
        """Refuse, at start-up, a micro-batch whose tokens the FP8 GEMMs cannot take (their weight gradients sum over
        the tokens, in multiples of FP8_GEMM_MULTIPLE): one ValueError naming the flags, where the first forward
        would raise on some ranks only (under a pipeline schedule, on one stage, mid-step)."""
        tokens = micro_batch_size * seq_length
        if self.enabled and tokens % FP8_GEMM_MULTIPLE:
            raise ValueError(f"--micro-batch-size {micro_batch_size} x --seq-length {seq_length} = {tokens} tokens a "
                             f"micro-batch: FP8 GEMMs ({self.mode}) need a multiple of {FP8_GEMM_MULTIPLE}")

    def for_layout(self, tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                   vocab_size: int | None = None, hidden_size: int | None = None) -> CoatRecipe:
        """This recipe with every auto resolved for a layout, and the explicit choices it cannot run refused (one
        ValueError naming the flag). Delayed scaling runs in every layout (a pipeline stage's histories are the
        one-stage run's: megacoat.coat.delayed_scaling); the FP8 head where fp8_head_obstacle finds none."""
        tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
        obstacle = fp8_head_obstacle(tp, FP8_GEMM_MULTIPLE if vocab_size is None else vocab_size,
                                     FP8_GEMM_MULTIPLE if hidden_size is None else hidden_size)
        if self.output_layer is True and obstacle:
            raise ValueError(f"--fp8-output-layer on: {obstacle} (got --vocab-size {vocab_size}, --hidden-size "
                             f"{hidden_size}, --tensor-model-parallel-size {tp}, --pipeline-model-parallel-size {pp})")
        auto_scaling = "delayed" if self.mode == "coat" else "current"
        return replace(self,
                       grad_scaling=auto_scaling if self.grad_scaling == AUTO else self.grad_scaling,
                       activation_scaling=auto_scaling if self.activation_scaling == AUTO else self.activation_scaling,
                       output_layer=(self.mode == "coat" and obstacle is None) if self.output_layer == AUTO
                       else self.output_layer)


RECIPES = {
    "bf16": CoatRecipe(),
    "fp8-linear": CoatRecipe(mode="fp8-linear"),
    "coat": CoatRecipe(mode="coat", optimizer=True),  # --coat-fp8: delayed scaling and the FP8 head where they run
    "coat-current": CoatRecipe(mode="coat", optimizer=True, grad_scaling="current", activation_scaling="current",
                               output_layer=False),  # COAT's own: just-in-time scaling, BF16 head
}
