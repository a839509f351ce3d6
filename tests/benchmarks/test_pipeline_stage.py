"""benchmarks/parallel/pipeline_stage.py on CPU: the 1F1B order it drives, a tiny eager run's JSON, and the graphed
modes refused without a GPU."""
import json

import pytest
import torch

from benchmarks.parallel import pipeline_stage


@pytest.mark.parametrize("micro_batches,ahead", [(8, 2), (5, 3), (4, 1), (2, 4)])
def test_one_f_one_b_keeps_at_most_ahead_in_flight_in_micro_batch_order(micro_batches, ahead):
    order = pipeline_stage.one_f_one_b(micro_batches, ahead)
    assert [i for k, i in order if k == "F"] == [i for k, i in order if k == "B"] == list(range(micro_batches))
    in_flight = peak = 0
    for kind, _ in order:
        in_flight += 1 if kind == "F" else -1
        peak = max(peak, in_flight)
    assert peak == min(ahead, micro_batches)


def test_tiny_eager_run_writes_its_rows(tmp_path):
    out = tmp_path / "stage.json"
    pipeline_stage.main(["--model", "tiny", "--layers", "2", "--micro-batches", "3", "--iters", "2", "--repeats", "2",
                         "--check-steps", "1", "--modes", "bf16-eager", "coat-eager", "--out", str(out)])
    rows = json.loads(out.read_text())
    assert rows["micro_batches"] == 3 and rows["in_flight"] == 2 and "torch" in rows and "command" in rows
    for mode in ("bf16-eager", "coat-eager"):
        assert len(rows["modes"][mode]["step_s"]) == 2 and rows["modes"][mode]["tokens_per_s"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
def test_graphed_modes_need_a_gpu(capsys):
    with pytest.raises(SystemExit) as exit_:
        pipeline_stage.parse_args(["--modes", "coat-graphed"])
    assert exit_.value.code == 2 and "the graphed modes need a CUDA device" in capsys.readouterr().err
