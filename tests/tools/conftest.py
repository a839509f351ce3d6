"""Tool tests: load tools/*.py by path (tools/ is scripts, not a package) and reuse the data fixtures."""
import importlib.util
import os

import pytest

from tests.data.conftest import documents, tokenizer_model  # noqa: F401  (fixtures)

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools")


def load_tool(name):
    spec = importlib.util.spec_from_file_location(f"tool_{name}", os.path.join(TOOLS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def train_tokenizer():
    return load_tool("train_tokenizer")


@pytest.fixture(scope="session")
def preprocess_data():
    return load_tool("preprocess_data")
