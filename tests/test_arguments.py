import pytest

from megacoat.arguments import parse_config


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


def test_compile_composes_with_every_fp8_mode():
    # The FP8 flow's fused functions graph-break (tests/training/test_compile.py); the glue is compiled.
    for flags in (["--coat-fp8"], ["--fp8-activations", "fp8-linear"], ["--fp8-optimizer"]):
        assert parse_config(["--compile", *flags]).training.compile
