"""trace_gaps: GPU idle gaps attributed to the host stack that launched the work ending them."""
from benchmarks.trace.gaps import HostStacks, gap_table


def op(name, ts, dur, cat="cpu_op", tid=1):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}


def kernel(ts, dur, corr):
    return {"ph": "X", "cat": "kernel", "name": f"k{corr}", "ts": ts, "dur": dur, "tid": 7, "args": {"correlation": corr}}


def launch(ts, corr, name="cudaLaunchKernel"):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": 1, "tid": 1, "args": {"correlation": corr}}


def test_host_stack_follows_nesting():
    h = HostStacks([op("megacoat.backward", 0, 100, "user_annotation"), op("outer", 10, 50), op("a", 12, 5),
                    op("b", 30, 10), op("later", 70, 5)])
    assert h.at(1, 14) == ["megacoat.backward", "outer", "a"]
    assert h.at(1, 20) == ["megacoat.backward", "outer"]  # a has ended; its parent is still open
    assert h.at(1, 65) == ["megacoat.backward"]
    assert h.at(1, 200) == []


def test_gap_ended_by_a_late_launch_is_the_hosts():
    events = [op("megacoat.backward", 0, 500, "user_annotation"), op("epilogue", 100, 300), op("step", 420, 50),
              kernel(0, 100, 1), launch(10, 1),
              kernel(105, 5, 2), launch(20, 2),  # launched early, 5 us gap: below the threshold
              kernel(450, 10, 3), launch(430, 3),  # the GPU waited from 110 to 450 for step's launch
              kernel(470, 10, 4), launch(300, 4)]  # launched before the gap began: not the host's
    events.append(op("cudaStreamSynchronize", 425, 2, "cuda_runtime"))
    t = gap_table(events, steps=1, min_gap_us=10)
    assert len(t["gaps"]) == 1
    row = t["gaps"][0]
    assert row["phase"] == "megacoat.backward"
    assert row["host_at_gap_start"] == "epilogue" and row["launch_that_ended_it"] == "step"
    assert abs(row["ms_per_step"] - 0.340) < 1e-9
    assert abs(t["other_gap_ms_per_step"] - 0.010) < 1e-9 and t["other_gaps_per_step"] == 1
    assert t["host_waits"] == [{"name": "cudaStreamSynchronize", "stack": "step", "count": 1}]


def test_every_gap_is_summed_by_size_and_by_the_work_after_it():
    events = [kernel(0, 10, 1), kernel(11, 10, 2), kernel(24, 10, 3), kernel(100, 10, 4)]  # gaps 1, 3, 66 us
    events += [launch(0, 1), launch(1, 2), launch(2, 3), launch(3, 4)]
    t = gap_table(events, steps=1, min_gap_us=10)
    assert abs(t["all_gaps_ms_per_step"] - 0.070) < 1e-9
    assert {k: round(v * 1e3, 6) for k, v in t["gap_ms_per_step_by_size"].items()} == {
        "<2us": 1.0, "2-5us": 3.0, "5-10us": 0.0, "10-50us": 0.0, ">=50us": 66.0}
    assert [r["next_work"] for r in t["gaps_by_next_work"]] == ["k4", "k3", "k2"]
