"""Parallelism: process groups (parallel state) and the functions that make the plain model tensor/pipeline parallel."""
from megacoat.parallel.config import ParallelConfig
from megacoat.parallel.state import ParallelState, check_parallel_sizes, initialize_parallel_state
from megacoat.parallel.tensor_parallel import apply_tp

__all__ = ["ParallelConfig", "ParallelState", "apply_tp", "check_parallel_sizes", "initialize_parallel_state"]
