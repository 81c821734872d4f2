"""Dynamic convolution workspaces (paper §3.5).

A convolution has several algorithms; the faster ones need scratch memory. At every conv
step the planner asks for the fastest algorithm whose workspace fits in the memory that is
free at that step *after* every other decision of the step, and gives that memory back right
after the kernel. Speed ranks come from timing each algorithm once per shape on the GPU
(cached per process); without a GPU a fixed preference (the kernel module's own order)
stands in. A Runtime option pins the algorithms instead, which makes results bitwise
comparable across policies (algorithms differ in summation order, never in math).

Other layers' workspaces (batch-norm partial sums, the loss reduction) are fixed sizes.
"""
from __future__ import annotations

from ..kernels import bn as bn_k
from ..kernels import conv as conv_k
from ..kernels import linear as linear_k
from ..kernels import softmax as softmax_k

PHASES = ("forward", "backward_data", "backward_weight")
DEFAULT_ALGOS = {"forward": "implicit", "backward_data": "implicit", "backward_weight": "onepass"}

_RANKINGS: dict = {}   # (x_shape, w_shape, stride, padding, phase) -> [algo, ...] fastest first


def conv_geometry(layer):
    """The (x_shape, w_shape, stride, padding) a conv layer's kernels are launched with."""
    x_shape = tuple(layer.inputs[0].shape)
    w_shape = tuple(layer.params["weight"])
    return x_shape, w_shape, tuple(layer.attrs["stride"]), tuple(layer.attrs["padding"])


def fixed_workspace(layer, phase: str) -> int:
    """Workspace bytes of a non-conv layer's step (phase "forward" or "backward")."""
    if layer.op == "bn":
        return bn_k.workspace_bytes(tuple(layer.shape), phase)
    if layer.op == "softmax_loss" and phase == "forward":
        n, k = layer.inputs[0].shape
        return softmax_k.workspace_bytes(n, k)
    if layer.op == "fc":
        n = layer.shape[0]
        f = 1
        for s in layer.inputs[0].shape[1:]:
            f *= s
        return linear_k.workspace_bytes(n, f, layer.shape[1], phase)
    return 0


def ranking(geometry, phase: str) -> list:
    """Algorithms for one conv phase, fastest first (measured when timings were recorded)."""
    key = (*geometry, phase)
    if key in _RANKINGS:
        return _RANKINGS[key]
    return list(conv_k.algos(*geometry, phase))


def record_ranking(geometry, phase: str, algos_fastest_first) -> None:
    """Store a measured speed order for one conv shape and phase."""
    _RANKINGS[(*geometry, phase)] = list(algos_fastest_first)


class AlgoChooser:
    """Picks conv algorithms: dynamically, the fixed defaults, or pinned by the user.

    `pinned` is None (dynamic when `dynamic` is True, else the defaults) or a dict
    phase -> algorithm name that holds for every conv (a phase left out keeps its default).
    """

    def __init__(self, dynamic: bool, pinned=None):
        if pinned is not None:
            bad = set(pinned) - set(PHASES)
            if bad:
                raise ValueError(f"conv_algos phases must be among {PHASES}, got {sorted(bad)}")
        self.dynamic = dynamic and pinned is None
        self.fixed = {**DEFAULT_ALGOS, **(pinned or {})}

    def choose(self, layer, phases, free_bytes: int):
        """Return ({phase: algo}, workspace bytes) for a conv step running `phases`."""
        geometry = conv_geometry(layer)
        chosen, need = {}, 0
        for phase in phases:
            valid = conv_k.algos(*geometry, phase)
            if self.dynamic:
                algo = next((a for a in ranking(geometry, phase) if valid.get(a, 1 << 62) <= free_bytes),
                            DEFAULT_ALGOS[phase])
            else:
                algo = self.fixed[phase]
                if algo not in valid:
                    algo = DEFAULT_ALGOS[phase]
            chosen[phase] = algo
            need = max(need, valid[algo])
        return chosen, need
