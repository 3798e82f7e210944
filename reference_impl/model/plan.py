"""Schedule plans: one chunk's forward and backward for one microbatch as a sequence of nodes, run either
as one autograd graph (plain schedules) or node by node, so that the forward of one microbatch and the
backward of another can be merged sub-layer by sub-layer (Megatron's 1F1B overlap,
``overlap_moe_expert_parallel_comm``).

Mirrors ``megatron/core/models/common/model_chunk_schedule_plan.py`` (`TransformerModelChunkSchedulePlan`,
`TransformerLayerSchedulePlan`) and ``pipeline_parallel/utils.py::ScheduleNode``:

* nodes: the chunk's ``pre`` (embedding, or the received activation), per decoder layer and MTP depth the
  slots of `layer.SLOTS` it uses (pre_dispatch, dispatch, mlp, combine, mtp_post), and ``post`` (the loss,
  or the activation to send).  All node functions read and write one state dict per (chunk, microbatch).
* node by node (``overlap=True``): at each node's start every grad-carrying tensor of the state is replaced
  by a detached leaf; the node's backward calls ``torch.autograd.backward`` on the tensors it left in the
  state with the gradients the next node's leaves collected, which fills its own leaves' ``.grad``.  The
  math is the plain graph's, cut at node edges; tensors that feed several consumers go through
  `common.Fanout`, so gradient sums have the same order on both paths and the bits cannot differ.
* `run_combined(f, b)`: Megatron's order for a merged forward f / backward b (either may be None) - the
  b side's loss backward, then per layer pair (forward layer i with backward layer n_b - 1 - i) the
  interleaving of `TransformerLayerSchedulePlan.run`, leftover backward layers, leftover forward layers,
  then f's post and b's pre.  With ``delay_wgrad_compute`` the pre_dispatch and mlp nodes' weight
  gradients (`linear.delayed_wgrad`) run after the node's input gradients, at Megatron's points.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .layer import SLOTS
from .linear import delayed_wgrad, run_wgrad

_DELAYED_SLOTS = ("pre_dispatch", "mlp")        # the nodes with backward_dw callables in Megatron


def _grad_tensors(st: dict) -> dict:
    return {k: v for k, v in st.items() if isinstance(v, torch.Tensor) and v.requires_grad}


class ChunkPlan:
    """One chunk's nodes for one microbatch, with their state and (node by node) their saved boundaries.

    chunk: a `model.chunk.StageChunk`; x: the received activation [s, b, h] (requires grad) or None;
    mb: the `Microbatch`; dtype: activation dtype; overlap: run node by node (else one autograd graph);
    delay_wgrad: Megatron's delay_wgrad_compute (node by node only).
    """

    def __init__(self, chunk, x: Optional[torch.Tensor], mb, dtype: torch.dtype, overlap: bool,
                 delay_wgrad: bool = False):
        self.chunk, self.x, self.overlap, self.delay_wgrad = chunk, x, overlap, delay_wgrad and overlap
        pre, layers, post = chunk.nodes(mb, dtype, overlap)
        # flat node list [(name, slot, fn)]; index[(layer, slot)] -> position
        self.nodes: list = [("pre", "pre", pre)]
        self.index: dict = {}
        for i, fns in enumerate(layers):
            for slot in SLOTS:
                if slot in fns:
                    self.index[(i, slot)] = len(self.nodes)
                    self.nodes.append((f"layer{i}.{slot}", slot, fns[slot]))
        self.nodes.append(("post", "post", post))
        self.num_layers = len(layers)
        self.state: dict = {"h": x}
        self.saved: list = []              # per executed node: (leaves at its start, grad tensors at its end)
        self.next_backward = len(self.nodes) - 1
        self.wgrads: dict = {}             # node position -> stashed weight-gradient work

    # --- forward ---------------------------------------------------------------------------------------------
    def forward_node(self, j: int) -> None:
        """Run node j (nodes run in order; node by node: behind detached leaves)."""
        if j != len(self.saved):
            raise RuntimeError(f"plan node {self.nodes[j][0]} run out of order (next: {len(self.saved)})")
        st = self.state
        if self.overlap and j > 0:
            leaves = {k: v.detach().requires_grad_() for k, v in _grad_tensors(st).items()}
            st.update(leaves)
        else:
            leaves = _grad_tensors(st)
        self.nodes[j][2](st)
        self.saved.append((leaves, _grad_tensors(st) if self.overlap else None))

    def forward(self) -> None:
        """Whole forward: every node in order (node by node: through `run_combined`, Megatron's order)."""
        if self.overlap:
            run_combined(self, None, None)
            return
        for j in range(len(self.saved), len(self.nodes)):
            self.forward_node(j)

    @property
    def output(self):
        """The activation to send [s, b, h] (or [(1+D)·s, b, h]) or the `LossOutput`."""
        return self.state["out"]

    # --- backward --------------------------------------------------------------------------------------------
    def backward_node(self, j: int, grad_output: Optional[torch.Tensor] = None) -> None:
        """Backward of node j (nodes in reverse order).  The last node takes `grad_output` (the received
        gradient; None on the loss stage, whose objective seeds itself)."""
        if j != self.next_backward:
            raise RuntimeError(f"plan node {self.nodes[j][0]} backward out of order (next: {self.next_backward})")
        self.next_backward -= 1
        leaves, outs = self.saved[j]
        if j == len(self.nodes) - 1:
            roots, grads = self._seed(grad_output)
        else:
            after = self.saved[j + 1][0]
            pairs = [(t, after[k].grad) for k, t in outs.items() if k in after and after[k].grad is not None]
            roots, grads = [t for t, _ in pairs], [g for _, g in pairs]
        self.saved[j + 1:] = [None] * (len(self.saved) - j - 1)     # free the later boundaries
        if not roots:
            return
        if self.delay_wgrad and self.nodes[j][1] in _DELAYED_SLOTS:
            with delayed_wgrad(self.wgrads.setdefault(j, [])):
                torch.autograd.backward(roots, grads)
        else:
            torch.autograd.backward(roots, grads)

    def backward_dw(self, j: Optional[int]) -> None:
        """The delayed weight gradients of node j (Megatron's ``backward_dw``); nothing if none."""
        if j is not None and j in self.wgrads:
            run_wgrad(self.wgrads.pop(j))

    def backward(self, grad_output: Optional[torch.Tensor] = None) -> None:
        """Whole backward: one autograd call (plain), or every node in reverse with its weight gradients."""
        if self.overlap:
            run_combined(None, self, grad_output)
        else:
            torch.autograd.backward(*self._seed(grad_output))

    def _seed(self, grad_output: Optional[torch.Tensor]) -> tuple[list, list]:
        """Backward roots and gradients of the chunk's output: the loss objective (seeds itself) on the loss
        stage, else the sent activation with its received gradient."""
        out = self.state["out"]
        return ([out.objective], [None]) if grad_output is None else ([out], [grad_output])

    @property
    def input_grad(self) -> Optional[torch.Tensor]:
        """Gradient of the received activation (to send back), once backward is done."""
        return None if self.x is None else self.x.grad

    def layer_node(self, i: Optional[int], slot: str) -> Optional[int]:
        """Position of layer i's `slot` node, or None when that layer has no such node (dense layers have
        no dispatch / combine, decoder layers no mtp_post) or i is None."""
        return None if i is None else self.index.get((i, slot))


def _fwd(plan: Optional[ChunkPlan], i: Optional[int], slot: str) -> None:
    j = plan.layer_node(i, slot) if plan is not None else None
    if j is not None:
        plan.forward_node(j)


def _bwd(plan: Optional[ChunkPlan], i: Optional[int], slot: str) -> None:
    j = plan.layer_node(i, slot) if plan is not None else None
    if j is not None:
        plan.backward_node(j)


def _dw(plan: Optional[ChunkPlan], i: Optional[int], slot: str) -> None:
    if plan is not None:
        plan.backward_dw(plan.layer_node(i, slot))


def run_layer(f: Optional[ChunkPlan], fi: Optional[int], b: Optional[ChunkPlan], bi: Optional[int]) -> None:
    """Forward of layer fi of plan f merged with backward of layer bi of plan b, in the order of Megatron's
    ``TransformerLayerSchedulePlan.run``: each communication node of one side sits between compute nodes of
    the other."""
    steps: list[tuple[Callable, Optional[ChunkPlan], Optional[int], str]] = [
        (_bwd, b, bi, "mtp_post"), (_bwd, b, bi, "combine"), (_fwd, f, fi, "pre_dispatch"), (_bwd, b, bi, "mlp"),
        (_fwd, f, fi, "dispatch"), (_dw, b, bi, "mlp"), (_bwd, b, bi, "dispatch"), (_fwd, f, fi, "mlp"),
        (_fwd, f, fi, "combine"), (_bwd, b, bi, "pre_dispatch"), (_fwd, f, fi, "mtp_post"),
        (_dw, b, bi, "pre_dispatch")]
    for op, plan, i, slot in steps:
        if i is not None:
            op(plan, i, slot)


def run_combined(f: Optional[ChunkPlan], b: Optional[ChunkPlan], grad_output: Optional[torch.Tensor]) -> None:
    """Forward of plan f and backward of plan b (either may be None) merged as Megatron's
    ``TransformerModelChunkSchedulePlan.run``; `grad_output`: b's received output gradient (None on the
    loss stage).  Both plans must be node by node (``overlap=True``)."""
    for p in (f, b):
        if p is not None and not p.overlap:
            raise RuntimeError("run_combined needs node-by-node plans (overlap=True)")
    if f is not None:
        f.forward_node(0)                                  # pre: embedding / received activation
    if b is not None:
        b.backward_node(len(b.nodes) - 1, grad_output)     # post: loss (and MTP loss) or the sent activation
    nf = f.num_layers if f is not None else 0
    nb = b.num_layers if b is not None else 0
    # pairs (f k, b nb-1-k); then the b-only layers, then the f-only layers (Megatron's leftover order)
    for k in range(min(nf, nb)):
        run_layer(f, k, b, nb - 1 - k)
    for k in range(min(nf, nb), nb):
        run_layer(None, None, b, nb - 1 - k)
    for k in range(min(nf, nb), nf):
        run_layer(f, k, None, None)
    if f is not None:
        f.forward_node(len(f.nodes) - 1)
    if b is not None:
        b.backward_node(0)
