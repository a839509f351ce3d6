"""benchmarks/trace/kernels.py: GPU time per step by kernel name and category from a Chrome trace."""
import gzip
import json

from benchmarks.trace.kernels import kernel_table


def test_kernels_grouped_per_step_with_their_categories(tmp_path):
    events = [
        {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_qqtst_128x128", "dur": 300},
        {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_qqtst_128x128", "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "_cast_transpose_kernel", "dur": 60},
        {"ph": "X", "cat": "kernel", "name": "triton_poi_fused_add_0", "dur": 20},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "dur": 40},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 9999},  # host time: not counted
        {"ph": "i", "cat": "kernel", "name": "instant", "dur": 5},
    ]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    table = kernel_table(str(path), steps=2)
    assert table["total_ms_per_step"] == (300 + 100 + 60 + 20 + 40) / 1e3 / 2
    assert table["categories"] == {"gemm": 0.2, "megacoat_triton": 0.03, "memcpy": 0.02, "inductor": 0.01}
    top = table["kernels"][0]
    assert top == {"name": "nvjet_sm90_qqtst_128x128", "calls_per_step": 1.0, "ms_per_step": 0.2, "cat": "gemm"}
    assert table["kernels"][2]["name"] == "gpu_memcpy:Memcpy DtoD (Device -> Device)"


def test_kernels_by_the_host_operators_that_launched_them():
    from benchmarks.trace.kernels import kernels_by_source
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "## Call CompiledFxGraph bwd ##", "ts": 0, "dur": 50, "tid": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 10, "dur": 2, "tid": 1,
         "args": {"correlation": 5}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add_", "ts": 60, "dur": 5, "tid": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 61, "dur": 2, "tid": 1,
         "args": {"correlation": 6}},
        {"ph": "X", "cat": "kernel", "name": "triton_poi_fused_add_0", "ts": 20, "dur": 30, "args": {"correlation": 5}},
        {"ph": "X", "cat": "kernel", "name": "triton_poi_fused_add_0", "ts": 70, "dur": 10, "args": {"correlation": 6}},
        {"ph": "X", "cat": "kernel", "name": "triton_poi_fused_add_0", "ts": 90, "dur": 10, "args": {"correlation": 6}},
    ]
    rows = kernels_by_source(events, steps=1)
    assert rows == [
        {"name": "triton_poi_fused_add_0", "source": "## Call CompiledFxGraph bwd ##", "calls_per_step": 1.0,
         "ms_per_step": 0.03},
        {"name": "triton_poi_fused_add_0", "source": "aten::add_", "calls_per_step": 2.0, "ms_per_step": 0.02}]
