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

from ..kernels import INTERPRET
from ..kernels import conv as conv_k
from ..ops import spec

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
    return spec(layer).workspace(layer, phase)


def ranking(geometry, phase: str) -> list:
    """Algorithms for one conv phase, fastest first (measured when timings were recorded)."""
    key = (*geometry, phase)
    if key in _RANKINGS:
        return _RANKINGS[key]
    valid = conv_k.algos(*geometry, phase)
    if INTERPRET:   # on the CPU interpreter the extra passes of workspace algorithms cost most
        return sorted(valid, key=valid.get)
    return list(valid)


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


def measure_rankings(net, device, cap_bytes=None, rep_ms: int = 20) -> dict:
    """Time every valid algorithm of every conv shape in `net` once on the GPU; cache the order.

    Runs before the training pool exists, in one scratch Arena sized for the largest conv
    (released afterwards). Shapes already measured in this process are skipped. Returns
    {(geometry..., phase): {algo: milliseconds}} for the shapes timed now.
    """
    import torch
    import triton

    from ..pool.arena import Arena

    geometries = []
    for layer in net.layers:
        if layer.op == "conv":
            g = conv_geometry(layer)
            if g not in geometries and any((*g, ph) not in _RANKINGS for ph in PHASES):
                geometries.append(g)
    if not geometries:
        return {}

    def numel(shape):
        out = 1
        for s in shape:
            out *= s
        return out

    def needs(g):
        x, w, s, p = g
        y = conv_k.out_shape(x, w, s, p)
        ws = max(max(conv_k.algos(*g, ph).values()) for ph in PHASES)
        return x, w, y, ws

    total = 0
    for g in geometries:
        x, w, y, ws = needs(g)
        if cap_bytes is not None:
            ws = min(ws, cap_bytes)
        total = max(total, 4 * (2 * numel(x) + 2 * numel(w) + 2 * numel(y) + w[0]) + ws + 8 * 1024)
    arena = Arena(total, device)
    timings = {}
    gen = torch.Generator(device=device).manual_seed(0)
    for g in geometries:
        x_shape, w_shape, y_shape, _ = needs(g)
        blocks = []

        def buf(shape, dtype=torch.float32):
            block = arena.alloc(max(numel(shape) * 4, 1))
            blocks.append(block)
            t = arena.view(block, shape, dtype)
            return t

        x, dx = buf(x_shape), buf(x_shape)
        w, dw = buf(w_shape), buf(w_shape)
        y, dy = buf(y_shape), buf(y_shape)
        db = buf((w_shape[0],))
        for t in (x, w, dy):
            t.copy_(torch.randn(t.shape, generator=gen, device=device))
        stride, padding = g[2], g[3]
        for phase in PHASES:
            result = {}
            for algo, size in conv_k.algos(*g, phase).items():
                if cap_bytes is not None and size > cap_bytes:
                    continue
                ws = None
                if size:
                    if size > arena.allocator.largest_free:
                        continue
                    ws_block = arena.alloc(size)
                    ws = arena.view(ws_block, (size,), torch.uint8)
                if phase == "forward":
                    fn = lambda: conv_k.forward(x, w, None, y, stride=stride, padding=padding,  # noqa: E731
                                                algo=algo, workspace=ws)
                elif phase == "backward_data":
                    fn = lambda: conv_k.backward_data(dy, w, dx, stride=stride, padding=padding,  # noqa: E731
                                                      algo=algo, workspace=ws)
                else:
                    fn = lambda: conv_k.backward_weight(x, dy, dw, db, stride=stride,  # noqa: E731
                                                        padding=padding, algo=algo, workspace=ws)
                result[algo] = triton.testing.do_bench(fn, warmup=5, rep=rep_ms, return_mode="median")
                if size:
                    arena.free(ws_block)
            timings[(*g, phase)] = result
            record_ranking(g, phase, sorted(result, key=result.get))
        for block in blocks:
            arena.free(block)
    del arena
    torch.cuda.empty_cache()
    return timings
