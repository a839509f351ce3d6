"""The start-up banner states precision, the FP8 activation mode, the optimizer and its moment formats, the
ZeRO stage and the parallel layout."""
from megacoat.arguments import parse_config
from megacoat.parallel import ParallelState
from megacoat.training.banner import startup_banner
from megacoat.training.deepspeed_config import resolve_main_params


def test_coat_run_on_cuda_with_bf16():
    cfg = resolve_main_params(parse_config(["--coat-fp8", "--fp8-v-dtype", "e5m2", "--fp8-group-size", "64",
                                            "--fp8-no-expansion", "--zero-stage", "2", "--global-batch-size", "32"]),
                              on_cuda=True)
    text = startup_banner(cfg, ParallelState(dp_size=2), world_size=2, grad_accum=2, bf16=True, on_cuda=True)
    lines = text.splitlines()
    assert lines[0] == "megacoat run:" and len(lines) == 7
    assert "precision: bf16 weights and activations, exact fp32 masters as the bf16 weights plus CoatAdamW's 16-bit " \
           "remainders (the default on CUDA)" in text
    fp32 = resolve_main_params(parse_config(["--coat-fp8", "--zero-stage", "0"]), on_cuda=True)
    assert "fp32 master weights in the optimizer (the default on CUDA)" in startup_banner(
        fp32, ParallelState(), world_size=1, grad_accum=1, bf16=True, on_cuda=True)
    assert "FP8: coat: FP8 GEMMs (E4M3 inputs and weights, per-tensor scales; gradients E5M2); RMSNorm and SwiGLU " \
           "in E4M3 with 1x64 group scales" in text
    assert "optimizer: CoatAdamW: first moment E4M3, second moment E5M2, one scale per group of 64, dynamic range " \
           "expansion off (--fp8-no-expansion)" in text
    assert "parallel: TP 1 x PP 1 x DP 2; ZeRO-2; world size 2" in text
    assert "global batch 32 (gradient accumulation 2)" in text


def test_plain_run_on_cpu():
    cfg = parse_config(["--tensor-model-parallel-size", "2", "--sequence-parallel", "--zero-stage", "0"])
    state = ParallelState(tp_size=2, sequence_parallel=True)
    text = startup_banner(cfg, state, world_size=2, grad_accum=2, bf16=False, on_cuda=False)
    assert "precision: fp32 weights and activations (the default on CPU)" in text
    assert "FP8: off (transformer blocks in fp32" in text
    assert "optimizer: AdamW, fp32 moments; lr 0.001" in text
    assert "parallel: TP 2 x PP 1 x DP 1, sequence parallel; ZeRO-0; world size 2" in text
    fp8_linear = startup_banner(parse_config(["--fp8-activations", "fp8-linear", "--bf16"]), ParallelState(), 1, 2,
                                bf16=True, on_cuda=True)
    assert "FP8: fp8-linear: FP8 GEMMs" in fp8_linear and "(--bf16)" in fp8_linear
    assert "fast accumulation" not in fp8_linear
    assert "the output layer in high precision" in fp8_linear
    head = startup_banner(parse_config(["--coat-fp8", "--fp8-output-layer", "auto"]), ParallelState(), 1, 2, bf16=True,
                          on_cuda=True)
    assert "the output layer in FP8 too (--fp8-output-layer)" in head  # auto, where the FP8 head runs
    fast = startup_banner(parse_config(["--coat-fp8", "--fp8-fast-accum"]), ParallelState(), 1, 2, bf16=True,
                          on_cuda=True)
    assert "gradients E5M2; forward GEMMs with fast accumulation (--fp8-fast-accum))" in fast
    delayed = startup_banner(parse_config(["--coat-fp8", "--fp8-activation-scaling", "current"]), ParallelState(),
                             1, 2, bf16=True, on_cuda=True)
    assert "SwiGLU's and the [q|k|v] output's gradients with delayed scaling (history of 16, --fp8-grad-sca" in delayed
    both = startup_banner(parse_config(["--coat-fp8"]), ParallelState(), 1, 2, bf16=True, on_cuda=True)
    assert "gradients and RMSNorm's and SwiGLU's outputs and wo's input with delayed scaling" in both  # the default
    assert "delayed" not in startup_banner(parse_config(["--coat-fp8", "--fp8-grad-scaling", "current",
                                                         "--fp8-activation-scaling", "current"]), ParallelState(),
                                           1, 2, bf16=True, on_cuda=True)


def test_coat_says_why_its_head_stays_in_bf16():
    """--fp8-output-layer auto keeps coat's head in BF16 where the FP8 head does not run; the banner says why."""
    def head(argv, state=ParallelState()):
        return startup_banner(parse_config(["--coat-fp8", "--zero-stage", "0", "--fp8-output-layer", "auto", *argv]),
                              state, 2, 1, bf16=True, on_cuda=True)

    tp = head(["--tensor-model-parallel-size", "2", "--vocab-size", "4112"], ParallelState(tp_size=2))
    assert "the output layer in high precision (the FP8 head needs each tensor-parallel rank's vocabulary slice to " \
           "be a multiple of 16)" in tp
    assert "the output layer in FP8 too" in head(["--tensor-model-parallel-size", "2"], ParallelState(tp_size=2))
    assert "the output layer in high precision (the FP8 head needs vocabulary and hidden sizes that are multiples " \
           "of 16)" in head(["--vocab-size", "1000"])
    assert "the output layer in high precision (--fp8-output-layer off)" in head(["--fp8-output-layer", "off"])


def _shard(prefix, documents):
    import numpy as np

    from megacoat.data.indexed_dataset import IndexedDatasetWriter

    writer = IndexedDatasetWriter(str(prefix), np.uint16)
    for doc in documents:
        writer.add_document(doc)
    writer.finalize()
    return str(prefix)


def test_data_line_names_the_shards_weights_documents_and_tokens(tmp_path):
    a = _shard(tmp_path / "a", [[1, 2, 3], [4, 5]])
    b = _shard(tmp_path / "b", [[6] * 10])
    cfg = parse_config(["--data-path", "0.7", a, "0.3", b, "--tokenizer-model", "tok.model"])
    text = startup_banner(cfg, ParallelState(), 1, 2, bf16=False, on_cuda=False)
    assert f"  data: {a} (weight 0.7), {b} (weight 0.3): 3 documents, 15 tokens; split 969,30,1; tokenizer " \
           "tok.model" in text.splitlines()
    many = [_shard(tmp_path / f"s{i}", [[i + 1]]) for i in range(6)]
    text = startup_banner(parse_config(["--data-path"] + many), ParallelState(), 1, 2, bf16=False, on_cuda=False)
    assert f"data: {', '.join(many[:4])}, and 2 more: 6 documents, 6 tokens" in text
    assert "data: random tokens (--mock-data)" in startup_banner(parse_config(["--mock-data"]), ParallelState(), 1,
                                                                 2, bf16=False, on_cuda=False)


def test_run_summary():
    from types import SimpleNamespace

    from megacoat.training.banner import run_summary

    cfg = parse_config(["--global-batch-size", "8", "--seq-length", "32", "--save", "ckpt"])
    trainer = SimpleNamespace(cfg=cfg, state=SimpleNamespace(iteration=30), saved_checkpoint="ckpt/iter_0000030")
    history = {"loss": [(20, 5.0), (30, 4.25)], "val_loss": [(30, 4.5)]}
    assert run_summary(trainer, history, seconds=2.0, start_iteration=10).splitlines() == [
        "megacoat run done:",
        "  trained: 20 iterations (10 -> 30), 5,120 tokens in 2.0 s (2,560 tokens/s)",
        "  final loss: train 4.2500 (iteration 30), validation 4.5000 (iteration 30)",
        "  checkpoint: ckpt/iter_0000030"]
    unsaved = SimpleNamespace(cfg=parse_config(["--eval-iters", "0"]), state=SimpleNamespace(iteration=0),
                              saved_checkpoint=None)
    text = run_summary(unsaved, {"loss": [], "val_loss": []}, seconds=0.0, start_iteration=0)
    assert "final loss: train -, no validation (--eval-iters 0)" in text and "checkpoint: none (no --save)" in text
