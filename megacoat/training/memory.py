"""Per-GPU memory estimate of a megacoat run (weights, gradients, optimizer states, activations) for the modes
bf16 / fp8-linear / coat, AdamW or CoatAdamW, ZeRO-0/1/2/3 and TP/PP sizes; tools/memory_estimator.py is its CLI.

Model state is counted in bytes per parameter of this rank, as DeepSpeed holds it in a bf16 run: ZeRO-1 divides
the master weights, moments and the step's gradient copy by the data-parallel size D, ZeRO-2 the gradients too,
ZeRO-3 the weights too, plus what it gathers: the whole weights of two blocks (the running one and the one
prefetched; in coat mode their GEMM weights as E4M3, training/zero3_fp8_gather.py), the FP8 copy of one block's
GEMM weights made per use (ZeRO-3 keeps no weight cache), and its reduce bucket, which it allocates whole
(reduce_bucket_size elements of the weights' dtype).
The step's gradient copy depends on what the ZeRO patches read in place (training/deepspeed_patches.py).
Activations are bytes saved for backward per token per layer (ACTIVATION_BYTES, COMPILED_ACTIVATION_BYTES: per
h hidden, f FFN hidden, a heads), measured from autograd's saved tensors and re-measured by
tests/tools/test_memory_estimator.py; the head's logits and their gradient are added on the last stage.

Peak = weights + gradients + optimizer + the larger of: the activations of the micro-batches in flight (with
1F1B the first stage holds `pp` of them) plus the head, or the step's gradient copy. Allocator fragmentation is
not modelled, nor DeepSpeed's communication buckets outside the copy out of a CUDA graph's pool (there ZeRO-1's
bucket is one of reduce_bucket_size elements, or under --overlap-grad-reduce two smaller ones); under
--enable-cuda-graph torch.cuda.max_memory_allocated undercounts the graph pool, so measured peaks are a lower
bound there.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from megacoat.coat.recipe import DEFAULT_WEIGHT_CACHE, WEIGHT_CACHES
from megacoat.model.config import ModelConfig
from megacoat.training.deepspeed_config import overlap_bucket_size

MODES = ("bf16", "fp8-linear", "coat")
MAIN_GRADS_DTYPES = ("fp32", "bf16")
MAIN_PARAMS_DTYPES = ("fp32", "bf16-remainder")
# DeepSpeed's reduce_bucket_size, which megacoat's generated config leaves at its default (elements)
DEEPSPEED_REDUCE_BUCKET = 500_000_000
# DeepSpeed's ZeRO-3 sub_group_size (elements): its step converts one sub-group's gradients at a time
DEEPSPEED_SUB_GROUP = 1_000_000_000
ACTIVATION_BYTES = {  # per token per layer: (per h, per f, per head)
    "bf16": (24, 8, 0),
    "fp8-linear": (23, 7, 0),
    "coat": (10, 2, 18),
}
COMPILED_ACTIVATION_BYTES = {  # the same for a compiled block (Inductor's min-cut partition)
    "bf16": (16, 6, 4),
    "fp8-linear": (15, 5, 4),
    "coat": (10, 2, 18),
}


@dataclass
class MemoryEstimate:
    """`gradients` live through forward and backward (the accumulated sums); `step_gradients` are the copies
    made while the activations are gone: inside the optimizer step, or, with CUDA graphs and gradient accumulation,
    the copy out of the graph pool after the first micro-batch. The peak is the larger of the two phases."""
    weights: int
    gradients: int
    optimizer: int
    activations: int
    step_gradients: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + max(self.activations, self.step_gradients)

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def block_linear_parameters(cfg: ModelConfig) -> int:
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    kv = cfg.num_query_groups * cfg.head_dim
    return cfg.num_layers * (2 * h * h + 2 * h * kv + 3 * h * f)


def activation_bytes_per_token_per_layer(cfg: ModelConfig, mode: str, compiled: bool = False) -> int:
    ch, cf, ca = (COMPILED_ACTIVATION_BYTES if compiled else ACTIVATION_BYTES)[mode]
    return ch * cfg.hidden_size + cf * cfg.ffn_hidden_size + ca * cfg.num_attention_heads


def estimate_memory(cfg: ModelConfig, mode: str = "bf16", *, micro_batch_size: int = 1, seq_length: int | None = None,
                    data_parallel_size: int = 1, zero_stage: int = 0, tensor_parallel_size: int = 1,
                    pipeline_parallel_size: int = 1, fp8_optimizer: bool = False, fp8_group_size: int = 128,
                    bf16: bool = True, fp8_weight_cache: str = DEFAULT_WEIGHT_CACHE, main_grads_dtype: str = "bf16",
                    main_params_dtype: str = "fp32", compiled: bool = False,
                    graphed_accumulation: bool = False, fp8_output_layer: bool = False,
                    zero3_weight_gather: str = "bf16", overlap_grad_reduce: bool = False) -> MemoryEstimate:
    """Bytes on the busiest GPU (the first pipeline stage for activations, the last for the head). compiled:
    --compile (also --enable-cuda-graph), whose blocks and loss save less (see the module docstring).
    graphed_accumulation: --enable-cuda-graph with more than one micro-batch a step (gradients laid flat; not
    under pipeline parallelism).
    fp8_output_layer: --fp8-output-layer (the head an FP8 linear too). zero3_weight_gather: --zero3-weight-gather
    (ZeRO-3 in coat mode: the blocks' GEMM weights gathered as E4M3, fp8, or in the weights' dtype).
    overlap_grad_reduce: --overlap-grad-reduce (DeepSpeed's two reduction buckets of Megatron's size)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if main_grads_dtype not in MAIN_GRADS_DTYPES or main_params_dtype not in MAIN_PARAMS_DTYPES:
        raise ValueError(f"main_grads_dtype must be one of {MAIN_GRADS_DTYPES} and main_params_dtype one of "
                         f"{MAIN_PARAMS_DTYPES}, got {main_grads_dtype!r}, {main_params_dtype!r}")
    remainders = main_params_dtype == "bf16-remainder"
    if remainders and not (bf16 and fp8_optimizer and zero_stage in (1, 2) and main_grads_dtype == "bf16"):
        raise ValueError("main_params_dtype bf16-remainder needs bf16, CoatAdamW, ZeRO-1/2 and bf16 main gradients")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
    if zero_stage == 3 and mode != "bf16" and fp8_weight_cache != "none":
        raise ValueError("zero_stage 3 keeps no FP8 weight copies: fp8_weight_cache must be none")
    if fp8_weight_cache not in WEIGHT_CACHES:
        raise ValueError(f"fp8_weight_cache must be one of {WEIGHT_CACHES}, got {fp8_weight_cache!r}")
    if fp8_output_layer and mode == "bf16":
        raise ValueError("fp8_output_layer needs an FP8 mode")
    for name, v in (("micro_batch_size", micro_batch_size), ("data_parallel_size", data_parallel_size),
                    ("tensor_parallel_size", tensor_parallel_size), ("pipeline_parallel_size", pipeline_parallel_size)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    seq = seq_length or cfg.seq_length
    tp, pp, dp = tensor_parallel_size, pipeline_parallel_size, data_parallel_size
    # Parameters on this rank: block weights split over TP and PP stages; the vocabulary over TP.
    embed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_embeddings else 2)
    blocks = cfg.num_parameters() - embed
    params = blocks / (tp * pp) + embed / tp

    zero_div_master = dp if zero_stage >= 1 else 1
    zero_div_grad = dp if zero_stage >= 2 else 1
    if zero_stage == 3:
        if tp > 1 or pp > 1:
            raise ValueError("zero_stage 3 runs without tensor and pipeline parallelism")
        activations = estimate_activations(cfg, mode, micro_batch_size, seq, tp, pp, compiled, fp8_output_layer)
        return _zero3_estimate(cfg, mode, params, dp, moments_bytes(fp8_optimizer, fp8_group_size), bf16,
                               main_grads_dtype, activations, zero3_weight_gather == "fp8")
    moments = moments_bytes(fp8_optimizer, fp8_group_size)
    # a pipeline stage's graphs hand each gradient out of the pool as it is made (parallel/stage_graphs.py): no copy
    graphed_accumulation = graphed_accumulation and pp == 1
    if bf16:
        weights = 2 * params
        step_gradients = 0.0
        if main_grads_dtype == "fp32":
            gradients = 4 * params / zero_div_grad if zero_stage == 2 else 6 * params
        else:
            gradients = 2 * params / zero_div_grad
            # ZeRO-1 reads a flat partition in place (the reduced buffer; on one rank, graphed gradients); else a copy
            flat = 0 if zero_stage == 1 and (dp > 1 or graphed_accumulation) else 2
            step_gradients = (flat + (0 if remainders else 4)) * params / zero_div_master
        optimizer = ((2 if remainders else 4) + moments) * params / zero_div_master
        if graphed_accumulation:  # the copy out of the graph pool: both copies, and ZeRO-1's reduction bucket
            elements = 2 * overlap_bucket_size(dp) if overlap_grad_reduce else DEEPSPEED_REDUCE_BUCKET
            bucket = 2 * elements if zero_stage == 1 and dp > 1 and main_grads_dtype == "bf16" else 0
            step_gradients = max(step_gradients, 2 * params + bucket)
    else:
        weights = 4 * params
        gradients, step_gradients = 4 * params / zero_div_grad, 0.0
        optimizer = moments * params / zero_div_master
    if mode != "bf16" and fp8_weight_cache != "none":  # the E4M3 weight cache: W and W^T (step) or W (rowwise)
        cached = block_linear_parameters(cfg) / (tp * pp)
        if fp8_output_layer:  # the head's weight (tied or not), on the last stage
            cached += cfg.vocab_size * cfg.hidden_size / tp
        weights += (2 if fp8_weight_cache == "step" else 1) * cached

    activations = estimate_activations(cfg, mode, micro_batch_size, seq, tp, pp, compiled, fp8_output_layer)
    return MemoryEstimate(int(weights), int(gradients), int(optimizer), int(activations), int(step_gradients))


def moments_bytes(fp8_optimizer: bool, fp8_group_size: int) -> float:
    """Adam's two moments, bytes a parameter: CoatAdamW's FP8 codes with their group scales, or AdamW's fp32."""
    return 2 * (1 + 6 / fp8_group_size) if fp8_optimizer else 8


def _zero3_estimate(cfg: ModelConfig, mode: str, params: float, dp: int, moments: float, bf16: bool,
                    main_grads_dtype: str, activations: float, fp8_gather: bool) -> MemoryEstimate:
    """ZeRO-3 (module docstring): every part of the model state over D, plus the gathered blocks. DeepSpeed keeps
    an fp32 master partition even in fp32 runs (a clone), and its step turns each sub-group's gradient partition
    into one flat fp32 copy (a flatten, then a cast where the gradients are bf16)."""
    shard = params / dp
    width = 2 if bf16 else 4
    embed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_embeddings else 2)
    block = (cfg.num_parameters() - embed) / cfg.num_layers
    linears = block_linear_parameters(cfg) / cfg.num_layers
    if mode == "coat" and fp8_gather:  # the GEMM weights gathered as E4M3, then joined per GEMM (wq|wk|wv, w1|w3),
        # from the E4M3 codes of this rank's shards, kept from one step to the next
        weights = (width * shard + 2 * (linears + width * (block - linears)) + linears
                   + block_linear_parameters(cfg) / dp)
    else:  # gathered in the weights' dtype, and in an FP8 mode quantized per use
        weights = width * shard + 2 * width * block + (linears if mode != "bf16" else 0)
    grad_width = 4 if (not bf16 or main_grads_dtype == "fp32") else 2
    gradients = grad_width * shard + width * DEEPSPEED_REDUCE_BUCKET  # its reduce bucket, allocated whole
    step = min(shard, DEEPSPEED_SUB_GROUP) * (grad_width + (4 if grad_width == 2 else 0))
    return MemoryEstimate(int(weights), int(gradients), int((4 + moments) * shard), int(activations), int(step))


def estimate_activations(cfg: ModelConfig, mode: str, micro_batch_size: int, seq: int, tp: int, pp: int,
                         compiled: bool, fp8_output_layer: bool) -> float:
    """Activations saved for backward on the busiest stage, plus the head's (module docstring)."""
    tokens = micro_batch_size * seq
    layers_per_stage = cfg.num_layers / pp
    in_flight = pp  # 1F1B: the first stage keeps pp micro-batches' activations
    per_layer = activation_bytes_per_token_per_layer(cfg, mode, compiled) / tp
    # the compiled loss keeps bf16 logits only, and backward starts with their bf16 gradient beside them; the FP8
    # head's fused loss (megacoat.coat.head), compiled or not, keeps them and writes the FP8 gradient's 2 layouts
    logit_bytes = 4 if (compiled or fp8_output_layer) and tp == 1 else 10
    norm_bytes = 4 if compiled and tp == 1 else 8  # the final norm's saved input (2 compiled, 6 eager) + the head's 2
    if fp8_output_layer:
        norm_bytes -= 1  # the head saves its input as E4M3
    head = (norm_bytes * cfg.hidden_size + logit_bytes * cfg.vocab_size / tp) * tokens
    if fp8_output_layer:  # its label corrections' float32 copy of dW (megacoat.ops.label_corrections) comes after
        # the logits and their FP8 gradient (4 bytes a logit) are freed: it raises the head's peak only where it is
        # the larger
        head += max(0, 4 * cfg.vocab_size * (cfg.hidden_size - tokens))
    activations = per_layer * tokens * layers_per_stage * in_flight + (head if pp == 1 else 0)
    if pp > 1:  # the last stage: one micro-batch of its layers plus the head, if that is the larger
        activations = max(activations, per_layer * tokens * layers_per_stage + head)
    return activations
