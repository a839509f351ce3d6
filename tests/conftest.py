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
