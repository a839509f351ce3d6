"""--profile-dir: a trace and the ranked operators of the profiled window, and nothing outside it."""
import json

import pytest

from megacoat.arguments import parse_config
from megacoat.training.profiling import busy_us, device_summary, idle_by_phase
from tests.training.test_pretrain_gpt import TINY, run


def test_profile_window_writes_trace_and_top_operators(tmp_path):
    out = tmp_path / "prof"
    _, train, _ = run(tmp_path, TINY + ["--mock-data", "--train-iters", "4", "--eval-iters", "0", "--zero-stage", "0",
                                        "--profile-dir", str(out), "--profile-step-start", "1",
                                        "--profile-step-end", "3"])
    assert len(train) == 4  # profiling does not change the run
    trace = json.loads((out / "trace_rank0.json").read_text())
    assert trace["traceEvents"]
    top = json.loads((out / "top_ops_rank0.json").read_text())
    assert top["steps"] == [2, 3] and top["time"] == "cpu"
    names = [r["name"] for r in top["top"]]
    assert any("mm" in n for n in names), names  # the GEMMs of two training steps are in the window
    shares = [r["share"] for r in top["top"]]
    assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1 + 1e-9
    device = top["device"]  # no GPU: no busy fraction, no kernels; the window's wall time is measured
    assert device["gpu_busy_fraction"] is None and device["kernels_per_step"] == 0 and device["wall_us"] > 0
    phases = {e["name"] for e in trace["traceEvents"] if e.get("cat") == "user_annotation"}
    assert {"megacoat.forward", "megacoat.backward", "megacoat.step"} <= phases  # the engine is annotated


def test_busy_time_is_the_union_of_overlapping_intervals():
    assert busy_us([]) == 0
    assert busy_us([(0, 10), (5, 15), (20, 25)]) == 20  # two streams overlap on [5, 10)
    assert busy_us([(0, 30), (5, 10), (12, 20)]) == 30  # nested intervals count once
    assert busy_us([(20, 25), (0, 10)]) == 15  # order does not matter


def test_device_summary_counts_kernels_waits_and_the_busy_fraction():
    events = [{"cat": "kernel", "name": "gemm", "ts": 0, "dur": 40},
              {"cat": "kernel", "name": "add", "ts": 30, "dur": 20},  # overlaps the GEMM by 10 us
              {"cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 60, "dur": 10},
              {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 5},
              {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 50, "dur": 30},
              {"cat": "cuda_runtime", "name": "cudaDeviceSynchronize", "ts": 90, "dur": 1},
              {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 8}]
    s = device_summary(events, wall_us=120.0, steps=2, own_waits=1)
    assert s["gpu_busy_us"] == 60 and s["gpu_busy_fraction"] == pytest.approx(0.5)
    assert s["kernels_per_step"] == 1 and s["host_waits_per_step"] == 0.5
    assert s["gpu_idle_ms_per_step_by_phase"] == {"other": pytest.approx(10 / 1e3 / 2)}  # the gap [50, 60)


def test_idle_time_is_split_by_the_host_phase_it_overlaps():
    device = [(0, 10), (20, 30), (40, 50), (45, 55), (70, 80)]  # gaps [10, 20), [30, 40), [55, 70)
    phases = [("megacoat.step", 5, 25), ("megacoat.forward", 35, 60)]
    assert idle_by_phase(device, phases) == {"other": 15, "megacoat.step": 10, "megacoat.forward": 10}
    assert idle_by_phase(device, []) == {"other": 35}
    assert idle_by_phase([(0, 10)], phases) == {}  # one busy stretch: no gap to attribute


@pytest.mark.parametrize("start,end,iters", [(3, 3, 10), (-1, 2, 10), (2, 12, 10)])
def test_bad_profile_window_is_named(capsys, start, end, iters):
    with pytest.raises(SystemExit):
        parse_config(["--profile-dir", "p", "--profile-step-start", str(start), "--profile-step-end", str(end),
                      "--train-iters", str(iters)])
    assert "--profile-step-start" in capsys.readouterr().err
