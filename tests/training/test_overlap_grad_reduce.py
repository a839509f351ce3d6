"""--overlap-grad-reduce: DeepSpeed's overlap_comm under megacoat's ZeRO-1/2 trainer (deepspeed_config.py) with the
patches of deepspeed_patches.install_overlapped_reduction.

- the overlapped reduction steps with the boundary reduction's gradients, norms and weights, bit for bit: both
  all-reduce the same elements (a bucket's composition does not change an element's sum over the ranks, nor its
  division by their count) and ZeRO-1 lays the reduced partition in the same order, so the norm sums alike;
- the collectives start before the last block's backward ends, on the step's last micro-batch only (ZeRO-1), where
  the boundary reduction starts after it; ZeRO-2 reduces in its gradient hooks at every micro-batch either way
  (overlap_comm moves that onto DeepSpeed's reduction stream, which a CPU does not have);
- where it cannot run, one line naming the flag.
The CPU runs use a 40 k-element bucket so that the tiny model fills several.
"""
import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch

from megacoat.arguments import parse_config
from megacoat.training.deepspeed_config import build_deepspeed_config, overlap_bucket_size
from tests.parallel.dist_helpers import run_ranks
from tests.training.checkpoint_runs import env, launcher
from tests.training.overlap_runs import train_variants

STEPS = 3
PRECISIONS = {"bf16": ["--bf16"], "coat": ["--bf16", "--coat-fp8"]}
GLOBAL_BATCH = {1: "8", 2: "16"}  # micro-batch 4 on 2 ranks: gradient accumulation 1 and 2
OVERLAP = ["--overlap-grad-reduce"]
GRADIENT = 1000  # elements: a collective larger than this carries gradients (the norm's and loss's carry 1 or a few)


def _bucket_config(directory) -> str:
    path = os.path.join(directory, "buckets.json")
    with open(path, "w") as f:
        json.dump({"zero_optimization": {"reduce_bucket_size": 40_000}}, f)
    return path


def _variants(stage: int, config: str) -> dict:
    return {(precision, accum, overlap): ["--zero-stage", str(stage), "--global-batch-size", GLOBAL_BATCH[accum],
                                          "--deepspeed_config", config, *flags, *(OVERLAP if overlap else [])]
            for precision, flags in PRECISIONS.items() for accum in GLOBAL_BATCH for overlap in (False, True)}


@pytest.fixture(scope="module", params=[1, 2], ids=["zero1", "zero2"])
def runs(request, tmp_path_factory):
    """Every variant of one ZeRO stage, STEPS steps each, in the same two gloo ranks: {key: [rank 0, rank 1]}."""
    variants = _variants(request.param, _bucket_config(tmp_path_factory.mktemp("overlap")))
    per_rank = run_ranks(2, train_variants, list(variants.values()), STEPS, timeout=600)
    return request.param, {key: [r[i] for r in per_rank] for i, key in enumerate(variants)}


def _equal(a, b) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.slow
def test_the_overlapped_reduction_steps_with_the_boundary_reductions_gradients_and_weights(runs):
    stage, out = runs
    for precision in PRECISIONS:
        for accum in GLOBAL_BATCH:
            for rank in (0, 1):
                boundary, overlapped = out[(precision, accum, False)][rank], out[(precision, accum, True)][rank]
                where = (precision, accum, rank)
                assert overlapped["overlap"] and not boundary["overlap"], where
                # ZeRO-1's partition laid in parameter order; a CPU has no reduction stream to wait for
                assert overlapped["patched"] == (["copy_grads_in_partition"] if stage == 1 else []), where
                # one client step per parameter group (2) per optimizer step
                assert len(boundary["grads"]) == 2 * STEPS and len(overlapped["grads"]) == 2 * STEPS, where
                for step, (a, b) in enumerate(zip(boundary["grads"], overlapped["grads"])):
                    assert _equal(a, b), (where, step)
                assert boundary["norms"] == overlapped["norms"], where  # clipping on: the norm decides the step
                assert _equal(boundary["weights"], overlapped["weights"]), where
            # the ranks step with the same gradients (ZeRO-1/2: each its own partition of the same reduction)
            assert _equal(out[(precision, accum, True)][0]["weights"], out[(precision, accum, True)][1]["weights"])


def _micro_batches(events) -> list[list]:
    """The events of the last step split at each micro-batch's forward."""
    parts: list[list] = []
    for e in events:
        if e == ("micro",):
            parts.append([])
        elif parts:
            parts[-1].append(e)
    return parts


def _gradient_collectives_before_backward_ends(part) -> int:
    """Gradient-sized collectives launched before the first block's (the last to run) backward ended."""
    end = part.index(("B>", 0))
    return sum(1 for e in part[:end] if e[0] == "C" and e[2] > GRADIENT)


@pytest.mark.slow
def test_the_overlapped_reduction_starts_before_the_last_blocks_backward_ends(runs):
    stage, out = runs
    for precision in PRECISIONS:
        for accum in GLOBAL_BATCH:
            overlapped = _micro_batches(out[(precision, accum, True)][0]["events"])
            boundary = _micro_batches(out[(precision, accum, False)][0]["events"])
            assert len(overlapped) == len(boundary) == accum
            # a bucket per block or so: several reductions while backward still runs
            assert _gradient_collectives_before_backward_ends(overlapped[-1]) >= 2, (precision, accum)
            if stage == 1:  # ZeRO-1's boundary reduction starts after backward; nothing before the last micro-batch
                assert _gradient_collectives_before_backward_ends(boundary[-1]) == 0, (precision, accum)
                for part in overlapped[:-1] + boundary[:-1]:
                    assert not [e for e in part if e[0] == "C" and e[2] > GRADIENT], (precision, accum)
            else:  # ZeRO-2 reduces in its hooks at every micro-batch, with or without overlap_comm
                for part in overlapped + boundary:
                    assert _gradient_collectives_before_backward_ends(part) >= 2, (precision, accum)
            # the last block (index 2) runs its backward first: the first bucket is reduced inside or after it
            first = next(i for i, e in enumerate(overlapped[-1]) if e[0] == "C" and e[2] > GRADIENT)
            assert ("B<", 2) in overlapped[-1][:first]


def test_the_epilogue_waits_for_the_reduction_stream_instead_of_synchronizing(monkeypatch):
    """What a GPU's epilogue runs (a CPU has no reduction stream): the compute stream's wait is enqueued first,
    DeepSpeed's epilogue then runs with overlap_comm off (so it neither synchronizes the device nor puts the last
    bucket on the side stream), and overlap_comm is back on afterwards, also when the epilogue raises."""
    import deepspeed.accelerator

    from megacoat.training.deepspeed_patches import _wait_instead_of_synchronize

    calls = []

    class Stream:
        def wait_stream(self, other):
            calls.append(("wait", other))

    class Accelerator:
        def current_stream(self):
            return Stream()

        def synchronize(self):
            calls.append("synchronize")

    class Zero:
        overlap_comm, reduction_stream, fail = True, "side", False

        def independent_gradient_partition_epilogue(self):
            calls.append(("epilogue", self.overlap_comm))
            if self.fail:
                raise RuntimeError("epilogue")

    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: Accelerator())
    zo = Zero()
    _wait_instead_of_synchronize(zo)
    zo.independent_gradient_partition_epilogue()
    assert calls == [("wait", "side"), ("epilogue", False)] and zo.overlap_comm
    zo.fail = True
    with pytest.raises(RuntimeError, match="epilogue"):
        zo.independent_gradient_partition_epilogue()
    assert zo.overlap_comm


# --- the DeepSpeed config and the refusals ------------------------------------------------------------------------

def test_the_flag_turns_on_overlap_comm_with_megatrons_bucket(tmp_path):
    cfg = parse_config(["--zero-stage", "2", "--global-batch-size", "64", "--overlap-grad-reduce"])
    ds = build_deepspeed_config(cfg, data_parallel_size=2, on_cuda=True)
    assert ds["zero_optimization"] == {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 40_000_000}
    assert overlap_bucket_size(64) == 64_000_000  # Megatron's max(40 M, 1 M x DP)
    assert build_deepspeed_config(parse_config([]), 2, on_cuda=True)["zero_optimization"] == {"stage": 1}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"reduce_bucket_size": 1000}}))
    cfg = parse_config(["--overlap-grad-reduce", "--deepspeed_config", str(path)])
    assert build_deepspeed_config(cfg, 2, on_cuda=True)["zero_optimization"]["reduce_bucket_size"] == 1000
    path.write_text(json.dumps({"zero_optimization": {"overlap_comm": False}}))
    with pytest.raises(ValueError, match="overlap_comm false disagrees with --overlap-grad-reduce"):
        build_deepspeed_config(cfg, 2, on_cuda=True)


@pytest.mark.parametrize("argv", [
    ["--zero-stage", "0"],
    ["--zero-stage", "3"],
    ["--pipeline-model-parallel-size", "2"],
    ["--bf16", "--main-grads-dtype", "fp32"],  # ZeRO-1 runs DeepSpeed's BF16_Optimizer
], ids=["zero0", "zero3", "pipeline", "zero1-fp32-grads"])
def test_where_it_cannot_run_one_line_names_the_flag(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(argv + ["--overlap-grad-reduce"])
    assert e.value.code != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--overlap-grad-reduce" in err and "Traceback" not in err, err


# --- two GPUs, CUDA graphs -------------------------------------------------------------------------------------

@pytest.mark.multigpu
@pytest.mark.parametrize("accum", [1, 2], ids=["accum1", "accum2"])
@pytest.mark.parametrize("stage", [1, 2], ids=["zero1", "zero2"])
def test_gpu_cuda_graphs_overlapped_reduction_gives_the_boundary_reductions_gradients(tmp_path, stage, accum):
    """Two GPUs, NCCL, --coat-fp8 --enable-cuda-graph: the graphed blocks' gradients come out of the graph pool
    into DeepSpeed's buckets (accumulation 1: straight from the pool; 2: after own_graph_gradients' copy), and
    overlapped buckets reduce on DeepSpeed's reduction stream. The boundary reduction runs twice: kernels whose
    results vary from run to run would show there, and then bound the difference allowed; where the two agree,
    the overlapped reduction must agree bit for bit (the CPU test's argument). Under overlap no device-wide
    synchronize runs in the step (the epilogue waits on the device)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    common = ["--zero-stage", str(stage), "--global-batch-size", GLOBAL_BATCH[accum], "--deepspeed_config",
              _bucket_config(tmp_path), "--bf16", "--coat-fp8", "--enable-cuda-graph"]
    variants = [common, common, common + OVERLAP]
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "overlap_runs.py")
    from tests.parallel.test_pretrain_parallel import free_port

    proc = subprocess.run(launcher(2, free_port()) + [script, str(tmp_path), str(STEPS), json.dumps(variants)],
                          cwd=tmp_path, env=env(tmp_path), capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    for rank in (0, 1):
        boundary, again, overlapped = pickle.loads((tmp_path / f"rank{rank}.pkl").read_bytes())
        assert overlapped["overlap"] and not boundary["overlap"]
        assert "independent_gradient_partition_epilogue" in overlapped["patched"]
        assert ("S",) not in overlapped["events"]
        assert _gradient_collectives_before_backward_ends(_micro_batches(overlapped["events"])[-1]) >= 2
        pairs = [(a, b) for s, t in zip(boundary["grads"], again["grads"]) for a, b in zip(s, t)]
        ours = [(a, b) for s, t in zip(boundary["grads"], overlapped["grads"]) for a, b in zip(s, t)]
        if all(np.array_equal(a, b) for a, b in pairs):
            assert all(np.array_equal(a, b) for a, b in ours)
            assert boundary["norms"] == overlapped["norms"]
            assert _equal(boundary["weights"], overlapped["weights"])
        else:
            noise = max(float(np.abs(a - b).max()) for a, b in pairs)
            assert max(float(np.abs(a - b).max()) for a, b in ours) <= 2 * noise
