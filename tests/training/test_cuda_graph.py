"""--enable-cuda-graph around the graphed blocks (megacoat/training/cuda_graph.py): gradients copied out of the graph
pool, and graphed blocks equal to compiled ones (GPU). The refused settings: tests/test_config.py."""
import pytest
import torch


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["bf16", "fp8-linear", "coat"])
def test_gpu_graphed_block_equals_eager_and_never_syncs(mode):
    """One block compiled fullgraph in mode reduce-overhead (what --enable-cuda-graph does), three steps of fixed
    inputs (warm-up, capture, replay): every step equals the same block compiled without CUDA graphs bit for bit
    (the same Inductor kernels, launched by a graph instead of one by one) and, with Inductor rounding each bf16
    intermediate as eager does (emulate_precision_casts, see tests/coat/test_blocks.py), the eager block bit for
    bit. The replayed step makes no host sync (sync debug mode "error"). Results are cloned at once: a replay
    reuses its outputs' memory."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import torch._inductor.config as inductor_config

    from tests.coat.test_blocks import _block

    block, x, cos, sin = _block(mode, dtype=torch.bfloat16, device="cuda")

    def step(fn):
        torch.compiler.cudagraph_mark_step_begin()
        x.grad = None
        block.zero_grad(set_to_none=True)
        y = fn(x, cos, sin)
        y.float().square().sum().backward()
        return [y.detach().clone(), x.grad.clone()] + [p.grad.clone() for p in block.parameters()]

    eager = step(block)
    torch._dynamo.reset()
    with inductor_config.patch(emulate_precision_casts=True):
        plain = step(torch.compile(block, fullgraph=True))
        graphed = torch.compile(block, fullgraph=True, mode="reduce-overhead")
        runs = [step(graphed) for _ in range(2)]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            runs.append(step(graphed))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert all(torch.equal(a, b) for a, b in zip(plain, eager))
    for run in runs:
        assert all(torch.equal(a, b) for a, b in zip(run, plain))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["bf16", "coat"])
def test_gpu_graphed_gradient_accumulation_equals_compiled(mode):
    """Two micro-batches per step, as the trainer runs them: gradients accumulate across graph replays (after
    own_graph_gradients copies the first micro-batch's out of the pool) and equal the compiled block's, bit for
    bit, at every step."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from megacoat.training.cuda_graph import own_graph_gradients
    from tests.coat.test_blocks import _block

    block, x, cos, sin = _block(mode, dtype=torch.bfloat16, device="cuda")
    x2 = torch.randn_like(x)

    def steps(fn, graphed):
        out = []
        for _ in range(3):  # warm-up, capture, replay
            block.zero_grad(set_to_none=True)
            for micro, xi in enumerate((x, x2)):
                torch.compiler.cudagraph_mark_step_begin()
                fn(xi.detach().requires_grad_(True), cos, sin).float().square().sum().backward()
                if graphed and micro == 0:
                    own_graph_gradients([block.parameters()])
            out.append([p.grad.clone() for p in block.parameters()])
        return out

    torch._dynamo.reset()
    plain = steps(torch.compile(block, fullgraph=True), graphed=False)
    graphed = steps(torch.compile(block, fullgraph=True, mode="reduce-overhead"), graphed=True)
    for g, c in zip(graphed, plain):
        assert all(torch.equal(a, b) for a, b in zip(g, c))


@pytest.mark.gpu
def test_gpu_graphed_deferred_block_outputs_equal_compiled():
    """The coat model's block sequence (CoatLayers) under CUDA graphs: each block's deferred output (h, out
    and w2's carrier) crosses from one block's graph into the next one's. Two micro-batches a step, as the trainer
    runs them: loss and every gradient bit for bit those of the same blocks compiled without graphs."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from tests.coat.recipes import recipe_of
    from megacoat.coat.convert import convert_to_coat
    from megacoat.coat.linear import refresh_fp8_weights
    from megacoat.model.config import ModelConfig
    from megacoat.model.gpt import GPT
    from megacoat.training.cuda_graph import own_graph_gradients
    from tests.coat.test_blocks import CFG

    def build(mode):
        torch.manual_seed(0)
        model = convert_to_coat(GPT(ModelConfig(**{**CFG, "num_layers": 3})), recipe_of(mode="coat", group_size=32))
        model = model.to(device="cuda", dtype=torch.bfloat16)
        refresh_fp8_weights(model)
        for block in model.layers:
            block.compile(fullgraph=True, mode=mode)
        return model

    tokens = [torch.randint(0, CFG["vocab_size"], (2, CFG["seq_length"]), device="cuda") for _ in range(2)]

    def steps(model, graphed):
        out = []
        for _ in range(3):  # warm-up, capture, replay
            model.zero_grad(set_to_none=True)
            losses = []
            for micro, t in enumerate(tokens):
                torch.compiler.cudagraph_mark_step_begin()
                loss = model(t, t)
                loss.backward()
                losses.append(loss.detach().clone())
                if graphed and micro == 0:
                    own_graph_gradients([list(model.parameters())])
            out.append(losses + [p.grad.clone() for p in model.parameters()])
        return out

    torch._dynamo.reset()
    plain = steps(build(None), graphed=False)
    graphed = steps(build("reduce-overhead"), graphed=True)
    for g, c in zip(graphed, plain):
        assert all(torch.equal(a, b) for a, b in zip(g, c))


def test_own_graph_gradients_copies_each_group_into_one_buffer_in_order():
    from megacoat.training.cuda_graph import own_graph_gradients
    from megacoat.training.deepspeed_patches import flat_view

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model(torch.randn(2, 4)).sum().backward()
    before = {n: p.grad for n, p in model.named_parameters()}
    groups = [[model[1].weight, model[0].weight], [model[0].bias, model[1].bias]]  # not the module's order
    assert own_graph_gradients(groups) == 4
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, before[n]) and p.grad.data_ptr() != before[n].data_ptr()
    for group in groups:  # each group's gradients are one run of memory, in the group's order
        grads = [p.grad for p in group]
        flat = flat_view(grads, sum(g.numel() for g in grads))
        assert flat is not None and torch.equal(flat, torch.cat([g.reshape(-1) for g in grads]))
    assert model[1].weight.grad.untyped_storage().data_ptr() != model[0].bias.grad.untyped_storage().data_ptr()


def test_own_graph_gradients_skips_absent_and_copies_mixed_dtypes_one_by_one():
    from megacoat.training.cuda_graph import own_graph_gradients

    a, b, unused = (torch.nn.Parameter(torch.randn(3)) for _ in range(3))
    c = torch.nn.Parameter(torch.randn(2, dtype=torch.float64))
    (a.sum() + 2 * b.sum() + 3 * c.sum()).backward()
    before = [a.grad, b.grad, c.grad]
    assert own_graph_gradients([[a, unused, b, c]]) == 3
    assert unused.grad is None
    for p, g in zip((a, b, c), before):
        assert torch.equal(p.grad, g) and p.grad.dtype == g.dtype and p.grad.data_ptr() != g.data_ptr()


def test_gradient_groups_follow_the_optimizer_then_the_rest():
    from types import SimpleNamespace

    from megacoat.training.cuda_graph import gradient_groups

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    w0, b0, w1, b1 = model.parameters()
    zero = SimpleNamespace(optimizer=SimpleNamespace(bit16_groups=[[w1, w0], [b1]]), module=model)
    assert gradient_groups(zero) == [[w1, w0], [b1], [b0]]
    plain = SimpleNamespace(optimizer=object(), module=model)
    assert gradient_groups(plain) == [[w0, b0, w1, b1]]


@pytest.mark.gpu
def test_gpu_graphed_weight_refresh_equals_eager_refresh():
    """The trainer's refresh after each optimizer step, replayed as a CUDA graph: after every weight update (in
    place, as DeepSpeed does) the FP8 copies equal an eager refresh's bit for bit, in the same tensors."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from megacoat.coat.linear import refresh_fp8_weights
    from megacoat.coat.convert import GraphedWeightRefresh
    from tests.coat.test_blocks import _block

    block, *_ = _block("coat", dtype=torch.bfloat16, device="cuda")
    graphed = GraphedWeightRefresh(block)
    copies = [t for c, _ in block.fp8_weight_caches() for t in (c.w8, c.w8t, c.scale)]
    for step in range(5):  # warm-up, warm-up, capture, replay, replay
        with torch.no_grad():
            for p in block.parameters():
                p.mul_(1 + 0.1 * (step + 1)).add_(0.01)
        graphed()
        got = [t.clone() for t in copies]
        refresh_fp8_weights(block)
        want = [t for c, _ in block.fp8_weight_caches() for t in (c.w8, c.w8t, c.scale)]
        assert all(a is b for a, b in zip(want, copies))
        assert all(torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                               b.view(torch.uint8) if b.element_size() == 1 else b) for a, b in zip(got, want)), step
    assert graphed.graph is not None


def test_graphed_weight_refresh_is_a_no_op_without_fp8_copies():
    from megacoat.coat.convert import GraphedWeightRefresh
    from tests.coat.test_blocks import _block

    block, *_ = _block("bf16")
    refresh = GraphedWeightRefresh(block)
    for _ in range(4):
        refresh()
    assert not refresh.has_copies and refresh.graph is None and refresh.calls == 0
