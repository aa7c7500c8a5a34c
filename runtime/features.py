"""Kept feature nodes: what a backend must hand back next to the output for the out-of-distribution gate.

A backend built with keep=(node names) returns those nodes' outputs from run_with_features(x) as
{name: float32 [N, *node.out_shape]}. The CPU and CUDA backends fuse layers: their build_layers
records, per fused layer, the last model node whose value its output is (`LayerOutputs`), and
stops fusing into a layer whose output is kept, so a kept node's value is never fused away; their
plans copy each kept value into a buffer of its own right after the layer that computes it (a
later in-place step cannot overwrite it).
"""

from __future__ import annotations

from lnn.formats.errors import LnnError
from lnn.formats.model import Model


def check_kept(model: Model, keep) -> frozenset:
    """The kept names as a set, each a node of the model (a programming error otherwise)."""
    names = {node.name for node in model.nodes}
    unknown = [name for name in keep if name not in names]
    if unknown:
        raise LnnError(f"model {model.name!r} has no node {unknown[0]!r} to keep")
    if keep and model.nodes[0].op == "dropout" and model.nodes[0].name in keep:
        raise LnnError(f"node {model.nodes[0].name!r} is the input itself (a first dropout); keep a later node")
    return frozenset(keep)


class LayerOutputs:
    """While a backend fuses nodes into layers: which model nodes each layer's output is the value of."""

    def __init__(self, keep: frozenset):
        self.keep = keep
        self.values_of = []          # per layer: names of the nodes whose value its output is
        self.members = []            # per layer: names of every node it computes, in model order

    def added(self, node) -> None:
        self.values_of.append({node.name})
        self.members.append([node.name])

    def fused(self, node) -> None:
        """`node` joined the last layer (a folded batch norm, a fused activation or pool): the layer's
        output is now that node's value."""
        self.values_of[-1] = {node.name}
        self.members[-1].append(node.name)

    def skipped(self, node) -> None:
        """`node` is the identity at inference (dropout): its value is the last layer's output."""
        if self.values_of:
            self.values_of[-1].add(node.name)
            self.members[-1].append(node.name)

    def may_fuse(self) -> bool:
        """False when the last layer's output is kept: fusing more into it would lose that value."""
        return not self.values_of or not self.values_of[-1] & self.keep

    def kept_after(self) -> dict:
        """{layer index: [kept node names]} for the plan."""
        return {index: sorted(names & self.keep) for index, names in enumerate(self.values_of) if names & self.keep}
