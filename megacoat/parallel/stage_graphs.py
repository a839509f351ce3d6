"""CUDA graphs for a pipeline stage's blocks (--enable-cuda-graph with --pipeline-model-parallel-size > 1).

A 1F1B stage runs up to `slots` forwards before their backwards (pp - stage of them), so one graph per block cannot
serve it: the second forward would overwrite the first's saved activations. Each block gets one forward and one
backward graph per micro-batch slot (micro-batch i takes slot i mod slots, as DeepSpeed's pipe buffers do), as
TransformerEngine's make_graphed_callables does for a pipeline schedule. The sends and receives stay outside.

Memory: each slot has its own graph pool, shared by the stage's blocks. A graph's static input and output stay
allocated for the run; its temporaries, and a forward's saved tensors once its backward is captured, go back to
the pool, where a graph captured later may place its own. That is safe when, within a slot, graphs are captured in
the order they replay (the slot's blocks' forwards in order, then their backwards in reverse): memory freed at a
capture is dead at that point of every replay too. So capture is lazy, inside the real schedule: a block's graph
for a slot is captured at its first call after `warmup` eager calls (compiled code warm and its variants built,
delayed-scaling histories past their bootstrap); capture records without running, and one replay follows.

Exact: a replay runs the kernels the eager call ran, on the same addresses (weights and their FP8 copies are
updated in place, amax histories too). Parameter gradients are copied out of the pool on a micro-batch's first
accumulation (autograd would otherwise adopt pool memory the next replay overwrites), then added in place.
"""
from __future__ import annotations

import torch
from torch import nn


class SlotBusyError(RuntimeError):
    """A forward found its slot still holding an earlier micro-batch's activations: more forwards in flight than
    the stage has slots (a schedule other than DeepSpeed's 1F1B)."""


class StageGraphs:
    """The slots and their graph pools for one pipeline stage; shared by the stage's GraphedBlocks."""

    def __init__(self, warmup: int = 3):
        self.warmup = warmup
        self.slots = 0  # set by set_slots once the stage knows its place in the pipeline
        self.pools: list = []

    def set_slots(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"a pipeline stage needs at least one micro-batch slot, got {slots}")
        self.slots = slots
        self.pools = [torch.cuda.graph_pool_handle() for _ in range(slots)]


class _SlotEntry:
    """One block's graphs for one slot: static input/output, forward and backward graphs, static gradients."""

    def __init__(self, pool):
        self.pool = pool
        self.busy = False
        self.external_input = True  # the input comes from outside the stage's graphs
        self.x = self.y = self.gy = None
        self.grads: tuple = ()
        self.aliases: list[torch.Tensor] = []
        self.fwd: torch.cuda.CUDAGraph | None = None
        self.bwd: torch.cuda.CUDAGraph | None = None


def _graph(graph: torch.cuda.CUDAGraph, pool):
    return torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local")


class GraphedBlock(nn.Module):
    """`block(x, *extra(x))` run through per-slot CUDA graphs once warm; eager before that and without gradients
    (evaluation)."""

    def __init__(self, block: nn.Module, extra, graphs: StageGraphs):
        super().__init__()
        self._block = (block,)  # in a tuple: not a submodule, the block stays its owner's
        self._extra = extra
        named = [(n, p) for n, p in block.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self.graphs = graphs
        self.calls = 0  # forwards with gradients so far
        self._entries: list[_SlotEntry] = []

    def _call(self, x: torch.Tensor, params: list[torch.Tensor] | None = None) -> torch.Tensor:
        block = self._block[0]
        if params is None:
            return block(x, *self._extra(x))
        return torch.func.functional_call(block, dict(zip(self._names, params)), (x, *self._extra(x)), strict=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or not x.requires_grad:
            return self._call(x)
        self.calls += 1
        if self.calls <= self.graphs.warmup:
            return self._call(x)
        if not self._entries:
            self._entries = [_SlotEntry(pool) for pool in self.graphs.pools]
        entry = self._entries[(self.calls - self.graphs.warmup - 1) % self.graphs.slots]
        if entry.x is not None and x.shape != entry.x.shape:
            raise ValueError(f"--enable-cuda-graph under pipeline parallelism: a stage's graphs take activations of "
                             f"one shape, captured {tuple(entry.x.shape)}, got {tuple(x.shape)}")
        if entry.busy:
            raise SlotBusyError(f"--enable-cuda-graph under pipeline parallelism: a stage holds {self.graphs.slots} "
                                "micro-batches in flight (DeepSpeed's 1F1B schedule); this schedule ran more")
        return _Replay.apply(self, entry, x, *self._params)

    # --- capture (lazy, see the module's docstring) and replay --------------------------------------------------
    # The graphs read the parameters through aliases made for the capture (same memory, new leaves): autograd
    # ties a parameter's gradient to the stream its accumulator was made on, and the parameters' were made on the
    # training stream, which a captured backward may not wait on. _Replay hands the gradients to the parameters.
    def _forward_replay(self, entry: _SlotEntry, x: torch.Tensor) -> torch.Tensor:
        if entry.fwd is None:
            entry.external_input = not getattr(x, "_megacoat_static", False)
            entry.x = _static_like(x)
            self._dry_run(entry.x)
            entry.aliases = [p.detach().requires_grad_() for p in self._params]
            entry.fwd = torch.cuda.CUDAGraph()
            with torch.enable_grad(), _graph(entry.fwd, entry.pool):
                entry.y = self._call(entry.x, entry.aliases)
        if x.data_ptr() != entry.x.data_ptr():
            entry.x.data.copy_(x)  # .data: a block that saves its input for backward must not see a new version
        entry.fwd.replay()
        entry.busy = True
        return entry.y.detach()

    def _backward_replay(self, entry: _SlotEntry, gy: torch.Tensor) -> tuple:
        if entry.bwd is None:
            entry.gy = _static_like(gy, requires_grad=False)
            entry.bwd = torch.cuda.CUDAGraph()
            with _graph(entry.bwd, entry.pool):
                entry.grads = torch.autograd.grad(entry.y, (entry.x, *entry.aliases), grad_outputs=entry.gy,
                                                  allow_unused=True)
        if gy.data_ptr() != entry.gy.data_ptr():
            entry.gy.copy_(gy)
        entry.bwd.replay()
        entry.busy = False
        return entry.grads

    def _dry_run(self, x: torch.Tensor) -> None:
        """One forward and backward through the aliases outside a capture, its state changes undone: whatever the
        compiler builds for that call (a guard it had not seen) is built here, where a capture could not."""
        block = self._block[0]
        saved = [b.detach().clone() for b in block.buffers()]
        with torch.enable_grad():
            dry_x = x.detach().requires_grad_()
            y = self._call(dry_x, [p.detach().requires_grad_() for p in self._params])
            torch.autograd.grad(y, dry_x, grad_outputs=torch.full_like(y, 1e-3))
        with torch.no_grad():
            for b, s in zip(block.buffers(), saved):
                b.copy_(s)


def _static_like(t: torch.Tensor, requires_grad: bool = True) -> torch.Tensor:
    """The graph's input: the tensor itself where it already is another graph's static output (a block's output
    feeding the next block of the same slot, no copy at replay), else a copy."""
    static = t.detach() if getattr(t, "_megacoat_static", False) else t.detach().clone()
    return _marked(static).requires_grad_(requires_grad)


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, block: GraphedBlock, entry: _SlotEntry, x: torch.Tensor, *params):
        ctx.block, ctx.entry = block, entry
        return _marked(block._forward_replay(entry, x))

    @staticmethod
    def backward(ctx, gy):
        block, entry = ctx.block, ctx.entry
        gx, *gparams = block._backward_replay(entry, gy)
        if gx is not None:
            # the stage's first block: its input's gradient leaves the graphs (DeepSpeed sends it to the previous
            # stage on its own stream), so it gets memory no later replay writes; inside the stage it is the next
            # backward's input, read in place
            gx = gx.detach().clone() if entry.external_input else _marked(gx.detach())
        # a first accumulation adopts the tensor it is given: hand it a copy, never pool memory
        out = [None if g is None else (g.detach().clone() if p.grad is None else g.detach())
               for p, g in zip(block._params, gparams)]
        return (None, None, gx, *out)


def _marked(t: torch.Tensor) -> torch.Tensor:
    """t, marked as a graph's static memory (read in place by the next graph of the slot)."""
    t._megacoat_static = True
    return t
