import pytest

from megacoat.arguments import NOT_IMPLEMENTED_YET, parse_config


def _error(capsys, argv):
    with pytest.raises(SystemExit) as e:
        parse_config(argv)
    assert e.value.code != 0
    return str(e.value.code) + capsys.readouterr().err


def test_defaults_build_a_config():
    cfg = parse_config([])
    assert cfg.model.num_layers == 4 and cfg.training.global_batch_size == 16 and cfg.fp8.mode == "bf16"


@pytest.mark.parametrize("argv, flag", [
    (["--global-batch-size", "10", "--micro-batch-size", "4"], "--global-batch-size"),
    (["--num-attention-heads", "6", "--num-query-groups", "4"], "--num-query-groups"),
    (["--hidden-size", "100", "--num-attention-heads", "6"], "--hidden-size"),
    (["--lr-decay-style", "exp"], "--lr-decay-style"),
    (["--bf16", "--fp32"], "--fp32"),
    (["--no-such-flag"], "--no-such-flag"),
    (["--save-interval", "5"], "--save"),
])
def test_bad_flags_name_the_flag(capsys, argv, flag):
    assert flag in _error(capsys, argv)


@pytest.mark.parametrize("key", sorted(NOT_IMPLEMENTED_YET))
def test_reserved_flags_fail_clearly_until_implemented(capsys, key):
    argv = {"coat_fp8": ["--coat-fp8"], "fp8_optimizer": ["--fp8-optimizer"],
            "fp8_activations": ["--fp8-activations"],
            "tensor_model_parallel_size": ["--tensor-model-parallel-size", "2"],
            "pipeline_model_parallel_size": ["--pipeline-model-parallel-size", "2"],
            "sequence_parallel": ["--sequence-parallel", "--tensor-model-parallel-size", "2"]}[key]
    assert "not implemented yet" in _error(capsys, argv)


def test_compile_with_fp8_activations_is_refused(capsys):
    assert "--compile" in _error(capsys, ["--compile", "--coat-fp8"])
    assert parse_config(["--compile", "--fp8-optimizer"]).training.compile
