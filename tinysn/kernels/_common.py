"""What every kernel module shares: interpreter detection, dot precision, argument checks.

Kernels take torch views of the arena (contiguous float32) and write into outputs that the
caller preallocated; nothing here allocates device memory.
"""
import hashlib
import inspect
import os

import torch
import triton

from .. import cache

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
try:  # triton >= 3.4 exposes the knob; the variable is the fallback for older releases
    INTERPRET = INTERPRET or bool(triton.knobs.runtime.interpret)
except AttributeError:
    pass

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


def autotune(configs, interpreted_config, restore=(), **kwargs):
    """`triton.autotune` over `autotune_configs(configs, interpreted_config)`. The autotuner
    keeps the full GPU list as `all_configs`, so that tests can pin each config in turn
    (tests/kernels/configs.py) whatever this run tunes over.

    Tuning allocates no device memory (tinysn's cap covers every device byte): `restore`
    names the arguments a kernel updates in place (tuning runs it many times), which
    `HostRestore` saves to host memory and puts back, instead of triton's `restore_value`
    (a device clone); and timing goes through `bench_ms` (triton's do_bench allocates a
    256 MiB cache-flush buffer)."""
    kwargs = dict(kwargs)
    if restore:
        kwargs["pre_hook"] = HostRestore(restore)
    if not INTERPRET and "do_bench" in inspect.signature(triton.autotune).parameters:
        kwargs.setdefault("do_bench", bench_ms)

    def wrap(fn):
        tuner = triton.autotune(configs=autotune_configs(configs, interpreted_config),
                                **kwargs)(fn)
        tuner.all_configs = list(configs)
        return tuner
    return wrap


class HostRestore:
    """An autotuner pre_hook that keeps in-place arguments intact through tuning, in host
    memory. Triton calls it before every benchmarked launch, then once with
    `reset_only=True` after the last one: the first call copies the named tensors to the
    host, the final call copies them back. In between the kernel runs on its own output
    (an accumulation adds up): the timing is the same, the contents are restored after."""

    def __init__(self, names):
        self.names = list(names)
        self.saved = None

    def __call__(self, args, reset_only=False):
        if reset_only:
            for name, value in (self.saved or {}).items():
                args[name].copy_(value)
            self.saved = None
        elif self.saved is None:
            self.saved = {name: args[name].to("cpu", copy=True) for name in self.names
                          if args.get(name) is not None}


def bench_ms(fn, quantiles=None, warmup_ms: float = 5, rep_ms: float = 20):
    """Milliseconds per call of `fn` on the GPU from CUDA events: the median, or a list of
    `quantiles` (triton's do_bench interface). Allocates no device memory: there is no L2
    flush between calls, so small kernels time as they run inside a training step, warm."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        fn()
    end.record()
    end.synchronize()
    estimate = max(start.elapsed_time(end) / 3, 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate))):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(min(1000, max(1, int(rep_ms / estimate))))]
    for a, b in events:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in events)
    pick = lambda q: times[min(len(times) - 1, round(q * (len(times) - 1)))]  # noqa: E731
    return pick(0.5) if quantiles is None else [pick(q) for q in quantiles]


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
_BY_TUNING_KEY = {}   # (autotuner, its tuning key) -> config: from this process or the disk


def launch(tuner, grid, args, kwargs):
    """Launch an autotuned kernel (`grid`: a function of the config's meta-parameters). The
    first launch of a shape takes the config from tinysn's disk cache (tinysn/cache.py) or,
    on a miss, goes through the autotuner and stores its pick there; later launches run the
    pick directly, skipping the autotuner's per-call bookkeeping (host time per launch
    matters: the runtime launches hundreds of kernels per step)."""
    key = (id(tuner), tuple(a for a in args if not isinstance(a, torch.Tensor)),
           tuple(kwargs.items()))
    cfg = _TUNED.get(key)
    if cfg is None:
        cfg, launched = _first_launch(tuner, grid, args, kwargs)
        if cfg is not None:
            _TUNED[key] = cfg
        if launched:
            return
    tuner.fn[grid(cfg.kwargs)](*args, **kwargs, **cfg.all_kwargs())


def _first_launch(tuner, grid, args, kwargs):
    """(config, whether it launched) for a launch key seen for the first time. A config known
    for its tuning key (from this process or the disk cache) is returned unlaunched;
    otherwise the autotuner tunes and launches, and its pick is remembered and stored. A
    tuner with one config tunes nothing, so nothing goes to the disk."""
    if len(tuner.configs) < 2:
        tuner[grid](*args, **kwargs)
        return getattr(tuner, "best_config", None), True
    tkey = (id(tuner), _tuning_key(tuner, args, kwargs))
    cfg = _BY_TUNING_KEY.get(tkey)
    if cfg is not None:
        return cfg, False
    disk_key = _disk_key(tuner, tkey[1])
    stored = cache.lookup("autotune", disk_key)
    if stored is not None:
        cfg = _BY_TUNING_KEY[tkey] = triton.Config(**stored)
        return cfg, False
    tuner[grid](*args, **kwargs)
    cfg = _BY_TUNING_KEY[tkey] = tuner.best_config
    cache.store("autotune", disk_key, _config_fields(cfg))
    return cfg, True


def _tuning_key(tuner, args, kwargs) -> tuple:
    """What triton's autotuner keys its choice on: the `key=` arguments and the dtypes."""
    named = {**dict(zip(tuner.arg_names, args)), **kwargs}
    values = [named[name] for name in tuner.keys if name in named]
    dtypes = [str(v.dtype) for v in named.values() if isinstance(v, torch.Tensor)]
    return tuple(values + dtypes)


def _disk_key(tuner, tuning_key) -> list:
    """The disk cache's key for one tuning: GPU, triton and torch (cache.device_key), the
    kernel's name and source hash, the configs tuned over, and the tuning key (the shape)."""
    return [list(cache.device_key()), tuner.base_fn.__name__, _source_key(tuner),
            [str(c) for c in tuner.configs], [str(v) for v in tuning_key]]


def _source_key(tuner) -> str:
    """The kernel's source hash: triton's JITFunction.cache_key (the @triton.jit helpers it
    calls included); the interpreter's wrapper has none, so there the function's source."""
    fn = tuner.fn
    while not hasattr(fn, "cache_key") and hasattr(fn, "fn"):
        fn = fn.fn
    if hasattr(fn, "cache_key"):
        return fn.cache_key
    return hashlib.sha256(inspect.getsource(tuner.base_fn).encode()).hexdigest()


def _config_fields(cfg) -> dict:
    """A triton.Config as the keyword arguments that rebuild it."""
    return {"kwargs": dict(cfg.kwargs), "num_warps": cfg.num_warps,
            "num_stages": cfg.num_stages, "num_ctas": cfg.num_ctas, "maxnreg": cfg.maxnreg}
