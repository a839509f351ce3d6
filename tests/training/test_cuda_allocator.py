"""Expandable segments are the allocator's default under the trainer, and a user's PYTORCH_CUDA_ALLOC_CONF
is kept as it is."""
from megacoat.arguments import parse_config
from megacoat.parallel import ParallelState
from megacoat.training.banner import startup_banner
from megacoat.training.cuda_allocator import ALLOC_CONF, DEFAULT_ALLOC_CONF, default_allocator_settings


def test_unset_gets_expandable_segments():
    env = {}
    assert default_allocator_settings(env) == "expandable_segments:True" == DEFAULT_ALLOC_CONF
    assert env == {ALLOC_CONF: "expandable_segments:True"}


def test_user_settings_are_kept():
    for value in ("max_split_size_mb:512", "expandable_segments:False", ""):
        env = {ALLOC_CONF: value}
        assert default_allocator_settings(env) == value
        assert env == {ALLOC_CONF: value}


def test_banner_names_the_allocator_on_cuda_only():
    cfg = parse_config(["--bf16"])
    on_cuda = startup_banner(cfg, ParallelState(), 1, 1, bf16=True, on_cuda=True, allocator=DEFAULT_ALLOC_CONF)
    assert "  CUDA allocator: expandable_segments:True (PYTORCH_CUDA_ALLOC_CONF)" in on_cuda.splitlines()
    assert "CUDA allocator" not in startup_banner(cfg, ParallelState(), 1, 1, bf16=False, on_cuda=False,
                                                  allocator=DEFAULT_ALLOC_CONF)
