"""megacoat/training/runtime.py: expandable segments are the allocator's default under the trainer and a user's
PYTORCH_CUDA_ALLOC_CONF is kept as it is; --cublas-workspace `none` sets both of torch's workspace variables to no
workspace before the first GEMM, `default` leaves the environment alone, `auto` (the default) is `none` where FP8
GEMMs run, and a different value the user set is an error for `none`, and left alone by `auto`."""
import pytest

from megacoat.arguments import parse_config
from megacoat.parallel import ParallelState
from megacoat.training.banner import startup_banner
from megacoat.training.runtime import (ALLOC_CONF, DEFAULT_ALLOC_CONF, NO_WORKSPACE, apply_cublas_workspace,
                                       default_allocator_settings)



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


def test_default_leaves_the_environment_alone():
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    assert apply_cublas_workspace("default", True, env) == "default"
    assert env == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def test_none_sets_both_variables():
    env = {}
    assert apply_cublas_workspace("none", False, env).startswith("none")
    assert env == {"CUBLASLT_WORKSPACE_SIZE": "0", "CUBLAS_WORKSPACE_CONFIG": ":0:0"} == NO_WORKSPACE


def test_none_over_the_same_values_is_fine_and_over_others_is_named():
    env = dict(NO_WORKSPACE)
    assert apply_cublas_workspace("none", False, env).startswith("none") and env == NO_WORKSPACE
    env = {"CUBLASLT_WORKSPACE_SIZE": "1024"}
    with pytest.raises(ValueError, match="--cublas-workspace none conflicts with CUBLASLT_WORKSPACE_SIZE=1024"):
        apply_cublas_workspace("none", False, env)
    assert env == {"CUBLASLT_WORKSPACE_SIZE": "1024"}  # nothing written


def test_flag_reaches_the_config_and_the_banner():
    assert parse_config([]).training.cublas_workspace == "auto"
    cfg = parse_config(["--bf16", "--cublas-workspace", "none"])
    assert cfg.training.cublas_workspace == "none"
    banner = startup_banner(cfg, ParallelState(), 1, 1, bf16=True, on_cuda=True,
                            cublas_workspace=apply_cublas_workspace("none", False, {}))
    assert "  cuBLAS workspace: none (CUBLASLT_WORKSPACE_SIZE=0, CUBLAS_WORKSPACE_CONFIG=:0:0)" in banner.splitlines()
    assert "cuBLAS workspace" not in startup_banner(parse_config(["--bf16"]), ParallelState(), 1, 1, bf16=True,
                                                     on_cuda=True)


def test_bad_value_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(["--cublas-workspace", "small"])
    assert e.value.code == 1 and "--cublas-workspace" in capsys.readouterr().err


def test_auto_is_none_with_fp8_gemms_only_and_yields_to_the_user():
    env = {}
    assert apply_cublas_workspace("auto", False, env) == "default" and env == {}
    assert apply_cublas_workspace("auto", True, env).startswith("none") and env == NO_WORKSPACE
    for user in ({"CUBLASLT_WORKSPACE_SIZE": "1024"}, {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}):
        env = dict(user)
        (k, v), = user.items()
        assert apply_cublas_workspace("auto", True, env) == f"the environment's ({k}={v})"
        assert env == user
