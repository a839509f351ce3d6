"""benchmarks/parallel/speed.py: its layouts, each recipe's flags per layout, the rows' fields and ratios, the copy
into $OUT (no SameFileError when the JSON already lies there), and a CPU run (gloo, a tiny model)."""
import json

import pytest

from benchmarks.parallel import speed
from tests.benchmarks.conftest import run_module

ROW_FIELDS = ("model", "tp", "pp", "dp", "zero_stage", "mode", "micro_batch_size", "tokens_per_s_per_gpu",
              "tflops_per_gpu", "max_memory_gib", "device", "versions", "command")


def test_layouts_and_zero_stages():
    assert speed.layout_sizes("tp2dp2", 4) == {"tp": 2, "pp": 1, "dp": 2}
    assert speed.layout_flags("dp", 4)[-2:] == ["--zero-stage", "2"]
    assert speed.layout_flags("tp2pp2", 4)[-2:] == ["--zero-stage", "1"]  # DeepSpeed refuses ZeRO-2 with a pipeline
    with pytest.raises(SystemExit, match="error: --layouts 'tp3'"):
        speed.layout_sizes("tp3", 4)


def test_the_default_keeps_its_graphs_in_every_layout_but_zero3():
    flags, graphs = speed.mode_flags("coat", {"tp": 2, "pp": 1, "dp": 2})
    assert graphs and "--enable-cuda-graph" in flags and "--compile" in flags
    flags, graphs = speed.mode_flags("coat", {"tp": 2, "pp": 2, "dp": 1})  # per-slot stage graphs
    assert graphs and "--enable-cuda-graph" in flags and "--compile" in flags
    flags, graphs = speed.mode_flags("coat", {"tp": 1, "pp": 1, "dp": 4}, stage=3)
    assert not graphs and "--enable-cuda-graph" not in flags and "--compile" in flags
    assert speed.mode_flags("bf16", {"tp": 1, "pp": 1, "dp": 4}) == (["--compile"], False)


def test_ratios_are_within_a_layout():
    rows = {"dp/bf16": {"ok": True, "tokens_per_s_per_gpu": 100.0, "max_memory_gib": 40.0},
            "dp/coat": {"ok": True, "tokens_per_s_per_gpu": 150.0, "max_memory_gib": 20.0},
            "tp/coat": {"ok": True, "tokens_per_s_per_gpu": 90.0, "max_memory_gib": 10.0}}
    speed.add_ratios(rows)
    assert rows["dp/coat"]["speedup_vs_bf16"] == 1.5 and rows["dp/coat"]["memory_reduction_vs_bf16"] == 2.0
    assert "speedup_vs_bf16" not in rows["tp/coat"]  # no bf16 row in its layout


def test_save_inside_out_does_not_copy_onto_itself(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    speed.save({"rows": {}}, str(tmp_path / "p.json"))  # shutil.SameFileError before
    other = tmp_path / "elsewhere"
    speed.save({"rows": {}}, str(other / "q.json"))
    assert json.loads((tmp_path / "q.json").read_text()) == {"rows": {}}


def test_rank_profiles_split_communication_from_compute(tmp_path):
    top = {"steps": [5, 7], "time": "device", "total_self_us": 30000.0,
           "device": {"gpu_busy_fraction": 0.9, "wall_us": 33000.0},
           "top": [{"name": "ncclDevKernel_ReduceScatter_Sum_bf16", "self_us": 6000.0},
                   {"name": "nvjet_gemm", "self_us": 24000.0}]}
    (tmp_path / "top_ops_rank0.json").write_text(json.dumps(top))
    ranks = speed.rank_profiles(str(tmp_path), 2)
    assert ranks[1] is None  # a rank that wrote nothing
    assert ranks[0]["comm_ms_per_step"] == pytest.approx(2.0) and ranks[0]["compute_ms_per_step"] == pytest.approx(8.0)
    assert ranks[0]["gpu_busy_fraction"] == 0.9 and ranks[0]["wall_ms_per_step"] == pytest.approx(11.0)


@pytest.mark.slow
def test_cpu_run_writes_every_field(tmp_path):
    out = tmp_path / "p.json"
    proc = run_module("benchmarks.parallel.speed", "--gpus", "2", "--model", "tiny", "--layouts", "dp", "--warmup", "2",
                      "--iters", "2", "--log-interval", "2", "--repeats", "1", "--global-batch-size", "4",
                      "--micro-batch-size", "1", "--profile", "--out", str(out), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    for mode in ("bf16", "coat"):
        row = rows[f"dp/{mode}"]
        missing = [k for k in ROW_FIELDS if row.get(k) is None]
        assert row["ok"] and not missing, (missing, row.get("error"))
        assert (row["tp"], row["pp"], row["dp"], row["zero_stage"]) == (1, 1, 2, 2)
    assert rows["dp/bf16"]["speedup_vs_bf16"] == 1 and rows["dp/coat"]["memory_reduction_vs_bf16"] > 0
    assert all(rank and rank["compute_ms_per_step"] > 0 for rank in rows["dp/coat"]["profile_per_rank"])


def test_a_layout_may_name_its_zero_stage():
    assert speed.layout_flags("dp-z1", 4)[-2:] == ["--zero-stage", "1"]
    assert speed.layout_flags("tp2dp2-z1", 4)[:2] == ["--tensor-model-parallel-size", "2"]
    assert speed.layout_sizes("dp-z2", 4) == {"tp": 1, "pp": 1, "dp": 4}
    with pytest.raises(SystemExit, match="error: --layouts 'tp2pp2-z2': ZeRO-2"):
        speed.layout_sizes("tp2pp2-z2", 4)
    assert speed.layout_flags("dp-z3", 4)[-2:] == ["--zero-stage", "3"]  # ZeRO-3: data parallelism alone
    with pytest.raises(SystemExit, match="error: --layouts 'tp2dp2-z3'"):
        speed.layout_sizes("tp2dp2-z3", 4)
    with pytest.raises(SystemExit, match="error: --layouts 'dp-z4'"):
        speed.layout_sizes("dp-z4", 4)
    # the trainer refuses CUDA graphs under ZeRO-3: the recipe runs compiled without them
    flags, graphs = speed.mode_flags("coat", {"tp": 1, "pp": 1, "dp": 4}, stage=3)
    assert "--enable-cuda-graph" not in flags and "--compile" in flags and not graphs


def test_peers_run_data_parallel_only_with_their_own_flags():
    assert speed.mode_flags("torchtitan-float8-tensorwise", {"tp": 1, "pp": 1, "dp": 4}) == (
        ["--float8", "tensorwise", "--compile"], False)
    assert speed.mode_flags("torchtitan-float8-rowwise", {"tp": 1, "pp": 1, "dp": 2}, on_cpu=True) == (
        ["--float8", "rowwise"], False)
    with pytest.raises(SystemExit, match="error: --modes torchtitan-float8-rowwise: the peers run data parallel"):
        speed.parse_args(["--gpus", "4", "--layouts", "dp", "tp2dp2", "--modes", "coat", "torchtitan-float8-rowwise"])


def test_megacoat_rows_gain_ratios_against_each_peer_of_their_layout():
    rows = {"dp/coat": {"ok": True, "tokens_per_s_per_gpu": 150.0, "max_memory_gib": 20.0},
            "dp/torchtitan-float8-tensorwise": {"ok": True, "tokens_per_s_per_gpu": 100.0, "max_memory_gib": 30.0},
            "dp/torchtitan-float8-rowwise": {"ok": False, "skipped": "torchao is not installed"}}
    speed.add_ratios(rows)
    assert rows["dp/coat"]["speedup_vs_torchtitan-float8-tensorwise"] == 1.5
    assert rows["dp/coat"]["memory_reduction_vs_torchtitan-float8-tensorwise"] == 1.5
    assert "speedup_vs_torchtitan-float8-rowwise" not in rows["dp/coat"]  # that peer did not run
    assert not any(k.startswith("speedup_vs_torchtitan") for k in rows["dp/torchtitan-float8-tensorwise"])


def test_a_peer_without_torchao_is_skipped_with_its_reason(monkeypatch):
    real = speed.importlib.util.find_spec
    monkeypatch.setattr(speed.importlib.util, "find_spec", lambda name: None if name == "torchao" else real(name))
    assert "torchao is not installed" in speed.peer_missing("torchtitan-float8-tensorwise")
    assert speed.peer_missing("torchtitan-bf16") is None  # FSDP2 and torch.compile only


@pytest.mark.slow
def test_cpu_run_with_the_fsdp2_peer(tmp_path):
    """2 gloo ranks: megacoat's bf16 (fp32 on CPU) against the peer's FSDP2 loop, and torchao's tensorwise float8
    with FP8 weight all-gathers where torchao is installed: rows with every field, ratios against the peers."""
    peers = ["torchtitan-bf16"] + (["torchtitan-float8-tensorwise"] if speed.peer_missing(
        "torchtitan-float8-tensorwise") is None else [])
    out = tmp_path / "p.json"
    proc = run_module("benchmarks.parallel.speed", "--gpus", "2", "--model", "tiny", "--layouts", "dp", "--modes", "bf16",
                      *peers, "--warmup", "2", "--iters", "2", "--log-interval", "2", "--repeats", "1",
                      "--global-batch-size", "4", "--micro-batch-size", "1", "--out", str(out), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    for peer in peers:
        row = rows[f"dp/{peer}"]
        missing = [k for k in ROW_FIELDS if row.get(k) is None]
        assert row["ok"] and not missing, (missing, row.get("error"))
        assert (row["tp"], row["pp"], row["dp"], row["zero_stage"]) == (1, 1, 2, 3)
        assert rows["dp/bf16"][f"speedup_vs_{peer}"] > 0 and rows["dp/bf16"][f"memory_reduction_vs_{peer}"] > 0
