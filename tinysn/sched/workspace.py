"""Dynamic convolution workspaces (paper §3.5).

A convolution has several algorithms; the faster ones need scratch memory. At every conv
step the planner asks for the fastest algorithm whose workspace fits in the memory that is
free at that step *after* every other decision of the step, and gives that memory back right
after the kernel. "Fastest" comes from `rankings`, an explicit argument of the plan:
{(x_shape, w_shape, stride, padding, phase): [algo, ...] fastest first}, measured on the GPU
by `measure_rankings` inside the (still empty) training pool and kept on disk per GPU, triton
and torch version and version of the conv kernels. A conv with a bias computes the bias
gradient in its weight-gradient pass, inside the GEMM or the split-K sum ("onepass",
"splitk") or in launches of its own ("nhwc", "tma"), so that pass is ranked apart, under
the phase BIAS_PHASE, timed with the bias gradient; a conv without one is timed without. A
shape the rankings leave out takes the fixed preference order: least workspace first. A
Runtime option pins the algorithms instead, which makes results bitwise comparable across
policies (algorithms differ in summation order, never in math).

Other layers' workspaces (batch-norm partial sums, the loss reduction) are fixed sizes.
"""
from __future__ import annotations

import json
import os
import sys
import time

from .. import cache
from ..kernels import conv as conv_k
from ..ops import spec

PHASES = ("forward", "backward_data", "backward_weight")
# the rankings key's phase of the weight gradient of a conv with a bias (`ranked_phase`)
BIAS_PHASE = "backward_weight+db"
DEFAULT_ALGOS = {"forward": "implicit", "backward_data": "implicit", "backward_weight": "onepass"}


def conv_geometry(layer):
    """The (x_shape, w_shape, stride, padding) a conv layer's kernels are launched with."""
    x_shape = tuple(layer.inputs[0].shape)
    w_shape = tuple(layer.params["weight"])
    return x_shape, w_shape, tuple(layer.attrs["stride"]), tuple(layer.attrs["padding"])


def ranked_phase(layer, phase: str) -> str:
    """The phase the rankings key `layer`'s `phase` under: BIAS_PHASE for the weight
    gradient of a conv with a bias (timed summing the bias gradient, as its step does),
    else `phase` (a weight gradient timed without one)."""
    return BIAS_PHASE if phase == "backward_weight" and "bias" in layer.params else phase


def kernel_phase(ranked: str) -> str:
    """The conv phase a rankings key's phase (`ranked_phase`) launches."""
    return "backward_weight" if ranked == BIAS_PHASE else ranked


def with_bias_twins(times: dict) -> dict:
    """Conv times (or rankings) of keys version 1 (`RANKINGS_VERSION`) keyed as today's: that
    version timed every weight gradient with a bias gradient, so each of its
    weight-gradient entries also serves under BIAS_PHASE (bench/predict.py plans such runs
    again as they ran)."""
    twins = {(*key[:-1], BIAS_PHASE): v for key, v in times.items()
             if key[-1] == "backward_weight"}
    return {**times, **twins}


def net_keys(net) -> list:
    """The distinct rankings keys (*geometry, ranked phase) of `net`'s convs, in layer order."""
    return list(dict.fromkeys((*conv_geometry(layer), ranked_phase(layer, phase))
                              for layer in net.layers if spec(layer).has_algorithms
                              for phase in PHASES))


def fixed_workspace(layer, phase: str) -> int:
    """Workspace bytes of a non-conv layer's step (phase "forward", "backward" or
    "recompute": a rebuild of its output)."""
    return spec(layer).workspace(layer, phase)


def rebuild_workspace(layer, conv_algos) -> tuple:
    """(algos, workspace bytes) of recomputing a layer's forward pass. A conv repeats the
    algorithm its forward pass ran (`conv_algos`: layer name -> {phase: algo}, as the plan
    records them), so the rebuilt output has the same summation order and the same bits;
    other layers take no algorithm and the fixed workspace of a rebuild (batch norm's
    none: it normalises with the statistics its forward pass saved)."""
    if not spec(layer).has_algorithms:
        return None, fixed_workspace(layer, "recompute")
    algo = conv_algos[layer.name]["forward"]
    return {"forward": algo}, conv_k.algos(*conv_geometry(layer), "forward")[algo]


def ranking(geometry, phase: str, rankings=None) -> list:
    """Algorithms for one conv phase (a rankings key's: `ranked_phase`), fastest first: from
    `rankings` when it has this shape, else the fixed preference order (least workspace
    first, ties in the kernel module's order)."""
    measured = (rankings or {}).get((*geometry, phase))
    if measured is not None:
        return list(measured)
    valid = conv_k.algos(*geometry, kernel_phase(phase))
    return sorted(valid, key=valid.get)


class AlgoChooser:
    """Picks conv algorithms: dynamically, the fixed defaults, or pinned by the user.

    `pinned` is None (dynamic when `dynamic` is True, else the defaults) or a dict
    phase -> algorithm name that holds for every conv (a phase left out keeps its default).
    `rankings` orders the algorithms of the dynamic choice (see `ranking`).
    """

    def __init__(self, dynamic: bool, pinned=None, rankings=None):
        if pinned is not None:
            bad = set(pinned) - set(PHASES)
            if bad:
                raise ValueError(f"conv_algos phases must be among {PHASES}, got {sorted(bad)}")
        self.dynamic = dynamic and pinned is None
        self.fixed = {**DEFAULT_ALGOS, **(pinned or {})}
        self.rankings = rankings

    def choose(self, layer, phases, free_bytes: int):
        """Return ({phase: algo}, workspace bytes) for a conv step running `phases`."""
        geometry = conv_geometry(layer)
        chosen, need = {}, 0
        for phase in phases:
            valid = conv_k.algos(*geometry, phase)
            if self.dynamic:
                order = ranking(geometry, ranked_phase(layer, phase), self.rankings)
                algo = next((a for a in order if valid.get(a, 1 << 62) <= free_bytes),
                            DEFAULT_ALGOS[phase])
            else:
                algo = self.fixed[phase]
                if algo not in valid:
                    algo = DEFAULT_ALGOS[phase]
            chosen[phase] = algo
            need = max(need, valid[algo])
        return chosen, need


def rankings_path(device, kind: str = "conv-rankings"):
    """The file that keeps conv rankings (`kind` "conv-times": the times they come from)
    measured on `device`'s GPU model with this triton, torch and TINYSN_AUTOTUNE setting
    and these conv kernels (`kernels_fingerprint`; measurements of other setups are not
    mixed in), timed by today's timer (kernels/_common.TIMER_VERSION) as today's keys mean
    (`RANKINGS_VERSION`)."""
    import torch
    import triton

    from ..kernels._common import TIMER_VERSION, TUNE

    gpu = "".join(c if c.isalnum() else "-" for c in torch.cuda.get_device_name(device))
    name = (f"{gpu}-triton{triton.__version__}-torch{torch.__version__}-autotune{int(TUNE)}"
            f"-timer{TIMER_VERSION}-keys{RANKINGS_VERSION}-kernels{kernels_fingerprint()}.json")
    return cache.cache_dir() / kind / name


# what a rankings key means: 2 since a conv with a bias has its weight gradient ranked apart
# (BIAS_PHASE); files of version 1 timed every weight gradient with a bias gradient
RANKINGS_VERSION = 2

# the sources whose change can change a ranking: the conv kernels, their tile lists and the
# algorithms offered per shape (kernels/conv.py), and how kernels are tuned and launched
_KERNEL_SOURCES = [conv_k.__file__, os.path.join(os.path.dirname(conv_k.__file__), "_common.py")]


def kernels_fingerprint() -> str:
    """A short hash of the conv kernels' sources (`_KERNEL_SOURCES`): rankings timed on
    other kernels (an older tinysn's, or one with a tile list edited) are not reused, as a
    plan that trusted them would pick algorithms by times those kernels no longer take."""
    import hashlib

    digest = hashlib.sha256()
    for path in _KERNEL_SOURCES:
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:12]


def key_text(key) -> str:
    """A rankings key (x_shape, w_shape, stride, padding, phase) as the text JSON files use."""
    return json.dumps([list(key[0]), list(key[1]), list(key[2]), list(key[3]), key[4]])


def key_from_text(text: str) -> tuple:
    """The rankings key `key_text` wrote."""
    x, w, stride, padding, phase = json.loads(text)
    return tuple(x), tuple(w), tuple(stride), tuple(padding), phase


def load_rankings(path) -> dict:
    """Rankings (or conv times) stored at `path` ({} when there is no file)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {key_from_text(k): v for k, v in json.load(f).items()}


def save_rankings(path, rankings: dict) -> None:
    """Merge `rankings` (or conv times) into the file at `path` (written whole, then renamed
    into place)."""
    merged = {**load_rankings(path), **rankings}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({key_text(k): v for k, v in sorted(merged.items(), key=str)}, f, indent=0)
    os.replace(tmp, path)


def cached_rankings(net, device, kind: str = "conv-rankings"):
    """The rankings of every conv shape of `net` from the disk cache (`kind` "conv-times":
    each algorithm's measured seconds per image), or None when any is missing from either
    file (then `measure_rankings` must time them: the two are kept together)."""
    wanted = net_keys(net)
    tables = {k: load_rankings(rankings_path(device, k)) for k in ("conv-rankings", "conv-times")}
    if any(key not in table for table in tables.values() for key in wanted):
        return None
    return {key: tables[kind][key] for key in wanted}


# (rankings file, key) -> the ranking this process planned with first: kept for the
# process, so that two Runtimes of one process choose alike even when another process
# rewrites the file between them (it times a shape too, and its order differs by noise)
_KEPT = {}


def measure_rankings(net, scratch, rep_ms: int = 8, progress: bool = True) -> dict:
    """Rankings of every conv shape of `net`: from the disk cache, the rest timed on the GPU.

    `scratch` is a uint8 CUDA tensor whose bytes are free (the Runtime passes its empty
    device pool), so timing allocates nothing outside the memory cap. Each shape is timed at
    its full batch when its buffers and largest workspace fit in `scratch`, else at the
    largest halved batch that fits (the order is what counts). New rankings are added to the
    cache (`rankings_path`), and the times they come from, in seconds per image, beside
    them (kind "conv-times": the step-time model's conv times, `cached_rankings`); a shape
    missing from either is timed again. Every algorithm's kernels are compiled first, in
    parallel (`compiling_in_parallel`), then timed one by one. A notice and progress bars go
    to stderr. A shape this process has ranked before keeps that ranking (`_KEPT`).
    """
    path, times_path = rankings_path(scratch.device), rankings_path(scratch.device, "conv-times")
    stored, times = load_rankings(path), load_rankings(times_path)
    keys = net_keys(net)
    todo = _by_geometry(k for k in keys              # rankings kept without their times
                        if k not in stored or k not in times)
    if todo:
        print(f"tinysn: timing conv algorithms for {len(todo)} conv shapes, once per GPU model "
              f"(kept in {path})", file=sys.stderr, flush=True)
        started = time.perf_counter()
        _compile_all(todo, scratch, progress)
        compiled = time.perf_counter()
        measured, seconds = _time_all(todo, scratch, rep_ms, progress)
        print(f"tinysn: conv kernels compiled in {compiled - started:.1f} s, algorithms timed "
              f"in {time.perf_counter() - compiled:.1f} s", file=sys.stderr, flush=True)
        save_rankings(path, measured)
        save_rankings(times_path, seconds)
        stored.update(measured)
    return {key: _KEPT.setdefault((str(path), key), stored[key]) for key in keys
            if key in stored}


def _by_geometry(keys) -> dict:
    """{geometry: [ranked phases]} of rankings keys, in their order."""
    out = {}
    for *geometry, phase in keys:
        out.setdefault(tuple(geometry), []).append(phase)
    return out


def _compile_all(todo, scratch, progress) -> None:
    """Compile every algorithm's kernels (every autotuning config) for `todo` ({geometry:
    [ranked phases]}) at once, on a thread pool: cold, compilation is most of the ranking's
    time."""
    from tqdm import tqdm

    from ..kernels._common import compiling_in_parallel

    with compiling_in_parallel():
        for g, phases in tqdm(todo.items(), desc="compiling conv kernels", unit="shape",
                              file=sys.stderr, disable=not progress):
            _time_geometry(g, phases, scratch, 0, compile_only=True)


def _time_all(todo, scratch, rep_ms, progress) -> tuple:
    """({(*geometry, phase): algorithms fastest first}, {(*geometry, phase): {algorithm:
    seconds per image}}) for `todo` ({geometry: [ranked phases]}), timed one by one (at the
    batch each fits)."""
    from tqdm import tqdm

    seconds = {}
    for g, phases in tqdm(todo.items(), desc="conv rankings", unit="shape", file=sys.stderr,
                          disable=not progress):
        timed, batch = _time_geometry(g, phases, scratch, rep_ms)
        for phase, times in timed.items():
            seconds[(*g, phase)] = {algo: ms / 1e3 / batch for algo, ms in times.items()}
    return rankings_of(seconds), seconds


def rankings_of(times: dict) -> dict:
    """Rankings ({(*geometry, phase): algorithms fastest first}) from measured times
    ({(*geometry, phase): {algorithm: seconds}}, the "conv-times" a run records): a plan
    made again from a run's recorded times chooses the algorithms the run chose."""
    return {key: sorted(algos, key=algos.get) for key, algos in times.items()}


def _numel(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _buffer_shapes(geometry):
    """Shapes of the tensors one conv geometry is timed with: x, dx, w, dw, y, dy, db."""
    x, w, s, p = geometry
    y = conv_k.out_shape(x, w, s, p)
    return {"x": x, "dx": x, "w": w, "dw": w, "y": y, "dy": y, "db": (w[0],)}


def timing_geometry(geometry, capacity: int, block_bytes: int = 1024):
    """`geometry` at the largest batch (full, or halved until it fits, at least 1) whose timing
    buffers and largest workspace fit together in `capacity` bytes of blocks."""
    def need(g):
        blocks = [-(-4 * _numel(sh) // block_bytes) * block_bytes for sh in _buffer_shapes(g).values()]
        ws = max(max(conv_k.algos(*g, ph).values()) for ph in PHASES)
        return sum(blocks) + -(-ws // block_bytes) * block_bytes

    x, w, s, p = geometry
    n = x[0]
    while n > 1 and need(((n, *x[1:]), w, s, p)) > capacity:
        n //= 2
    return (n, *x[1:]), w, s, p


def _time_geometry(geometry, phases, scratch, rep_ms, compile_only=False) -> tuple:
    """({phase: {algo: ms}}, the batch timed) for one conv geometry's ranked `phases`
    (`ranked_phase`: BIAS_PHASE's weight gradient sums a bias gradient, "backward_weight"'s
    none), timed on a sub-arena over `scratch` (at its full batch or the largest halved one
    that fits there); with
    `compile_only` each algorithm is launched once inside `compiling_in_parallel` (its
    kernels compile on the thread pool) and nothing is timed."""
    import torch

    from ..kernels._common import bench_ms
    from ..pool.arena import Arena

    arena = Arena(scratch.numel(), scratch.device, buffer=scratch)
    g = timing_geometry(geometry, arena.capacity, arena.block_bytes)
    gen = torch.Generator(device=scratch.device).manual_seed(0)
    t = {}
    for name, shape in _buffer_shapes(g).items():
        t[name] = arena.view(arena.alloc(max(4 * _numel(shape), 1)), shape)
        if name in ("x", "w", "dy") and not compile_only:
            t[name].normal_(generator=gen)
    stride, padding = g[2], g[3]
    launch = {
        "forward": lambda algo, ws: conv_k.forward(
            t["x"], t["w"], None, t["y"], stride=stride, padding=padding, algo=algo, workspace=ws),
        "backward_data": lambda algo, ws: conv_k.backward_data(
            t["dy"], t["w"], t["dx"], stride=stride, padding=padding, algo=algo, workspace=ws),
        "backward_weight": lambda algo, ws: conv_k.backward_weight(
            t["x"], t["dy"], t["dw"], None, stride=stride, padding=padding, algo=algo,
            workspace=ws),
        BIAS_PHASE: lambda algo, ws: conv_k.backward_weight(
            t["x"], t["dy"], t["dw"], t["db"], stride=stride, padding=padding, algo=algo,
            workspace=ws),
    }
    times = {}
    for phase in phases:
        times[phase] = {}
        for algo, size in conv_k.algos(*g, kernel_phase(phase)).items():
            if size > arena.allocator.largest_free:
                continue
            block = arena.alloc(size) if size else None
            ws = arena.view(block, (size,), torch.uint8) if size else None
            run = lambda: launch[phase](algo, ws)  # noqa: E731
            times[phase][algo] = run() if compile_only else bench_ms(run, rep_ms=rep_ms)
            if block is not None:
                arena.free(block)
    return times, g[0][0]
