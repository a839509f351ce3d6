import argparse

import pytest

from megacoat.arguments import parse_config
from megacoat.coat.recipe import DEFAULT_OUTPUT_LAYER, OUTPUT_LAYER_CHOICES


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
    (["--finetune"], "--finetune needs --load"),
    (["--override-optimizer-state", "reset"], "--override-optimizer-state"),
    (["--fp8-fast-accum"], "--fp8-fast-accum"),  # no FP8 GEMM to apply it to
    (["--fp8-output-layer"], "--fp8-output-layer"),  # nor here
    (["--fp8-output-layer", "on"], "--fp8-output-layer"),
    (["--coat-fp8", "--fp8-output-layer", "--vocab-size", "1000"], "--fp8-output-layer"),  # off the GEMM alignment
    (["--coat-fp8", "--fp8-output-layer", "on", "--hidden-size", "200", "--num-attention-heads", "4"],
     "--fp8-output-layer"),
    (["--coat-fp8", "--fp8-output-layer", "--tensor-model-parallel-size", "2", "--vocab-size", "4112"],
     "--fp8-output-layer"),  # 2056 rows a rank: off the GEMM alignment
    (["--coat-fp8", "--fp8-output-layer", "yes"], "--fp8-output-layer"),
    (["--coat-fp8", "--seq-length", "30", "--micro-batch-size", "1"], "--micro-batch-size 1 x --seq-length 30"),
    (["--fp8-activations", "fp8-linear", "--seq-length", "30", "--micro-batch-size", "1"], "--micro-batch-size"),
    (["--fp8-activations", "fp8-linear", "--fp8-grad-scaling", "delayed"], "--fp8-grad-scaling"),  # no SwiGLU kernel
    (["--coat-fp8", "--fp8-grad-scaling", "delayed", "--fp8-amax-history-len", "0"], "--fp8-amax-history-len"),
    (["--fp8-activations", "fp8-linear", "--fp8-activation-scaling", "delayed"], "--fp8-activation-scaling"),
])
def test_bad_flags_name_the_flag(capsys, argv, flag):
    assert flag in _error(capsys, argv)


def test_fast_accum_reaches_the_fp8_config():
    assert not parse_config(["--coat-fp8"]).fp8.fast_accum
    assert parse_config(["--coat-fp8", "--fp8-fast-accum"]).fp8.fast_accum
    assert parse_config(["--fp8-activations", "fp8-linear", "--fp8-fast-accum"]).fp8.fast_accum


def test_output_layer_on_and_off_reach_the_fp8_config():
    assert parse_config(["--coat-fp8", "--fp8-output-layer"]).fp8.output_layer  # the flag alone: on
    assert parse_config(["--coat-fp8", "--fp8-output-layer", "on"]).fp8.output_layer
    assert parse_config(["--fp8-activations", "fp8-linear", "--fp8-output-layer"]).fp8.output_layer
    assert not parse_config(["--coat-fp8", "--fp8-output-layer", "off"]).fp8.output_layer
    tp = ["--tensor-model-parallel-size", "2"]
    assert not parse_config(["--coat-fp8", "--fp8-output-layer", "off", *tp]).fp8.output_layer


@pytest.mark.parametrize("argv, fp8_head", [
    (["--coat-fp8"], True),  # vocabulary 4096 and hidden 192 by default: multiples of 16
    (["--fp8-activations", "coat"], True),
    (["--coat-fp8", "--fp8-output-layer", "auto", "--vocab-size", "32000", "--hidden-size", "2048",
      "--num-attention-heads", "16"], True),
    (["--coat-fp8", "--tensor-model-parallel-size", "2"], True),  # vocabulary-parallel
    (["--coat-fp8", "--tensor-model-parallel-size", "2", "--vocab-size", "4112"], False),  # 2056 rows a rank
    (["--coat-fp8", "--pipeline-model-parallel-size", "2"], True),  # on the last stage
    (["--coat-fp8", "--vocab-size", "1000"], False),  # off the FP8 GEMM alignment
    (["--coat-fp8", "--hidden-size", "200", "--num-attention-heads", "4"], False),
    (["--fp8-activations", "fp8-linear"], False),  # auto is coat mode's alone
    (["--fp8-optimizer"], False),  # FP8 moments, BF16 activations: no FP8 GEMM
    ([], False),
])
def test_output_layer_auto_is_fp8_in_coat_mode_where_the_fp8_head_runs(argv, fp8_head):
    assert parse_config([*argv, "--fp8-output-layer", "auto"]).fp8.output_layer is fp8_head


@pytest.mark.parametrize("argv", [["--coat-fp8"], ["--coat-fp8", "--tensor-model-parallel-size", "2"],
                                  ["--fp8-activations", "fp8-linear"], []])
def test_output_layer_default_is_the_library_constant(argv):
    """The trainer's default is DEFAULT_OUTPUT_LAYER (auto since the FP8 head's loss met the bar, see its comment)."""
    assert DEFAULT_OUTPUT_LAYER in OUTPUT_LAYER_CHOICES
    assert parse_config(argv) == parse_config([*argv, "--fp8-output-layer", DEFAULT_OUTPUT_LAYER])


def test_grad_scaling_reaches_the_fp8_config():
    fp8 = parse_config(["--coat-fp8", "--fp8-grad-scaling", "delayed", "--fp8-activation-scaling", "current",
                        "--fp8-amax-history-len", "4"]).fp8
    assert fp8.grad_scaling == "delayed" and fp8.amax_history_len == 4 and fp8.activation_scaling == "current"
    fp8 = parse_config(["--coat-fp8", "--fp8-grad-scaling", "current", "--fp8-activation-scaling", "delayed"]).fp8
    assert (fp8.grad_scaling, fp8.activation_scaling) == ("current", "delayed")


@pytest.mark.parametrize("argv, scaling", [
    (["--coat-fp8"], "delayed"),
    (["--fp8-activations", "coat"], "delayed"),
    (["--coat-fp8", "--tensor-model-parallel-size", "2"], "delayed"),
    (["--coat-fp8", "--pipeline-model-parallel-size", "2"], "delayed"),  # a stage's histories: the one-stage run's
    (["--fp8-activations", "fp8-linear"], "current"),  # no megacoat kernel makes its FP8 tensors
    ([], "current"),
])
def test_scaling_auto_is_delayed_where_it_applies(argv, scaling):
    fp8 = parse_config(argv).fp8
    assert (fp8.grad_scaling, fp8.activation_scaling) == (scaling, scaling)


def test_checkpoint_conversion_flags_reach_the_config():
    t = parse_config(["--load", "ckpt", "--finetune", "--override-optimizer-state", "convert"]).training
    assert t.finetune and t.override_optimizer_state == "convert"


def test_compile_composes_with_every_fp8_mode():
    # The FP8 flow's fused functions graph-break (tests/training/test_compile.py); the glue is compiled.
    for flags in (["--coat-fp8"], ["--fp8-activations", "fp8-linear"], ["--fp8-optimizer"]):
        assert parse_config(["--compile", *flags]).training.compile


def test_help_states_every_default_once(monkeypatch):
    from megacoat.arguments import build_parser

    monkeypatch.setenv("COLUMNS", "1000")  # one line per flag: no wrapping inside the texts compared
    parser = build_parser()
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if not action.option_strings or argparse.SUPPRESS in (action.default, action.help):
            continue
        help_text = " ".join(parser._get_formatter()._expand_help(action).split())
        assert "default" in help_text and help_text.count("default:") <= 1, (action.option_strings, help_text)
        assert help_text in text, (action.option_strings, help_text)
    assert "(default: heads) (default" not in text
    assert "--lr LR (default: 0.001)" in text and "--coat-fp8 the coat recipe" in text and "(default: off)" in text


@pytest.mark.parametrize("value", ["-1e-3", "-1E-3", "-2.5e+4", "-.5", "-1", "-1.0"])
def test_negative_numbers_reach_the_range_check(capsys, value):
    message = _error(capsys, ["--lr", value])
    assert "expected one argument" not in message
    assert "--lr" in message and "--lr > 0" in message


def test_scientific_notation_values_parse():
    cfg = parse_config(["--lr", "3e-4", "--min-lr", "3E-5", "--adam-eps", "1e-8"])
    assert (cfg.optim.lr, cfg.optim.min_lr, cfg.optim.adam_eps) == (3e-4, 3e-5, 1e-8)


def test_debug_flag():
    assert parse_config(["--debug"]).training.debug and not parse_config([]).training.debug
