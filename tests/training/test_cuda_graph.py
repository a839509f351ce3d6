"""--enable-cuda-graph: settings CUDA graphs cannot run with are refused before any work, with one line naming
the flag. (Capture and replay themselves need a GPU: tests/fp8/test_blocks.py and the commands in the report.)"""
import pytest
import torch

from megacoat.arguments import parse_config
from megacoat.parallel.config import ParallelConfig
from megacoat.training.config import TrainingConfig
from megacoat.training.cuda_graph import check_cuda_graph


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_no_cuda_device_is_refused_with_one_error_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--enable-cuda-graph", "--mock-data"])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert "error: --enable-cuda-graph needs a CUDA device" in err and "Traceback" not in err


def test_pipeline_parallelism_is_refused():
    with pytest.raises(ValueError, match="--enable-cuda-graph does not support --pipeline-model-parallel-size"):
        check_cuda_graph(ParallelConfig(pipeline_model_parallel_size=2), cuda_available=True)
    check_cuda_graph(ParallelConfig(tensor_model_parallel_size=2), cuda_available=True)  # TP is fine


def test_cuda_graph_needs_the_compiled_blocks():
    with pytest.raises(ValueError, match="--enable-cuda-graph .* needs --compile"):
        TrainingConfig(enable_cuda_graph=True, compile=False)
    assert TrainingConfig(enable_cuda_graph=True, compile=True).enable_cuda_graph
