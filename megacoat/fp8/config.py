"""FP8Config: which activation precision mode the model runs in."""
from __future__ import annotations

from dataclasses import dataclass

from megacoat.ops.numerics import GROUP_SIZES

# bf16: baseline. fp8-linear: FP8 GEMMs, BF16 activations saved (like TransformerEngine's default).
# coat: the full FP8 precision flow (FP8 linears and non-linears, FP8 tensors saved for backward).
ACTIVATION_MODES = ("bf16", "fp8-linear", "coat")
FP8_DTYPES = ("e4m3", "e5m2")
# step: the FP8 weight copies (W8, W8^T) live from one optimizer step to the next (fast, +2 B per block-linear
# parameter). rowwise: only W8 lives; backward transposes its bytes (+1 B, one FP8 transpose per use, the same
# bytes as step's W8^T). none: made per use and dropped (no persistent bytes, ~3 extra weight reads per micro-batch).
WEIGHT_CACHES = ("step", "rowwise", "none")
# rowwise by default: the transpose costs ~1 ms a micro-batch for the 1.3 B model on an H100, and keeping both
# layouts ~1.15 GiB (benchmarks/results/bench_e2e_notes.md)
DEFAULT_WEIGHT_CACHE = "rowwise"
# current: each FP8 gradient scaled by its own amax. delayed: SwiGLU's and the [q|k|v] output's gradients in coat mode
# by the amaxes their earlier calls recorded (megacoat.fp8.delayed_scaling: one pass of SwiGLU's backward instead of
# two; RoPE's backward writes the FP8 [q|k|v] gradient itself, no BF16 copy).
GRAD_SCALINGS = ("current", "delayed")
# current: each FP8 activation scaled by its own amax. delayed: in coat mode the FP8 outputs of RMSNorm and SwiGLU
# and wo's input by the amaxes their earlier forwards recorded (one launch each instead of two).
ACTIVATION_SCALINGS = ("current", "delayed")
# The trainer's flags also take auto (their default): see resolve_scaling.
AUTO = "auto"
# --fp8-output-layer: auto resolves by resolve_output_layer; on and off as they say.
OUTPUT_LAYER_CHOICES = (AUTO, "on", "off")
# The trainer's default: auto, since the FP8 head's loss met the bar the BF16 head's default met (seed-paired gap to
# bf16: mean within 0.25%, 95% interval inside +-0.5%; the figures in resolve_output_layer).
DEFAULT_OUTPUT_LAYER = "auto"
# FP8 GEMMs (torch._scaled_mm / cuBLASLt) need their matrix sizes to be multiples of this.
FP8_GEMM_MULTIPLE = 16


def resolve_scaling(choice: str, mode: str, pipeline_model_parallel_size: int) -> str:
    """--fp8-grad-scaling / --fp8-activation-scaling auto: delayed where it applies (coat mode) and where the
    schedule allows it (no pipeline parallelism: its schedule runs several forwards before the first backward),
    current elsewhere. Delayed is the faster of the two (one pass of SwiGLU's backward and one launch per norm and
    SwiGLU forward instead of two), and its loss is as close to bf16's as current scaling's
    (benchmarks/results/fidelity_125m.json). current stays available by name: COAT's just-in-time scaling."""
    if choice != AUTO:
        return choice
    return "delayed" if mode == "coat" and pipeline_model_parallel_size == 1 else "current"


def resolve_output_layer(choice: str, mode: str, tensor_model_parallel_size: int, pipeline_model_parallel_size: int,
                         vocab_size: int, hidden_size: int) -> bool:
    """--fp8-output-layer auto|on|off: whether the output layer (the vocabulary head) runs in FP8.

    on and off are what they say (on where the head cannot run in FP8 is refused by the flags' validation). auto is
    on in coat mode wherever the FP8 head runs: one unsplit stage (no tensor or pipeline parallelism) and vocabulary
    and hidden sizes that are multiples of 16 (FP8 GEMMs). Elsewhere it keeps the BF16 head, as COAT, Megatron and
    torchtitan do: under TP or PP (the FP8 head is tested on one unsplit stage only), at sizes off the GEMM
    alignment, and in fp8-linear mode (its loss with the FP8 head is not measured).

    What the FP8 head gives and costs in coat mode, as measured (benchmarks/results/bench_e2e_notes.md and
    fidelity_notes.md, last sections):
      speed: ~2% faster steps; the 1.3 B model on an H100 at its largest micro-batch, 1.49-1.50x compiled bf16
             (1.498x at 17efaf3) against 1.467x with the BF16 head; on an H200, 1.532x since SwiGLU's forward
             reads whole rows
      loss: 350 M over 60 M tokens, +0.23% [-0.01, +0.47] against bf16 over 24 seed pairs (each pair on one kind of
            card), with the head's label correction (megacoat.fp8.head_loss), inside the bar the BF16 head met with
            -0.13% [-0.48, +0.21] (8 pairs). It likely costs ~0.2% of final loss: off keeps the BF16 head."""
    if choice not in OUTPUT_LAYER_CHOICES:
        raise ValueError(f"--fp8-output-layer must be one of {OUTPUT_LAYER_CHOICES}, got {choice!r}")
    if choice != AUTO:
        return choice == "on"
    return mode == "coat" and fp8_head_obstacle(tensor_model_parallel_size, pipeline_model_parallel_size, vocab_size,
                                                hidden_size) is None


def fp8_head_obstacle(tensor_model_parallel_size: int, pipeline_model_parallel_size: int, vocab_size: int,
                      hidden_size: int) -> str | None:
    """Why the FP8 head cannot run in this layout, in words for the banner, or None where it can (auto's test)."""
    if tensor_model_parallel_size > 1 or pipeline_model_parallel_size > 1:
        return "the FP8 head runs without tensor and pipeline parallelism only"
    if vocab_size % FP8_GEMM_MULTIPLE or hidden_size % FP8_GEMM_MULTIPLE:
        return f"the FP8 head needs vocabulary and hidden sizes that are multiples of {FP8_GEMM_MULTIPLE}"
    return None


@dataclass
class FP8Config:
    mode: str = "bf16"
    grad_dtype: str = "e5m2"  # dtype of output gradients fed to the backward GEMMs
    group_size: int = 128  # 1xG groups for non-linear layers
    weight_cache: str = DEFAULT_WEIGHT_CACHE
    # Forward GEMMs without the fp32 promotion of their accumulators (cuBLASLt's fast FP8 accumulation):
    # TransformerEngine's and torchao's forward default. Backward GEMMs always promote: gradients sum over
    # the tokens, where the tensor cores' limited accumulator precision loses the most.
    fast_accum: bool = False
    # The library's default is COAT's just-in-time scaling; the trainer's flags default to auto (resolve_scaling).
    grad_scaling: str = "current"
    activation_scaling: str = "current"
    amax_history_len: int = 16  # delayed scaling: calls (micro-batches) whose amaxes set the scale
    # The output layer (the vocabulary head) as an Fp8Linear too, its loss writing the logits' FP8 gradient and the
    # label entries' rounding error, which the head adds back (megacoat.fp8.head_loss). The library's default is the
    # BF16 head, as in COAT, Megatron and torchtitan; the trainer's is auto (DEFAULT_OUTPUT_LAYER,
    # resolve_output_layer): the FP8 head wherever it runs in coat mode.
    output_layer: bool = False

    def __post_init__(self):
        if self.mode not in ACTIVATION_MODES:
            raise ValueError(f"--fp8-activations mode must be one of {ACTIVATION_MODES}, got {self.mode!r}")
        if self.grad_dtype not in FP8_DTYPES:
            raise ValueError(f"--fp8-grad-dtype must be one of {FP8_DTYPES}, got {self.grad_dtype!r}")
        if self.weight_cache not in WEIGHT_CACHES:
            raise ValueError(f"--fp8-weight-cache must be one of {WEIGHT_CACHES}, got {self.weight_cache!r}")
        if self.grad_scaling not in GRAD_SCALINGS:
            raise ValueError(f"--fp8-grad-scaling must be one of {GRAD_SCALINGS}, got {self.grad_scaling!r}")
        if self.activation_scaling not in ACTIVATION_SCALINGS:
            raise ValueError(f"--fp8-activation-scaling must be one of {ACTIVATION_SCALINGS}, "
                             f"got {self.activation_scaling!r}")
        if self.activation_scaling == "delayed" and self.mode != "coat":
            raise ValueError("--fp8-activation-scaling delayed applies to the coat precision flow (the FP8 outputs of "
                             f"RMSNorm and SwiGLU): add --coat-fp8 or --fp8-activations coat (the mode is {self.mode})")
        if self.amax_history_len < 1:
            raise ValueError(f"--fp8-amax-history-len must be at least 1, got {self.amax_history_len}")
        if self.grad_scaling == "delayed" and self.mode != "coat":
            raise ValueError("--fp8-grad-scaling delayed applies to the coat precision flow (SwiGLU's FP8 gradient): "
                             f"add --coat-fp8 or --fp8-activations coat (the mode is {self.mode})")
        if self.output_layer and self.mode == "bf16":
            raise ValueError("--fp8-output-layer needs FP8 GEMMs: add --coat-fp8 or --fp8-activations")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"--fp8-group-size must be one of {'/'.join(map(str, GROUP_SIZES))}, "
                             f"got {self.group_size}")

    @property
    def enabled(self) -> bool:
        return self.mode != "bf16"

