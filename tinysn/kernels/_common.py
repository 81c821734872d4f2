"""What every kernel module shares: interpreter detection and its tile size, dot precision,
autotuning, argument and workspace checks.

Kernels take torch views of the arena (contiguous float32) and write into outputs that the
caller preallocated; nothing here allocates device memory.
"""
import os

import torch
import triton

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
try:  # triton >= 3.4 exposes the knob; the variable is the fallback for older releases
    INTERPRET = INTERPRET or bool(triton.knobs.runtime.interpret)
except AttributeError:
    pass

# The interpreter runs a program's Triton operations one by one as numpy operations, paying a
# fixed cost for each (tens of microseconds) and for each program: its launch configurations
# aim for tiles of about this many elements, so that a small network's layer is a handful of
# programs and loop steps.
INTERP_TILE = 16384



def _single_threaded_blas() -> None:
    """Under the interpreter each tl.dot is one numpy matmul of a tile (tens of kilobytes),
    where BLAS worker threads cost more than they save; with other processes on the cores
    (parallel tests) they wait on each other and one small matmul can take 100 ms. Limit
    BLAS to one thread when threadpoolctl (a scikit-learn dependency) is installed."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return
    threadpool_limits(1, user_api="blas")


if INTERPRET:
    _single_threaded_blas()


def dot_precision(precision=None) -> str:
    """The tl.dot input precision of a launch: "tf32" (None, the default: what PyTorch's cuDNN
    convolutions use on the GPU) or "ieee" (exact float32, for tests)."""
    if precision is None:
        return "tf32"
    if precision not in ("tf32", "ieee"):
        raise ValueError(f"precision must be 'tf32' or 'ieee', got {precision!r}")
    return precision


# TINYSN_AUTOTUNE=0 keeps only each kernel's first (hand-picked) GPU config: no tuning, one
# compilation per shape, for quick runs where compile time matters more than the last 20%.
TUNE = os.environ.get("TINYSN_AUTOTUNE", "1") != "0"


def autotune_configs(configs, interpreted_config):
    """The configs an autotuner times: under the interpreter only `interpreted_config` (a
    large tile: timing there is slow and measures the interpreter, not the kernel)."""
    if INTERPRET:
        return [interpreted_config]
    return list(configs) if TUNE else list(configs[:1])


def autotune(configs, interpreted_config, **kwargs):
    """`triton.autotune` over `autotune_configs(configs, interpreted_config)`. The autotuner
    keeps the full GPU list as `all_configs`, so that tests can pin each config in turn
    (tests/kernels/configs.py) whatever this run tunes over."""
    def wrap(fn):
        tuner = triton.autotune(configs=autotune_configs(configs, interpreted_config),
                                **kwargs)(fn)
        tuner.all_configs = list(configs)
        return tuner
    return wrap


def check_tensor(name: str, t: torch.Tensor, shape=None, dtype=torch.float32) -> None:
    """Raise ValueError unless `t` is a contiguous tensor of `dtype` (and `shape`)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def pair(v, name: str, minimum: int) -> tuple:
    """(h, w) from an int (used for both) or a pair of ints, each >= minimum; ValueError
    naming `name` otherwise (bools are not ints here)."""
    if isinstance(v, bool):
        raise ValueError(f"{name} must be an int or a pair of ints, got {v!r}")
    if isinstance(v, int):
        v = (v, v)
    if not isinstance(v, (tuple, list)) or len(v) != 2 or \
            not all(isinstance(e, int) and not isinstance(e, bool) for e in v):
        raise ValueError(f"{name} must be an int or a pair of ints, got {v!r}")
    if v[0] < minimum or v[1] < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {tuple(v)}")
    return int(v[0]), int(v[1])


def check_device(where: str, ref: torch.Tensor, **named) -> None:
    """Every tensor in `named` (None skipped) is on ref's device; `where` prefixes the error."""
    for name, t in named.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{where}: {name} is on {t.device}, expected {ref.device}")


def check_no_overlap(where: str, outputs, inputs) -> None:
    """No output shares memory with another tensor of the launch; outputs and inputs are
    (name, tensor or None) pairs."""
    others = [(n, t) for n, t in outputs + inputs if t is not None and t.numel()]
    for na, a in outputs:
        if a is None or a.numel() == 0:
            continue
        for nb, b in others:
            if b is a:
                continue
            a0, b0 = a.data_ptr(), b.data_ptr()
            if a0 < b0 + b.element_size() * b.numel() and b0 < a0 + a.element_size() * a.numel():
                raise ValueError(f"{where}: {na} overlaps {nb}")


def float_workspace(where: str, workspace, nbytes: int, device) -> torch.Tensor:
    """The first `nbytes` of `workspace` viewed as float32. It must be a contiguous 1-D uint8
    (4-byte aligned) or float32 tensor on `device` with at least `nbytes` bytes."""
    if not isinstance(workspace, torch.Tensor) or workspace.dim() != 1 or \
            workspace.dtype not in (torch.uint8, torch.float32) or not workspace.is_contiguous():
        raise ValueError(f"{where}: workspace must be a contiguous 1-D uint8 or float32 tensor")
    if workspace.device != device:
        raise ValueError(f"{where}: workspace is on {workspace.device}, expected {device}")
    have = workspace.numel() * workspace.element_size()
    if have < nbytes:
        raise ValueError(f"{where}: workspace too small: {have} bytes, need {nbytes}")
    if workspace.dtype == torch.float32:
        return workspace[:nbytes // 4]
    if workspace.data_ptr() % 4:
        raise ValueError(f"{where}: a uint8 workspace must be 4-byte aligned")
    return workspace[:nbytes].view(torch.float32)


_TUNED = {}   # (autotuner, scalar arguments, keyword arguments) -> the config it picked


def launch(tuner, grid, args, kwargs):
    """Launch an autotuned kernel (`grid`: a function of the config's meta-parameters). The
    first launch of a shape goes through the autotuner; later ones launch its pick directly,
    skipping the autotuner's per-call bookkeeping (host time per launch matters: the runtime
    launches hundreds of kernels per step)."""
    key = (id(tuner), tuple(a for a in args if not isinstance(a, torch.Tensor)),
           tuple(kwargs.items()))
    cfg = _TUNED.get(key)
    if cfg is None:
        tuner[grid](*args, **kwargs)
        cfg = getattr(tuner, "best_config", None)
        if cfg is not None:
            _TUNED[key] = cfg
        return
    tuner.fn[grid(cfg.kwargs)](*args, **kwargs, **cfg.all_kwargs())
