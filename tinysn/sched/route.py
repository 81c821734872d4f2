"""Execution route (paper, Alg. 1): the order in which layers run forward and backward.

RouteConstruct(layer) walks the graph depth-first from the data layer. Each layer carries a
join counter; a visit increments it, and the layer runs only when the counter reaches its
number of inputs, i.e. once every producer has run. Then its consumers are explored in
creation order. So a branch is followed as deep as it goes, and a join waits for its last
branch. The backward route is the forward route reversed.

The walk here is iterative (an explicit stack) so nets of tens of thousands of layers do not
hit Python's recursion limit; it visits layers in exactly the recursive algorithm's order:
popping a consumer from the stack corresponds to the recursive call, and a layer's
consumers are pushed in reverse so the first one is explored first.
"""
from __future__ import annotations

from ..ops import spec


def forward_order(net) -> list:
    """Every layer once, each after all of its inputs (Alg. 1)."""
    if not net.layers:
        raise ValueError("the net is empty (call data() first)")
    start = net.layers[0]
    if not spec(start).is_data:
        raise ValueError("the net's first layer must be its data layer")
    counter = {}
    route = []
    stack = [start]
    while stack:
        layer = stack.pop()
        if layer.inputs:
            seen = counter.get(layer.index, 0) + 1
            counter[layer.index] = seen
            if seen < len(layer.inputs):
                continue            # a join: wait for the remaining producers
        route.append(layer)
        stack.extend(reversed(layer.consumers))
    if len(route) != len(net.layers):   # only possible with a hand-edited graph
        missing = {layer.name for layer in net.layers} - {layer.name for layer in route}
        raise ValueError(f"layers not reachable from the data layer: {sorted(missing)[:5]}")
    return route
