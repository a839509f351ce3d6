#!/usr/bin/env bash
# Run named benchmarks on the lent GPU machine, from the repository root, with .whl carried (DeepSpeed's wheels):
#     bash benchmarks/device.sh e2e-1p3b-mb8 memory-1p3b        # results and run.log in $OUT
set -uo pipefail
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .site .whl/*.whl \
        || { echo "error: wheel install failed"; exit 1; }
    export PYTHONPATH=$PWD/.site:$PWD:${PYTHONPATH:-}
else
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
fi
# DeepSpeed's op_builder cannot parse the machine's '9.0a'; extension builds are cached for the whole call.
export TORCH_CUDA_ARCH_LIST=9.0 TORCH_EXTENSIONS_DIR=/tmp/ext MEGACOAT_CACHE=/tmp/megacoat_cache
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,memory.total --format=csv 2>/dev/null
exec python3 -m benchmarks.run --out "${OUT:-$PWD/bench_out}" "$@"
