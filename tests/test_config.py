"""megacoat/config.py: TrainingConfig's checks and check_cuda_graph, the settings --enable-cuda-graph is refused
with before any work (one line naming the flag)."""
import pytest
import torch

from megacoat.arguments import parse_config
from megacoat.config import MegacoatConfig, TrainingConfig, check_cuda_graph
from megacoat.parallel.config import ParallelConfig


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_no_cuda_device_is_refused_with_one_error_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--enable-cuda-graph", "--mock-data"])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert "error: --enable-cuda-graph needs a CUDA device" in err and "Traceback" not in err


def test_pipeline_and_tensor_parallelism_are_accepted():
    """A pipeline stage is captured per micro-batch slot (megacoat/parallel/stage_graphs.py): no refusal."""
    check_cuda_graph(ParallelConfig(pipeline_model_parallel_size=2), cuda_available=True)
    check_cuda_graph(ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), cuda_available=True)


def test_cuda_graph_needs_the_compiled_blocks():
    with pytest.raises(ValueError, match="--enable-cuda-graph .* needs --compile"):
        TrainingConfig(enable_cuda_graph=True, compile=False)
    assert TrainingConfig(enable_cuda_graph=True, compile=True).enable_cuda_graph


def test_training_config_checks_name_the_flag():
    with pytest.raises(ValueError, match="--global-batch-size \\(10\\) must be divisible by --micro-batch-size \\(4\\)"):
        TrainingConfig(micro_batch_size=4, global_batch_size=10)
    assert TrainingConfig(micro_batch_size=2, global_batch_size=8).gradient_accumulation_steps(2) == 2
    assert MegacoatConfig().to_dict()["training"]["micro_batch_size"] == TrainingConfig().micro_batch_size
