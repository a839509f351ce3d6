"""Shared test setup: the `gpu` marker skips without CUDA; tests never see a GPU they did not ask for."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Before any test module imports triton: @triton.jit decides compiled vs interpreted at decoration time,
    # triton.language's own jit helpers (tl.max, ...) included, so CPU kernel tests need it set this early.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def one_thread():
    """Small tensors: on a loaded CI box, intra-op threads cost 1000x more than they gain (measured: 20 ms vs
    0.02 ms for log2 of 7k floats with 2 threads under load)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
