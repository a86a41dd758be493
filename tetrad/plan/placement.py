"""Where each dimension of a layout lies: inside a node or across nodes.

torchrun numbers the ranks of a node consecutively, and the mesh is (pp, dp_replicate, dp_shard, cp,
tp), outermost first: the ranks of one group of a dim are `stride` apart, stride being the product of
the degrees of the dims inside it. Every group of the dim lies inside one node when its span, stride x
degree, divides the processes per node; otherwise some group crosses nodes, and its traffic goes over
the network.
"""

from __future__ import annotations

import math

from tetrad.api.resolved import MESH_DIMS, Layout

INSIDE, ACROSS = "inside a node", "across nodes"


def placement(layout: Layout, nproc_per_node: int) -> dict[str, str]:
    """Each dim of degree above 1, outermost first: INSIDE or ACROSS."""
    out = {}
    for i, dim in enumerate(MESH_DIMS):
        degree = getattr(layout, dim)
        if degree > 1:
            span = degree * math.prod(getattr(layout, d) for d in MESH_DIMS[i + 1:])
            out[dim] = INSIDE if nproc_per_node % span == 0 else ACROSS
    return out
