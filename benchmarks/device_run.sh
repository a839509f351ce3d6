#!/usr/bin/env bash
# One device call = one group of GPU evidence, sized to fit a 10-minute call. Run from the repository root on the
# lent GPU machine, with `.whl` (DeepSpeed and its wheels, see shared/device/README.md) carried:
#
#     bash benchmarks/device_run.sh GROUP
#
# Results go to $OUT (at most 8 files come back: the JSON/PNG results plus one logs.tgz with every command's
# output); copy them into benchmarks/results/ afterwards. Each command has its own time limit, so one that hangs
# or fails leaves the others' results intact. $DEFAULT_MODE below is the trainer's default as bench_e2e names it
# (coat-fp8-head: delayed scaling, the head in FP8). Groups, in the order a session should take them:
#   kernels     (~8 min, 1 GPU) GPU tests (pytest -m gpu) but CoatAdamW's, bench_quant         issues 6, 16
#   gpu-suite   (~4 min, 1 GPU) every GPU test (pytest -m gpu), then bench_delayed_scaling (SwiGLU's
#               backward and the norm's and SwiGLU's forward per call, current vs delayed scaling)   issue 17
#   gpu-tests   (~4 min, 1 GPU) every GPU test (pytest -m gpu) alone: a kernel change's check   issue 17
#   graph-loss  (~4 min, 1 GPU) graph_loss_agreement.py: 200 steps of the default model in coat (its default
#               scaling) eager, compiled and CUDA-graphed, and a second seed: do they learn the same   issue 17
#   kernel-sweep (~7 min, 1 GPU) bench_cast_transpose (every linear operand's FP8 cast) with other tiles, then
#               bench_delayed_scaling with other tiles of SwiGLU's forward and backward kernels and other warps
#               per row of RMSNorm's forward; each tile checked for the library's bytes          issue 17
#   suite-sweep (~9.5 min, 1 GPU) every GPU test, then kernel-sweep's two sweeps (fewer tiles and repeats) in the
#               call's remaining time: a kernel change's check and the tiles to try next, on one machine start  issue 17
#   suite-speed MB (~9.5 min, 1 GPU) every GPU test, then e2e MB speed without a profile in the call's remaining
#               time: a kernel change's check and its speed point on one machine start (MODES=... to choose;
#               "bf16+compile coat-delayed-all+cudagraph", the default alone, fits micro-batch 12)      issue 17
#   optimizer   (~6 min, 1 GPU) CoatAdamW's GPU tests (the CUDA kernel), bench_optimizer          issues 5, 16
#   layers      (~8 min, 1 GPU) bench_layer: new vs legacy fp8-linear (--ab), then compiled FP8 modes    issue 6
#   mlp         (~6 min, 1 GPU) bench_mlp_block, with the last measured kernels (739ce90) beside the new
#               ones when .baseline/739ce90 is carried (the device copy has no .git); make it with
#               mkdir -p .baseline/739ce90 && git archive 739ce90 megacoat/ops | tar -x -C .baseline/739ce90
#               (and '/.baseline/' in .git/info/exclude), then name .baseline in the call's carry      issue 6
#   e2e MB PART (~7-9 min, 1 GPU) issue 17's table, 1.3 B model at micro-batch MB (2, 4, 8 or a list: 1,2): 2 repeats x 30
#               timed iterations per mode, each mode profiled once (GPU-busy fraction, kernels, idle time by
#               phase); PART baseline: bf16+compile plain-llama torchao-float8 (needs the torchao wheel in .whl);
#               PART fp8: bf16+compile coat coat+compile; PART cudagraph: bf16+compile coat+cudagraph torchao-float8
#               (the FP8 speed path); PART fastaccum: bf16+compile coat+cudagraph coat-fast-accum+cudagraph
#               (--fp8-fast-accum's speed); PART delayed: bf16+compile coat+cudagraph coat-delayed+cudagraph
#               (--fp8-grad-scaling delayed's speed); PART delayedall: bf16+compile coat-delayed+cudagraph
#               coat-delayed-all+cudagraph (--fp8-activation-scaling delayed on top); PART speed: bf16+compile
#               coat+cudagraph coat-delayed-all+cudagraph (COAT's scaling against delayed, both with the BF16 head);
#               PART default: bf16+compile $DEFAULT_MODE+cudagraph alone (the trainer's default, two modes: a larger
#               micro-batch fits); PART peers: bf16+compile $DEFAULT_MODE+cudagraph torchao-float8 (the default against
#               torchao); PART fp8linear: bf16+compile fp8-linear+cudagraph (fp8-linear's speed and memory); PART state:
#               $DEFAULT_MODE+cudagraph $DEFAULT_MODE-fp32-state+cudagraph (the default against an fp32 master, fp32
#               main gradients and both FP8 weight layouts kept: issue 18's speed reference; no bf16); PART largest:
#               $DEFAULT_MODE+cudagraph alone, at micro-batches bf16 cannot fit (24, 32; issue 18's largest-micro-batch
#               throughput, against bf16's own largest, 16, from `e2e 16 default` on the same warm machine); PART
#               workspace: bf16+compile and coat+cudagraph each with and without a cuBLAS workspace
#               (--cublas-workspace); PART fp8head: bf16+compile coat-delayed-all+cudagraph coat-fp8-head+cudagraph
#               (--fp8-output-layer's speed). Each but largest and state holds bf16+compile: ratios stay within one
#               call                                                                             issue 17
#   e2e-largest [MB] (~7 min, 1 GPU) compiled bf16 at 16 (the largest it fits on an H100) against the default
#               ($DEFAULT_MODE+cudagraph; LARGEST_MODE=coat-delayed-all for the BF16 head) at MB (default 32),
#               2 repeats each, interleaved, in one run: the throughput at each mode's largest micro-batch
#               (bench_e2e.py --at-largest)                                                         issue 18
#   suite-memory (~9 min, 1 GPU) every GPU test, then peak memory (allocated and reserved) at micro-batch 4 and 8:
#               compiled bf16, the default ($DEFAULT_MODE) compiled only (its allocated peak is the footprint) and
#               with CUDA graphs                                                                 issue 18
#   e2e-memory  (~7 min, 1 GPU) peak memory and speed at micro-batch 4 and 8: bf16+compile, coat,
#               coat-fp32-master and coat-rowwise with CUDA graphs, one repeat (memory is
#               deterministic)                                                                   issue 18
#   e2e-profile (~5 min, 1 GPU) where a bf16 step's time goes: bf16+compile vs plain-llama at micro-batch 2
#               (and bf16+compile under ZeRO-0), one profiled run each, Chrome traces kept (*.json.gz)    issue 17
#   e2e-gaps MB (~6 min, 1 GPU) bf16+compile, coat+cudagraph, $DEFAULT_MODE+cudagraph profiled at micro-batch
#               MB with traces (MODES=... to choose): idle gaps by host stack (trace_gaps.py), kernels by launcher
#               (KERNEL_ROWS=N of them printed; KERNEL_SOURCE_ROWS=N for trace_kernels.py's own print)    issue 17
#   e2e-capture-trace MB (~3 min, 1 GPU) the first step of coat+cudagraph profiled: which operators launch the
#               graphs' memsets and fills (kernels by launcher)                                    issue 17
#   head-kernels (~5 min, 1 GPU) the FP8 head's GPU tests (its loss, label corrections, the estimator), then
#               bench_head_loss.py: the label corrections' kernel against the torch path it replaced, and tile sweeps
#               of it, of the loss's stats pass and of its gradient cast, at micro-batch 32            issue 18
#   attention-fp8 (~1 min, 1 GPU) bench_attention_fp8.py: one layer's causal attention at micro-batch 32, torch's
#               BF16 SDPA against cuDNN's FP8 SDPA graphs (needs the nvidia-cudnn-frontend wheel in .whl)  issue 18
#   gemm-peak   (~1.5 min, 1 GPU) bench_gemm_peak.py: a layer's FP8 GEMMs at micro-batch 32 alone, beside square
#               FP8 and BF16 ones, with the SM clock and power nvidia-smi samples meanwhile          issue 18
#   gemm-workspace (~2 min, 1 GPU) bench_gemm_workspace.py: a layer's FP8 GEMMs in a CUDA graph, their memsets
#               and time under cuBLAS(Lt) workspace settings                                     issue 17
#   e2e-reserved ["MB ..."] (~7 min, 1 GPU) peak memory allocated and reserved at micro-batch 4 and 8 (or MB ...):
#               compiled bf16, coat-delayed-all (the BF16 head) with CUDA graphs and compiled only, and with the
#               row-major weight cache only (with CUDA graphs)                                   issue 18
#   e2e-equal   (~8 min, 1 GPU) 1.3 B model, the three modes at micro-batch 4, all compiled        issue 10 (a)
#   e2e-eager   (~8 min, 1 GPU) the same, FP8 modes eager (compiled bf16 as the baseline)       issue 10 (a)
#   e2e-search  (~9 min, 1 GPU) the largest micro-batch of the modes named after it (default: bf16 coat;
#               a second call with fp8-linear)                                                  issue 10 (b)
#   fidelity PRESET NAME MODE:SEED... (<= 9.5 min, 1 GPU or more) benchmarks/fidelity.py: the named runs of one
#               preset (125m, 350m, 350m-long, ablation) at once, within the call's time; on a multi-GPU kind
#               (e.g. nvidia-h100-x4) they spread over its GPUs, each run on the one holding the fewest, so four
#               pairs take a call that one pair takes on one GPU; GRADS=1 keeps the first run's
#               checkpoint (make it a bf16 run) and measures gradient agreement and moment error on it. The text
#               (benchmarks/fidelity_data.py) and the CoatAdamW build are cached under .cache/ while the machine
#               stays warm (~2-3 min on a fresh one). FLAGS adds fidelity.py run options (FLAGS=--cuda-graph:
#               every mode's blocks replayed as CUDA graphs, for the 350m preset). RESUME=1 [STOP_EVERY=N]:
#               runs longer than a call save when they stop and continue on the next call of the same warm
#               machine (its JSON then holds them whole). Merge the calls' JSON with fidelity.py report  issue 19
#   head-eval [MODE:SEED] (<= 9.5 min, 1 GPU) one 350m-long run (default coat-fp8-head-lx:3, CUDA graphs) trained
#               in the call's time (STOP_EVERY=N: at most N iterations), its checkpoint kept and continued by the next call
#               on the same warm machine; then head_precision_eval.py on it: the held-out loss with the head in FP8
#               and in BF16, same weights (is the FP8 head's loss gap training's or evaluation's?)            issue 18
#   quality     (~6 min, 1 GPU) CoatAdamW vs AdamW on a larger model; coat vs bf16 300 steps    issues 5, 6
#   parallel2   (~9 min, nvidia-h200-x2) TP=2, PP=2, DP=2 x bf16/coat, 1.3 B model              issue 8
#   parallel4   (~9 min, nvidia-h200-x4) TP2xPP2, TP2xDP2 x bf16/coat, 7 B model, micro-batch 1  issue 11
#   parallel4-search LAYOUT (~9 min, nvidia-h200-x4) micro-batch 2, then 4 and 8 until OOM      issue 11
#   curves4     (~9 min, nvidia-h200-x4) 200 steps on real text per mode, one PNG               issue 11
set -uo pipefail
GROUP=${1:?usage: bash benchmarks/device_run.sh GROUP (see the header)}
OUT=${OUT:-$PWD/device_out}
# Two groups may run at once on a machine of several GPUs, each given its own by CUDA_VISIBLE_DEVICES:
#     CUDA_VISIBLE_DEVICES=0 bash benchmarks/device_run.sh A > $OUT/gpu0.txt 2>&1 &
#     CUDA_VISIBLE_DEVICES=1 bash benchmarks/device_run.sh B; wait
# Each then keeps its own logs (logs_gpuN.tgz) and corpus cache; the wheels are installed once, under a lock, and
# the kernel builds share one cache (torch's builds lock it). A timing run so has its GPU alone but shares the host.
TAG=${CUDA_VISIBLE_DEVICES:+_gpu${CUDA_VISIBLE_DEVICES//,/_}}
LOGS=/tmp/megacoat_logs$TAG
mkdir -p "$OUT" "$LOGS"

if [ -d .whl ]; then
    # once per set of wheels: torchao is not always among them, so an import check would reinstall every call
    LOCK=(); command -v flock >/dev/null && LOCK=(flock /tmp/device_run_wheels.lock)
    "${LOCK[@]}" bash -c 'ls .whl > /tmp/device_run_wheels.txt
        cmp -s /tmp/device_run_wheels.txt .site/.wheels && exit 0
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl \
            && cp /tmp/device_run_wheels.txt .site/.wheels' || { echo "wheel install failed"; exit 1; }
    export PYTHONPATH=$PWD/.site:$PWD:${PYTHONPATH:-}
else
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
fi
# DeepSpeed's op_builder cannot parse the machine's '9.0a'; builds are cached for the whole call.
export TORCH_CUDA_ARCH_LIST=9.0 TORCH_EXTENSIONS_DIR=/tmp/ext MEGACOAT_CACHE=/tmp/megacoat_cache$TAG
trap 'tar czf "$OUT/logs$TAG.tgz" -C "$LOGS" . 2>/dev/null' EXIT

step() {  # step NAME SECONDS CMD...: run with a time limit, log to $LOGS/NAME.txt, say how it ended
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    echo "=== $name (limit ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" > "$LOGS/$name.txt" 2>&1
    local rc=$?
    echo "=== $name: rc=$rc after $((SECONDS - t0))s"
    tail -n 15 "$LOGS/$name.txt"
}

nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total --format=csv > "$LOGS/gpu.txt" 2>&1
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" \
    >> "$LOGS/gpu.txt" 2>&1
cat "$LOGS/gpu.txt"

# The trainer's default as bench_e2e names it: the FP8 head, since --fp8-output-layer defaults to auto
# (megacoat.fp8.config.DEFAULT_OUTPUT_LAYER); coat-delayed-all is the same with the BF16 head. DEFAULT_MODE=... to
# measure another.
DEFAULT_MODE=${DEFAULT_MODE:-coat-fp8-head}
# issue 17's method (warm-up, 30 timed iterations, 2 repeats) and the quick single runs of the issue-10 groups
E2E="python3 benchmarks/bench_e2e.py speed --warmup 5 --iters 30 --log-interval 5 --repeats 2 --timeout 200"
E2E_QUICK="python3 benchmarks/bench_e2e.py speed --warmup 2 --iters 10 --log-interval 2 --repeats 1 --timeout 240"
case $GROUP in
kernels)
    step gpu_tests 360 python3 -m pytest -m gpu -q --no-header -p no:cacheprovider tests \
        --deselect tests/ops/test_coat_adamw.py --deselect tests/ops/test_op_builder.py
    cp "$LOGS/gpu_tests.txt" "$OUT/gpu_tests.txt"
    step bench_quant 180 python3 benchmarks/bench_quant.py --out "$OUT/bench_quant.json"
    ;;
gpu-suite)
    # every gpu test (CoatAdamW's extension included), then the delayed-scaling SwiGLU backward per call
    step gpu_tests_all 420 python3 -m pytest -m gpu -q --no-header -p no:cacheprovider tests -rfE
    cp "$LOGS/gpu_tests_all.txt" "$OUT/gpu_tests_all.txt"
    step bench_delayed_scaling 150 python3 benchmarks/bench_delayed_scaling.py --out "$OUT/bench_delayed_scaling.json"
    ;;
gpu-tests)
    step gpu_tests_all 420 python3 -m pytest -m gpu -q --no-header -p no:cacheprovider tests -rfE
    cp "$LOGS/gpu_tests_all.txt" "$OUT/gpu_tests_all.txt"
    ;;
graph-loss)
    step graph_loss 560 python3 benchmarks/graph_loss_agreement.py --out "$OUT/graph_loss_agreement.json"
    ;;
kernel-sweep)
    step cast_sweep 200 python3 benchmarks/bench_cast_transpose.py --repeats 2 --layouts both \
        --sweep 128:64:4 128:64:8 64:128:4 128:128:8 32:64:4 64:64:8 --out "$OUT/bench_cast_transpose_sweep.json"
    step kernel_sweep $((585 - SECONDS)) python3 benchmarks/bench_delayed_scaling.py --repeats 3 --sweep 32:4 128:8 128:16 \
        --sweep-fwd 16:4 64:4 64:8 128:8 32:8 --sweep-norm 256 512 2048 --out "$OUT/bench_kernel_sweep.json"
    ;;
suite-sweep)
    # a kernel change's GPU check, then the tile sweeps of kernel-sweep in the call's remaining time
    step gpu_tests_all 270 python3 -m pytest -m gpu -q --no-header -p no:cacheprovider tests -rfE
    cp "$LOGS/gpu_tests_all.txt" "$OUT/gpu_tests_all.txt"
    step cast_sweep 160 python3 benchmarks/bench_cast_transpose.py --repeats 2 --layouts both \
        --sweep 128:64:4 128:64:8 64:128:4 128:128:8 32:64:4 64:64:8 --out "$OUT/bench_cast_transpose_sweep.json"
    step kernel_sweep $((585 - SECONDS)) python3 benchmarks/bench_delayed_scaling.py --repeats 2 --sweep 32:4 128:8 \
        --sweep-fwd 16:4 64:8 32:8 --sweep-norm 256 512 2048 --out "$OUT/bench_kernel_sweep.json"
    ;;
suite-speed)
    MB=${2:?suite-speed needs a micro-batch size}
    step gpu_tests_all 300 python3 -m pytest -m gpu -q --no-header -p no:cacheprovider tests -rfE
    cp "$LOGS/gpu_tests_all.txt" "$OUT/gpu_tests_all.txt"
    step "e2e_speed_mb$MB" $((585 - SECONDS)) $E2E --micro-batch-size $MB \
        --modes ${MODES:-bf16+compile coat+cudagraph coat-delayed-all+cudagraph} --out "$OUT/bench_e2e_speed_speed_mb$MB.json"
    ;;
optimizer)
    # The extension builds once (~1 min); the tests then run the kernel against the reference.
    step gpu_tests_optimizer 400 python3 -m pytest -m gpu -q --no-header -p no:cacheprovider \
        tests/ops/test_op_builder.py tests/ops/test_coat_adamw.py tests/optim
    cp "$LOGS/gpu_tests_optimizer.txt" "$OUT/gpu_tests_optimizer.txt"
    step bench_optimizer 150 python3 benchmarks/bench_optimizer.py --out "$OUT/bench_optimizer.json"
    ;;
layers)
    step bench_layer 300 python3 benchmarks/bench_layer.py --ab --out "$OUT/bench_layer.json"
    step bench_layer_compile 240 python3 benchmarks/bench_layer.py --compile-fp8 --out "$OUT/bench_layer_compile.json"
    ;;
mlp)
    BASE=()
    [ -d .baseline/739ce90 ] && BASE=(--baseline-rev 739ce90)
    step bench_mlp_block 400 python3 benchmarks/bench_mlp_block.py "${BASE[@]}" --out "$OUT/bench_mlp_block.json"
    ;;
e2e)
    MB=${2:?e2e needs a micro-batch size and a part: bash benchmarks/device_run.sh e2e 2 baseline (or fp8)}
    case ${3:-} in
    baseline) MODES="bf16+compile plain-llama torchao-float8" ;;
    fp8) MODES="bf16+compile coat coat+compile" ;;
    cudagraph) MODES="bf16+compile coat+cudagraph torchao-float8" ;;
    fastaccum) MODES="bf16+compile coat+cudagraph coat-fast-accum+cudagraph" ;;
    delayed) MODES="bf16+compile coat+cudagraph coat-delayed+cudagraph" ;;
    delayedall) MODES="bf16+compile coat-delayed+cudagraph coat-delayed-all+cudagraph" ;;
    speed) MODES="bf16+compile coat+cudagraph coat-delayed-all+cudagraph" ;;
    default) MODES="bf16+compile $DEFAULT_MODE+cudagraph" ;;
    peers) MODES="bf16+compile $DEFAULT_MODE+cudagraph torchao-float8" ;;
    fp8linear) MODES="bf16+compile fp8-linear+cudagraph" ;;
    largest) MODES="$DEFAULT_MODE+cudagraph" ;;
    workspace) MODES="bf16+compile bf16-no-workspace+compile coat+cudagraph coat-workspace+cudagraph" ;;
    state) MODES="$DEFAULT_MODE+cudagraph $DEFAULT_MODE-fp32-state+cudagraph" ;;
    fp8head) MODES="bf16+compile coat-delayed-all+cudagraph coat-fp8-head+cudagraph" ;;
    *) echo "e2e: part must be baseline, fp8, cudagraph, fastaccum, delayed, delayedall, speed, default, peers, fp8linear, largest, workspace, state or fp8head (see the header of $0)"; exit 2 ;;
    esac
    # MB may be a comma list (e.g. 1,2: both in one call); PROFILE=0 skips the profiled iteration per mode
    PROF=(--profile); [ "${PROFILE:-1}" = 0 ] && PROF=()
    step "e2e_${3}_mb${MB//,/_}" 565 $E2E --micro-batch-size ${MB//,/ } "${PROF[@]}" --modes $MODES \
        --out "$OUT/bench_e2e_speed_${3}_mb${MB//,/_}.json"
    ;;
e2e-largest)
    step e2e_at_largest 565 $E2E --at-largest bf16+compile@16 "${LARGEST_MODE:-$DEFAULT_MODE}+cudagraph@${2:-32}" \
        --out "$OUT/bench_e2e_speed_at_largest_mb${2:-32}.json"
    ;;
e2e-reserved)
    # what the device holds under CUDA graphs: the allocated peak misses the graphs' replays in their private pool,
    # the reserved peak does not; coat-delayed-all (the BF16 head) graphed and compiled only, beside compiled bf16
    # (memory, not speed)
    step e2e_reserved 585 python3 benchmarks/bench_e2e.py speed --warmup 5 --iters 10 --log-interval 5 --repeats 1 \
        --timeout 100 --micro-batch-size ${2:-4 8} --modes bf16+compile coat-delayed-all+cudagraph coat-delayed-all+compile \
        coat-delayed-all-rowwise+cudagraph --out "$OUT/bench_e2e_memory_reserved.json"
    ;;
suite-memory)
    # a change's GPU check, then what the default holds at 4 and 8 beside compiled bf16: compiled only, the
    # allocated peak is the footprint; with CUDA graphs the reserved peak holds the graphs' pools (memory, not speed)
    step gpu_tests_all 300 python3 -m pytest -m gpu -q --no-header -p no:cacheprovider tests -rfE
    cp "$LOGS/gpu_tests_all.txt" "$OUT/gpu_tests_all.txt"
    step e2e_memory_default $((585 - SECONDS)) python3 benchmarks/bench_e2e.py speed --warmup 5 --iters 10 \
        --log-interval 5 --repeats 1 --timeout 100 --micro-batch-size 4 8 --modes bf16+compile \
        $DEFAULT_MODE+compile $DEFAULT_MODE+cudagraph --out "$OUT/bench_e2e_memory_default.json"
    ;;
e2e-memory)
    step e2e_memory 585 python3 benchmarks/bench_e2e.py speed --warmup 5 --iters 30 --log-interval 5 --repeats 1 \
        --timeout 140 --micro-batch-size 4 8 --modes bf16+compile coat+cudagraph coat-fp32-master+cudagraph coat-rowwise+cudagraph \
        --out "$OUT/bench_e2e_memory_cudagraph_mb4_mb8.json"
    ;;
e2e-profile)
    PROFILE="python3 benchmarks/bench_e2e.py speed --micro-batch-size 2 --warmup 5 --iters 10 --log-interval 5 \
        --repeats 1 --profile --traces $OUT --timeout 200"
    step e2e_profile 330 $PROFILE --modes bf16+compile plain-llama --out "$OUT/bench_e2e_profile_mb2.json"
    step e2e_profile_zero0 200 $PROFILE --modes bf16+compile --zero-stage 0 --out "$OUT/bench_e2e_profile_mb2_zero0.json"
    ;;
e2e-gaps)
    # where the GPU idles in the speed modes' step, and the host stack that kept it waiting (trace_gaps.py);
    # traces stay on the machine, their gap and kernel tables come back
    MB=${2:-4}
    mkdir -p /tmp/traces
    step e2e_gaps 420 python3 benchmarks/bench_e2e.py speed --micro-batch-size $MB --warmup 5 --iters 10 \
        --log-interval 5 --repeats 1 --profile --traces /tmp/traces --timeout 200 \
        --modes ${MODES:-bf16+compile coat+cudagraph $DEFAULT_MODE+cudagraph} --out "$OUT/bench_e2e_gaps_mb$MB.json"
    for t in /tmp/traces/*.json.gz; do
        n=$(basename "$t" .json.gz)
        python3 benchmarks/trace_gaps.py "$t" 3 "$OUT/gaps_$n.json" 10 > "$LOGS/gaps_$n.txt" 2>&1
        python3 benchmarks/trace_kernels.py "$t" 3 "$OUT/kernels_$n.json" > "$LOGS/kernels_$n.txt" 2>&1
        head -25 "$LOGS/gaps_$n.txt"; sed -n '/by launching/,$p' "$LOGS/kernels_$n.txt" | head -${KERNEL_ROWS:-45}
    done
    ;;
e2e-capture-trace)
    # the first step of coat+cudagraph at micro-batch MB, profiled: the compiled blocks' warm-up runs their kernels
    # one by one from their operators (a replay hides them inside the graph), so each memset and fill of the
    # graphs is traced to the operator that made it (trace_kernels.py's table by launcher)
    MB=${2:-4}
    step capture_trace 400 python3 pretrain_gpt.py --num-layers 24 --hidden-size 2048 --ffn-hidden-size 5632 \
        --num-attention-heads 16 --seq-length 2048 --vocab-size 32000 --mock-data --zero-stage 1 --eval-iters 0 \
        --log-interval 1 --bf16 --coat-fp8 --compile --enable-cuda-graph --micro-batch-size $MB \
        --global-batch-size $((2 * MB)) --train-iters 2 --profile-dir /tmp/capture --profile-step-start 0 \
        --profile-step-end 1
    python3 benchmarks/trace_kernels.py /tmp/capture/trace_rank0.json 1 "$OUT/kernels_capture_mb$MB.json" \
        > "$LOGS/kernels_capture.txt" 2>&1
    grep -E "Memset|Fill|memset|fill" "$LOGS/kernels_capture.txt" | head -${KERNEL_ROWS:-40}
    ;;
head-kernels)
    step gpu_tests_head 240 python3 -m pytest -m gpu -q --no-header -p no:cacheprovider -rfE \
        tests/ops/test_label_corrections.py tests/ops/test_cross_entropy_fp8.py tests/fp8/test_head_loss.py \
        tests/tools/test_memory_estimator.py
    cp "$LOGS/gpu_tests_head.txt" "$OUT/gpu_tests_head.txt"
    step bench_head_loss $((585 - SECONDS)) python3 benchmarks/bench_head_loss.py --repeats 3 \
        --sweep-corrections 64:128:4 16:128:4 32:256:4 32:64:4 64:64:4 32:128:8 64:256:8 \
        --sweep-stats 8192:8 8192:16 2048:4 4096:4 4096:16 16384:16 2048:8 \
        --sweep-grad 128:64:4 64:128:4 128:128:8 128:64:8 64:128:8 128:256:8 32:128:4 \
        --out "$OUT/bench_head_loss.json"
    ;;
attention-fp8)
    step attention_fp8 240 python3 benchmarks/bench_attention_fp8.py --out "$OUT/bench_attention_fp8.json"
    ;;
gemm-peak)
    step gemm_peak 240 python3 benchmarks/bench_gemm_peak.py --repeats 2 --out "$OUT/bench_gemm_peak.json"
    ;;
gemm-workspace)
    # one layer's 12 FP8 GEMMs as a CUDA graph under three cuBLAS(Lt) workspace settings: their memsets and time
    step gemm_workspace 240 python3 benchmarks/bench_gemm_workspace.py --out "$OUT/bench_gemm_workspace.json"
    ;;
e2e-equal)
    step e2e_equal 560 $E2E_QUICK --micro-batch-size 4 --profile \
        --modes bf16+compile fp8-linear+compile coat+compile coat-lean+compile --out "$OUT/bench_e2e_speed_compiled.json"
    ;;
e2e-eager)
    step e2e_eager 560 $E2E_QUICK --micro-batch-size 4 --profile --modes bf16+compile fp8-linear coat coat-lean \
        --out "$OUT/bench_e2e_speed_eager_fp8.json"
    ;;
e2e-search)
    MODES=${*:2}
    MODES=${MODES:-bf16 coat}
    SPECS=$(for m in $MODES; do printf '%s+compile ' "$m"; done)
    step e2e_search 570 $E2E_QUICK --micro-batch-size 8 --search 8,12,16,24 --modes $SPECS \
        --out "$OUT/bench_e2e_speed_search_${MODES// /_}.json"
    ;;
fidelity)
    PRESET=${2:?fidelity needs PRESET NAME MODE:SEED...}; NAME=${3:?fidelity needs a NAME for the JSON}
    RUNS=("${@:4}")
    [ ${#RUNS[@]} -gt 0 ] || { echo "fidelity needs at least one MODE:SEED run"; exit 2; }
    export TORCH_EXTENSIONS_DIR=$PWD/.cache/ext  # kept between calls while the machine stays warm
    step fidelity_data 300 python3 benchmarks/fidelity_data.py --out .cache/fidelity_data --workers 14
    cp .cache/fidelity_data/manifest.json "$OUT/fidelity_data_manifest.json" || exit 1
    GRADS_S=0; SAVE=()
    if [ "${GRADS:-0}" = 1 ]; then GRADS_S=60; SAVE=(--save-checkpoint "${RUNS[0]}"); fi
    BUDGET=$((565 - SECONDS - GRADS_S))
    # RESUME=1 [STOP_EVERY=N]: runs save when they stop and continue on the next call of the same warm machine
    # (.cache/fidelity_runs is kept while it stays warm): one long run over several calls
    RESUME_FLAGS=()
    if [ "${RESUME:-0}" = 1 ]; then RESUME_FLAGS=(--resume ${STOP_EVERY:+--stop-every "$STOP_EVERY"}); fi
    step fidelity_run $((BUDGET + 40)) python3 benchmarks/fidelity.py run --preset "$PRESET" --runs "${RUNS[@]}" \
        --parallel ${#RUNS[@]} --data .cache/fidelity_data --time-budget $BUDGET "${SAVE[@]}" "${RESUME_FLAGS[@]}" \
        ${FLAGS:-} \
        --out "$OUT/fidelity_${PRESET}_${NAME}.json"
    if [ "${GRADS:-0}" = 1 ]; then
        R=${RUNS[0]}
        step fidelity_grads 80 python3 benchmarks/fidelity.py grads --data .cache/fidelity_data \
            --checkpoint ".cache/fidelity_runs/${R%%:*}_s${R##*:}/checkpoint" --out "$OUT/fidelity_${PRESET}_grads.json"
    fi
    python3 benchmarks/fidelity.py report "$OUT/fidelity_${PRESET}_${NAME}.json" --out /tmp/fidelity_report.json \
        2>&1 | tail -n 12
    ;;
head-eval)
    RUN=${2:-coat-fp8-head-lx:3}
    step fidelity_data 300 python3 benchmarks/fidelity_data.py --out .cache/fidelity_data --workers 14
    step head_eval_run $((470 - SECONDS)) python3 benchmarks/fidelity.py run --preset 350m-long --runs "$RUN" \
        --data .cache/fidelity_data --resume ${STOP_EVERY:+--stop-every "$STOP_EVERY"} --cuda-graph --parallel 1 \
        --time-budget $((460 - SECONDS)) --stop-margin-s 25 --workdir .cache/head_eval_runs \
        --out "$OUT/head_eval_run_${RUN%%:*}_s${RUN##*:}.json"
    step head_eval 100 python3 benchmarks/head_precision_eval.py --checkpoint \
        ".cache/head_eval_runs/${RUN%%:*}_s${RUN##*:}/checkpoint" --data .cache/fidelity_data --samples 64 \
        --batch-size 8 --out "$OUT/head_precision_eval.json"
    ;;
quality)
    step optimizer_quality 300 python3 benchmarks/optimizer_quality.py --name larger_gpu --out-dir "$OUT" \
        --workdir /tmp/optimizer_quality_runs \
        -- --num-layers 12 --hidden-size 768 --ffn-hidden-size 2048 --num-attention-heads 12 --seq-length 1024
    step fp8_convergence 240 python3 benchmarks/fp8_convergence.py --iters 300 --out-dir "$OUT"
    ;;
parallel2)
    step parallel2 570 python3 benchmarks/bench_parallel.py --gpus 2 --timeout 170 --out "$OUT/bench_parallel.json"
    ;;
parallel4)
    step parallel4 570 python3 benchmarks/bench_parallel.py --gpus 4 --model 7b --layouts tp2pp2 tp2dp2 \
        --micro-batch-size 1 --global-batch-size 16 --iters 8 --log-interval 2 --timeout 135 \
        --out "$OUT/bench_parallel_4gpu.json"
    ;;
parallel4-search)
    LAYOUT=${2:?parallel4-search needs a layout: tp2pp2 or tp2dp2}
    step parallel4_search 570 python3 benchmarks/bench_parallel.py --gpus 4 --model 7b --layouts "$LAYOUT" \
        --micro-batch-size 2 --global-batch-size 32 --iters 8 --log-interval 2 --search 4,8 --timeout 100 \
        --out "$OUT/bench_parallel_4gpu_search_$LAYOUT.json"
    ;;
curves4)
    step curves4 570 python3 benchmarks/bench_parallel.py --gpus 4 --model 7b --layouts tp2pp2 --real-text \
        --iters 200 --micro-batch-size 1 --global-batch-size 8 --log-interval 5 --timeout 270 --plot \
        --out "$OUT/bench_parallel_4gpu_curves.json"
    ;;
*)
    echo "unknown group $GROUP (see the header of $0)"; exit 2 ;;
esac
ls -la "$OUT"
