import json

import pytest

from megacoat.arguments import parse_config
from megacoat.training.deepspeed_config import build_deepspeed_config, resolve_main_params


def test_written_config_follows_flags():
    cfg = parse_config(["--micro-batch-size", "2", "--global-batch-size", "16", "--zero-stage", "2",
                        "--clip-grad", "0.5"])
    ds = build_deepspeed_config(cfg, data_parallel_size=2, on_cuda=True)
    assert ds["train_batch_size"] == 16 and ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_accumulation_steps"] == 4
    assert ds["zero_optimization"]["stage"] == 2 and ds["gradient_clipping"] == 0.5
    assert ds["bf16"]["enabled"] is True
    assert build_deepspeed_config(cfg, 2, on_cuda=False)["bf16"]["enabled"] is False  # auto: fp32 on CPU


def test_global_batch_not_divisible_by_data_parallel_is_an_error():
    cfg = parse_config(["--micro-batch-size", "4", "--global-batch-size", "8"])
    with pytest.raises(ValueError, match="global-batch-size.*data-parallel size \\(3\\)"):
        build_deepspeed_config(cfg, data_parallel_size=3, on_cuda=False)


def test_user_config_that_contradicts_flags_is_an_error(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 32, "zero_optimization": {"stage": 2}}))
    cfg = parse_config(["--global-batch-size", "16", "--deepspeed_config", str(path)])
    with pytest.raises(ValueError, match="train_batch_size=32"):
        build_deepspeed_config(cfg, 1, on_cuda=False)
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "overlap_comm": True}}))
    cfg = parse_config(["--zero-stage", "2", "--deepspeed_config", str(path)])
    ds = build_deepspeed_config(cfg, 1, on_cuda=False)
    assert ds["zero_optimization"] == {"stage": 2, "overlap_comm": True}


def test_the_untested_optimizer_warning_is_dropped_and_nothing_else():
    import logging

    from megacoat.training.deepspeed_config import quiet_tested_optimizer_warning

    def record(msg):
        return logging.LogRecord("DeepSpeed", logging.WARNING, __file__, 1, msg, None, None)

    assert not quiet_tested_optimizer_warning(
        record("**** You are using ZeRO with an untested optimizer, proceed with caution *****"))
    assert quiet_tested_optimizer_warning(record("some other warning"))


def test_main_grads_and_params_dtypes_become_deepspeed_settings():
    ds = build_deepspeed_config(parse_config(["--bf16"]), 1, on_cuda=True)
    assert ds["data_types"] == {"grad_accum_dtype": "bf16"} and "communication_data_type" not in ds
    assert "bf16_master_weights_and_grads" not in ds["bf16"]
    ds = build_deepspeed_config(parse_config(["--bf16", "--main-grads-dtype", "fp32"]), 1, on_cuda=True)
    assert ds["data_types"] == {"grad_accum_dtype": "fp32"} and ds["communication_data_type"] == "fp32"
    cfg = parse_config(["--fp8-optimizer", "--main-params-dtype", "bf16-remainder", "--zero-stage", "2"])
    ds = build_deepspeed_config(cfg, 1, on_cuda=False)  # asks for bf16 even where auto would be fp32
    assert ds["bf16"] == {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    assert ds["data_types"] == {"grad_accum_dtype": "bf16"}
    assert "data_types" not in build_deepspeed_config(parse_config(["--fp32"]), 1, on_cuda=False)


@pytest.mark.parametrize("argv, on_cuda, want", [
    (["--bf16", "--coat-fp8", "--zero-stage", "1"], False, "bf16-remainder"),
    (["--coat-fp8", "--zero-stage", "2"], True, "bf16-remainder"),  # bf16 by default on CUDA
    (["--coat-fp8", "--zero-stage", "1"], False, "fp32"),  # fp32 by default on the CPU: no bf16 weights
    (["--bf16", "--coat-fp8", "--zero-stage", "0"], True, "fp32"),  # DeepSpeed's BF16_Optimizer keeps its own
    (["--bf16", "--fp8-activations", "coat", "--zero-stage", "1"], True, "fp32"),  # AdamW keeps no remainders
    (["--bf16", "--coat-fp8", "--zero-stage", "1", "--main-grads-dtype", "fp32"], True, "fp32"),
    (["--bf16", "--coat-fp8", "--zero-stage", "1", "--pipeline-model-parallel-size", "2", "--num-layers", "2"],
     True, "fp32"),
    (["--bf16", "--coat-fp8", "--zero-stage", "1", "--main-params-dtype", "fp32"], True, "fp32"),  # as asked
])
def test_default_master_is_the_remainders_where_they_run(argv, on_cuda, want):
    cfg = parse_config(argv)
    assert cfg.optim.main_params_dtype is None or "--main-params-dtype" in argv
    assert resolve_main_params(cfg, on_cuda).optim.main_params_dtype == want


def test_a_resumed_checkpoint_keeps_its_master_when_the_flag_is_not_given():
    cfg = parse_config(["--bf16", "--coat-fp8", "--zero-stage", "1"])
    assert resolve_main_params(cfg, True, saved="fp32").optim.main_params_dtype == "fp32"
    assert resolve_main_params(cfg, True, saved="bf16-remainder").optim.main_params_dtype == "bf16-remainder"
    asked = parse_config(["--bf16", "--coat-fp8", "--zero-stage", "1", "--main-params-dtype", "bf16-remainder"])
    assert resolve_main_params(asked, True, saved="fp32").optim.main_params_dtype == "bf16-remainder"  # then refused
    # a saved remainder master where this run cannot keep one (ZeRO-0) is not adopted: the load check names it
    zero0 = parse_config(["--bf16", "--coat-fp8", "--zero-stage", "0"])
    assert resolve_main_params(zero0, True, saved="bf16-remainder").optim.main_params_dtype == "fp32"
