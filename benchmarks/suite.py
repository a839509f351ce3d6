"""The benchmark suite: recipes (what a mode trains with), model shapes, and the named runs that
`python -m benchmarks.run NAME` executes. A run is declarative: a script, its arguments, how long it may take and
which JSON it writes; the runner adds only the output folder.

A recipe is each mode's best configuration on one GPU; where a layout refuses CUDA graphs (pipeline parallelism)
the parallel benchmark drops `--enable-cuda-graph` and says so in its JSON.
"""
from __future__ import annotations

from dataclasses import dataclass, field

TRAINER = "pretrain_gpt.py"
PEER = "benchmarks.parallel.torchtitan_peer"
# recipe -> (script: a path under the repository root or a module run with -m, its flags)
RECIPES: dict[str, tuple[str, list[str]]] = {
    "bf16": (TRAINER, ["--compile"]),
    # the trainer's default FP8 recipe: delayed scaling, the FP8 head wherever it runs (`auto`)
    "coat": (TRAINER, ["--coat-fp8", "--compile", "--enable-cuda-graph"]),
    # the default with its sequence-parallel all-gathers in FP8 (the FP8 gather's A/B under TP)
    "coat-fp8-gather": (TRAINER, ["--coat-fp8", "--sequence-parallel-gather", "fp8", "--compile",
                                   "--enable-cuda-graph"]),
    # COAT's own just-in-time (current) scaling at every site
    "coat-current": (TRAINER, ["--coat-fp8", "--fp8-grad-scaling", "current", "--fp8-activation-scaling", "current",
                               "--compile", "--enable-cuda-graph"]),
    # FP8 GEMMs only; activations saved in BF16
    "fp8-linear": (TRAINER, ["--fp8-activations", "fp8-linear", "--compile", "--enable-cuda-graph"]),
    # peers: torchao's float8 linears (tensorwise) in the same trainer; a plain loop without DeepSpeed or the trainer
    "torchao-float8": ("benchmarks.e2e.torchao_pretrain", ["--compile"]),
    "plain-llama": ("benchmarks.e2e.plain_llama", ["--compile"]),
    # multi-GPU peers (benchmarks/parallel/speed.py, data-parallel layouts): torchtitan's float8 recipes as torchao
    # applies them, under FSDP2 and torch.compile; the FP8 all-gather of weights with tensorwise scales
    "torchtitan-float8-tensorwise": (PEER, ["--float8", "tensorwise", "--compile"]),
    "torchtitan-float8-rowwise": (PEER, ["--float8", "rowwise", "--compile"]),
    "torchtitan-bf16": (PEER, ["--float8", "none", "--compile"]),
}
GRAPH_FLAG = "--enable-cuda-graph"

MODELS: dict[str, list[str]] = {
    "tiny": ["--num-layers", "2", "--hidden-size", "128", "--ffn-hidden-size", "256", "--num-attention-heads", "4",
             "--seq-length", "64", "--vocab-size", "256"],
    "1.3b": ["--num-layers", "24", "--hidden-size", "2048", "--ffn-hidden-size", "5632", "--num-attention-heads", "16",
             "--seq-length", "2048", "--vocab-size", "32000"],
    # Llama-2-7B, as in COAT's paper
    "7b": ["--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "11008", "--num-attention-heads", "32",
           "--seq-length", "2048", "--vocab-size", "32000"],
    # Llama 3 8B: grouped-query attention with 8 KV heads, its own vocabulary, RoPE base and untied head
    "llama3-8b": ["--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
                  "--num-attention-heads", "32", "--num-query-groups", "8", "--seq-length", "8192",
                  "--vocab-size", "128256", "--rotary-base", "500000", "--untie-embeddings-and-output-weights"],
}


@dataclass(frozen=True)
class Run:
    """One named run: `python -m module args` (or a plain command), writing `out` (a file name) into the output
    folder; `gpus` is what the machine must have, `limit_s` the time it may take."""
    name: str
    about: str
    module: str
    args: list[str] = field(default_factory=list)
    out: str | None = None  # the flag --out gets this file in the output folder; None: the run writes no JSON
    gpus: int = 1
    limit_s: int = 570


E2E = "benchmarks.e2e.speed"
PARALLEL = "benchmarks.parallel.speed"
# e2e method: warm-up, >= 30 timed iterations, 2 repeats interleaved across modes
E2E_METHOD = ["--warmup", "5", "--iters", "30", "--log-interval", "5", "--repeats", "2"]
# parallel method: >= 20 timed iterations after warm-up, 2 repeats, a global batch of 32 sequences
PARALLEL_METHOD = ["--warmup", "4", "--iters", "20", "--log-interval", "4", "--repeats", "2", "--global-batch-size", "32",
                   "--profile"]
# Llama3-8B at sequence 8192: 8 sequences a step, the tokens of the 7 B runs' 32 sequences of 2048
LLAMA3_METHOD = [*PARALLEL_METHOD[:PARALLEL_METHOD.index("--global-batch-size")], "--global-batch-size", "8",
                 *PARALLEL_METHOD[PARALLEL_METHOD.index("--global-batch-size") + 2:]]

SUITE: list[Run] = [
    Run("gpu-tests", "the GPU test suite", "pytest", ["-q", "-m", "gpu", "-rfE", "-p", "no:cacheprovider", "tests"],
        limit_s=480),
    Run("e2e-1p3b-mb8", "1.3 B model, one GPU, micro-batch 8: compiled bf16 against the default", E2E,
        ["--model", "1.3b", "--micro-batch-size", "8", "--modes", "bf16", "coat", *E2E_METHOD],
        out="e2e_1p3b_mb8.json"),
    Run("e2e-1p3b-peers", "1.3 B model, one GPU, micro-batch 8: the default against torchao's float8 and fp8-linear",
        E2E, ["--model", "1.3b", "--micro-batch-size", "8", "--modes", "bf16", "coat", "torchao-float8", "fp8-linear",
              *E2E_METHOD], out="e2e_1p3b_peers_mb8.json"),
    Run("e2e-1p3b-largest", "1.3 B model, one GPU, each mode at its largest micro-batch (bf16 16, the default 32)",
        E2E, ["--model", "1.3b", "--at-largest", "bf16@16", "coat@32", *E2E_METHOD],
        out="e2e_1p3b_largest.json"),
    Run("memory-1p3b", "1.3 B model, one GPU: peak memory at micro-batch 4 and 8, compiled without CUDA graphs "
        "(the allocated peak is the footprint)", E2E,
        ["--model", "1.3b", "--micro-batch-size", "4", "8", "--modes", "bf16", "coat", "--no-cuda-graph",
         "--warmup", "5", "--iters", "5", "--log-interval", "5", "--repeats", "1"], out="memory_1p3b_mb4_8.json"),
    Run("e2e-1p3b-profile", "1.3 B model, one GPU, micro-batch 4: where the step's time goes (GPU-busy fraction, "
        "kernels per step, top operators)", E2E,
        ["--model", "1.3b", "--micro-batch-size", "4", "--modes", "bf16", "coat", "--profile", "--warmup", "5",
         "--iters", "10", "--log-interval", "5", "--repeats", "1"], out="e2e_1p3b_profile_mb4.json"),
    Run("kernels", "the step's memory-bound kernels per call against a device copy, at the library's tiles",
        "benchmarks.kernels.delayed_scaling", ["--repeats", "3"], out="kernels_delayed_scaling.json", limit_s=300),
    Run("optimizer", "CoatAdamW's step against fused fp32 AdamW, 1.0 B parameters", "benchmarks.optimizer.speed",
        [], out="optimizer_step.json", limit_s=300),
    Run("parallel-1p3b-2gpu", "1.3 B model on 2 GPUs, micro-batch 4: DP=2 (ZeRO-2) and TP=2 with SP", PARALLEL,
        ["--gpus", "2", "--model", "1.3b", "--layouts", "dp", "tp", "--micro-batch-size", "4", *PARALLEL_METHOD],
        out="parallel_1p3b_2gpu_mb4.json", gpus=2),
    Run("parallel-7b-4gpu", "7 B model on 4 GPUs, micro-batch 1: DP=4 (ZeRO-2) and TP=2 x DP=2", PARALLEL,
        ["--gpus", "4", "--model", "7b", "--layouts", "dp", "tp2dp2", "--micro-batch-size", "1", *PARALLEL_METHOD],
        out="parallel_7b_4gpu_mb1.json", gpus=4),
*[Run(f"parallel-7b-{layout}-mb{mb}", f"7 B model on 4 GPUs, micro-batch {mb}: {about}", PARALLEL,
         ["--gpus", "4", "--model", "7b", "--layouts", layout, "--micro-batch-size", str(mb), *PARALLEL_METHOD],
         out=f"parallel_7b_{layout}_mb{mb}.json", gpus=4)
     for layout, about in (("dp-z1", "DP=4, ZeRO-1"), ("dp-z2", "DP=4, ZeRO-2"), ("tp2dp2", "TP=2 x DP=2 with SP"),
                           ("tp4", "TP=4 with SP"))
     for mb in (1, 2)],
    Run("parallel-llama3-8b-mb1", "Llama3-8B on 4 GPUs, micro-batch 1: DP=4 (ZeRO-2), compiled bf16 against the "
        "default", PARALLEL, ["--gpus", "4", "--model", "llama3-8b", "--layouts", "dp", "--micro-batch-size", "1",
                              *LLAMA3_METHOD], out="parallel_llama3_8b_mb1.json", gpus=4),
    # one peer recipe a run (two would not fit one device call), each against the default in the same run
    *[Run(f"parallel-llama3-8b-{peer}-mb1", f"Llama3-8B on 4 GPUs, micro-batch 1: the default (DP=4, ZeRO-2) "
          f"against torchtitan's float8 {peer} (FSDP2, compiled)", PARALLEL,
          ["--gpus", "4", "--model", "llama3-8b", "--layouts", "dp", "--micro-batch-size", "1", "--modes", "coat",
           f"torchtitan-float8-{peer}", *LLAMA3_METHOD], out=f"parallel_llama3_8b_{peer}_mb1.json", gpus=4)
      for peer in ("tensorwise", "rowwise")],
    Run("parallel-7b-tp4-gather-mb1", "7 B model on 4 GPUs, micro-batch 1, TP=4 with SP: the default's FP8 "
        "all-gathers against the same run gathering bf16", PARALLEL,
        ["--gpus", "4", "--model", "7b", "--layouts", "tp4", "--micro-batch-size", "1", "--modes", "coat",
         "coat-fp8-gather", *PARALLEL_METHOD], out="parallel_7b_tp4_gather_mb1.json", gpus=4),
    *[Run(f"sp-gather-{n}gpu", f"the sequence-parallel all-gather alone on {n} GPUs (7 B's hidden size, sequence "
          "2048, compiled): bf16 against E4M3 codes with 1x128 scales", "benchmarks.parallel.sp_gather",
          ["--gpus", str(n), "--hidden-size", "4096", "--seq-length", "2048", "--micro-batch-size", "1", "2",
           "--compile"], out=f"sp_gather_{n}gpu.json", gpus=n, limit_s=300) for n in (2, 4)],
    # pipelines (issue targets): the default with its per-slot stage graphs against compiled bf16
    Run("parallel-1p3b-pp2-mb4", "1.3 B model on 2 GPUs, micro-batch 4: PP=2", PARALLEL,
        ["--gpus", "2", "--model", "1.3b", "--layouts", "pp", "--micro-batch-size", "4", *PARALLEL_METHOD],
        out="parallel_1p3b_pp2_mb4.json", gpus=2),
    *[Run(f"parallel-7b-{layout}-mb{mb}", f"7 B model on 4 GPUs, micro-batch {mb}: {about}", PARALLEL,
          ["--gpus", "4", "--model", "7b", "--layouts", layout, "--micro-batch-size", str(mb), *PARALLEL_METHOD],
          out=f"parallel_7b_{layout}_mb{mb}.json", gpus=4)
      for layout, about in (("tp2pp2", "TP=2 with SP x PP=2"), ("pp", "PP=4"))
      for mb in (1, 2)],
]
BY_NAME = {run.name: run for run in SUITE}
