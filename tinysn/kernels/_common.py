"""What every kernel module shares: interpreter detection, dot precision, argument checks.

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

# "tf32" on the GPU matches PyTorch's cuDNN convolutions; "ieee" gives exact float32 (tests).
_PRECISION = {"value": "tf32"}


def set_precision(precision: str) -> None:
    """Set the default tl.dot input precision for conv and fc: "tf32" or "ieee"."""
    if precision not in ("tf32", "ieee"):
        raise ValueError(f"precision must be 'tf32' or 'ieee', got {precision!r}")
    _PRECISION["value"] = precision


def dot_precision(precision=None) -> str:
    """The precision a launch uses: the argument when given, else the default."""
    if precision is None:
        return _PRECISION["value"]
    if precision not in ("tf32", "ieee"):
        raise ValueError(f"precision must be 'tf32' or 'ieee', got {precision!r}")
    return precision


# TINYSN_AUTOTUNE=0 keeps only each kernel's first (hand-picked) GPU config: no tuning, one
# compilation per shape, for quick runs where compile time matters more than the last 20%.
TUNE = os.environ.get("TINYSN_AUTOTUNE", "1") != "0"


def autotune_configs(configs, interpreted_config):
    """Autotuning collapses to one small config under the interpreter (it is slow there)."""
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
