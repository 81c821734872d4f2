"""What every kernel module shares: interpreter detection and its tile size, dot precision,
autotuning, argument and workspace checks.

Kernels take torch views of the arena (contiguous float32) and write into outputs that the
caller preallocated; nothing here allocates device memory.
"""
import contextlib
import copy
import hashlib
import inspect
import os
import time

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import cache

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
try:  # triton >= 3.4 exposes the knob; the variable is the fallback for older releases
    INTERPRET = INTERPRET or bool(triton.knobs.runtime.interpret)
except AttributeError:
    pass


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the host's launch arithmetic. triton.cdiv is a constexpr function
    (meant for kernel code; about 3 us per host call against 0.1 here), and a layer's launch
    takes several."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two >= n >= 1 (0 for 0, as triton's), for the host's block sizes;
    see cdiv."""
    return 0 if n == 0 else 1 << (n - 1).bit_length()


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


def autotune(configs, interpreted_config, restore=(), config_hook=None, **kwargs):
    """`triton.autotune` over `autotune_configs(configs, interpreted_config)`. The autotuner
    keeps the full GPU list as `all_configs`, so that tests can pin each config in turn
    (`pinned` below) whatever this run tunes over.

    `config_hook(named_args)` readies a launch's arguments for one config (named_args holds
    the config's meta-parameters too): a kernel that takes TMA descriptors sets their boxes
    to its tiles there. Every config gets it as its pre_hook (triton's tuning and single
    config runs), and `launch` calls it before each direct launch (`_hooked`).

    Tuning allocates no device memory (tinysn's cap covers every device byte): `restore`
    names the arguments a kernel updates in place (tuning runs it many times), which
    `HostRestore` saves to host memory and puts back, instead of triton's `restore_value`
    (a device clone); and timing goes through `bench_ms` (triton's do_bench allocates a
    256 MiB cache-flush buffer)."""
    kwargs = dict(kwargs)
    if restore:
        kwargs["pre_hook"] = HostRestore(restore)
    if not INTERPRET and "do_bench" in inspect.signature(triton.autotune).parameters:
        kwargs.setdefault("do_bench", tuning_bench_ms)

    if config_hook is not None:
        configs = [_hook_config(c, config_hook) for c in configs]
        interpreted_config = _hook_config(interpreted_config, config_hook)

    def wrap(fn):
        tuner = triton.autotune(configs=autotune_configs(configs, interpreted_config),
                                **kwargs)(fn)
        tuner.all_configs = list(configs)
        tuner.config_hook = config_hook
        return tuner
    return wrap


def autotuners(module) -> list:
    """The autotuned kernels of a kernel module (those `autotune` built keep `all_configs`)."""
    return [v for v in vars(module).values() if hasattr(v, "all_configs")]


def config_count(module) -> int:
    """The longest GPU config list among the module's autotuners: the index range of
    `pinned`."""
    found = autotuners(module)
    if not found:
        raise ValueError(f"{module.__name__} has no autotuned kernels")
    return max(len(t.all_configs) for t in found)


@contextlib.contextmanager
def pinned(module, index: int):
    """Within the block, every autotuner of `module` runs its GPU config `index` (modulo its
    list's length) and nothing else, so a test can check, and a benchmark time, every
    config, not only the one a run's autotuner picks; the picks made before are set aside
    and restored after. Under the interpreter the GPU configs run too (their block sizes
    and flags; warps and stages are ignored there). Raises AssertionError where the block
    ran none of the module's autotuned kernels, or one ran a config it was not pinned to."""
    saved = [(t, t.configs, dict(t.cache)) for t in autotuners(module)]
    saved_picks = dict(_TUNED)
    try:
        for t, _, _ in saved:
            t.configs = [t.all_configs[index % len(t.all_configs)]]
            t.cache.clear()
            t.best_config = None
        _TUNED.clear()
        yield
        ran = [t for t, _, _ in saved if t.best_config is not None]
        assert ran, f"no autotuned kernel of {module.__name__} ran"
        for t in ran:
            assert t.best_config is t.configs[0], "a kernel ran a config it was not pinned to"
    finally:
        for t, configs, cache in saved:
            t.configs = configs
            t.cache.clear()
            t.cache.update(cache)
        _TUNED.clear()
        _TUNED.update(saved_picks)


def _hook_config(cfg, hook):
    return triton.Config(dict(cfg.kwargs), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                         pre_hook=hook)


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
    flush between calls, so small kernels time as they run inside a training step, warm.

    The GPU time alone, not the host's: a call whose launch costs the host more than its
    kernels cost the GPU (tinysn's launchers on a small conv: ~100 us against ~10) would
    otherwise time the host, as the GPU idles between the events until the launch arrives.
    Where the first calls show the host pacing the GPU, the timed calls are queued behind a
    GPU-side wait (`_hold_queue`) long enough for the host to enqueue all of them, so each
    pair of events brackets kernels back to back; where the GPU is the slower side, the
    queue stays full by itself and nothing waits. The calls go in batches of
    `_QUEUED_CALLS`, each behind its own wait, as the GPU's launch queue holds about a
    thousand launches and blocks the host past that. A loaded host (other processes) can issue
    slower than its first calls promised: when issuing outlasted the wait, the calls are
    timed again behind a wait twice that long (`_HOLD_TRIES` passes at most)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host = time.perf_counter()
    start.record()
    for _ in range(3):
        fn()
    end.record()
    host = (time.perf_counter() - host) / 3
    end.synchronize()
    estimate = max(start.elapsed_time(end) / 3, 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate))):
        fn()
    count = min(1000, max(1, int(rep_ms / estimate)))
    held = estimate < 1.5 * host * 1e3    # the host, not the GPU, paced those calls
    times = []
    for first in range(0, count, _QUEUED_CALLS):
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(min(_QUEUED_CALLS, count - first))]
        _time_batch(fn, events, host if held else None)
        times += [a.elapsed_time(b) for a, b in events]
    times.sort()
    pick = lambda q: times[min(len(times) - 1, round(q * (len(times) - 1)))]  # noqa: E731
    return pick(0.5) if quantiles is None else [pick(q) for q in quantiles]


def _time_batch(fn, events, host_s=None) -> None:
    """Record `events` around calls of `fn`: queued behind a GPU-side wait where the host
    paces the GPU (`host_s`: its seconds per call), else straight after one another. A wait
    the host's issuing outlasted (a loaded host) is made twice that issuing and the calls
    timed again, `_HOLD_TRIES` passes at most."""
    if host_s is None:
        _timed_calls(fn, events, 0.0)
        return
    hold_s = min(1.5 * (host_s + 1e-5) * len(events), _HOLD_MAX_S)
    for _ in range(_HOLD_TRIES):
        issue_s = _timed_calls(fn, events, hold_s)
        if issue_s <= hold_s or hold_s == _HOLD_MAX_S:
            return
        hold_s = min(2 * issue_s, _HOLD_MAX_S)   # the host issued slower than the hold


# Cached measurements of an older timer are not reused (kernels' tuning picks, conv rankings
# and their times): version 3 queues at most `_QUEUED_CALLS` calls behind each wait. Version 2
# queued up to 1000, past the GPU's launch queue, and a small kernel's median was then the
# host's pace (bench/timer_queue.py); version 1 timed the host's launch cost wherever it
# exceeded the kernels' (small convs, small batches).
TIMER_VERSION = 3

# GPU clock cycles per second assumed by `_hold_queue` (the H200's boost clock is 1.98 GHz; a
# slower clock only makes the wait longer, which is harmless)
_SPIN_HZ = 2.0e9


_HOLD_TRIES = 3   # timed passes at most, each held twice as long as the last one's issuing
_HOLD_MAX_S = 0.5   # the longest GPU-side wait `_hold_queue` makes
# Calls timed behind one wait. The GPU's launch queue is finite: once it is full the host
# blocks at each launch until the GPU has taken one, and every call after that times the
# host's pace again. 64 calls of a few launches and two events each stay well inside it.
_QUEUED_CALLS = 64


def _timed_calls(fn, events, hold_s: float) -> float:
    """Call `fn` once between each pair of `events`, queued behind a GPU-side wait of
    `hold_s` (none for 0); returns the host's seconds to issue the calls. Issuing slower than
    the wait (a loaded host: other processes, a slow sleep) lets the GPU catch up, and the
    later pairs time the host again."""
    if hold_s:
        _hold_queue(hold_s)
    issued = time.perf_counter()
    for a, b in events:
        a.record()
        fn()
        b.record()
    issued = time.perf_counter() - issued
    torch.cuda.synchronize()
    return issued


def _hold_queue(seconds: float) -> None:
    """Keep the current stream busy for about `seconds` (at most _HOLD_MAX_S) with one
    spinning kernel, so that work queued behind it starts back to back."""
    torch.cuda._sleep(int(min(seconds, _HOLD_MAX_S) * _SPIN_HZ))


def tuning_bench_ms(fn, quantiles=None):
    """`bench_ms` as the autotuners time a config: shorter (2 ms warm-up, 8 ms of calls), as
    a cold start times hundreds of configs and the picks differ by tens of percent."""
    return bench_ms(fn, quantiles, warmup_ms=2, rep_ms=8)


# True inside `checked_before()`: the tensor checks below return at once
_CHECKED_BEFORE = [False]


@contextlib.contextmanager
def checked_before():
    """Within this block every launch repeats one whose tensors were checked before: the
    same kernels on the same views of the same pool, which is what the Runtime's training
    steps after its first are (the plan is the program; a CUDA graph replays the same
    launches with no Python at all). The tensor checks (`check_tensor`, `check_device`,
    `check_no_overlap` and the launchers' own shape checks built on them) then return at
    once: about a fifth of tinysn's own host time per eager step (bench/host.py). Checks
    of plain values (rates, flags, algorithm names) still run."""
    _CHECKED_BEFORE[0] = True
    try:
        yield
    finally:
        _CHECKED_BEFORE[0] = False


def check_tensor(name: str, t: torch.Tensor, shape=None, dtype=torch.float32) -> None:
    """Raise ValueError unless `t` is a contiguous tensor of `dtype` (and `shape`)."""
    if _CHECKED_BEFORE[0]:
        return
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def gate(skip, device, unread: torch.Tensor) -> tuple:
    """(pointer, GATED) for a kernel that changes training state (parameters, momentum,
    running statistics, the dropout counter), which a bad batch must leave as it was:
    `skip` is a one-element float32 tensor on `device` that the batch's check counted its
    bad values into (kernels/check.py; the Runtime reads the verdict after the step),
    non-zero: the kernel writes nothing; None: it always writes (`unread`, any tensor on
    the device, stands in as the pointer)."""
    if skip is None:
        return unread, False
    check_tensor("skip", skip, shape=(1,))
    if skip.device != device:
        raise ValueError(f"skip must be on {device}, got {skip.device}")
    return skip, True


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
    if _CHECKED_BEFORE[0]:
        return
    for name, t in named.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{where}: {name} is on {t.device}, expected {ref.device}")


def check_no_overlap(where: str, outputs, inputs) -> None:
    """No output shares memory with another tensor of the launch, the same tensor object
    passed twice included; outputs and inputs are (name, tensor or None) pairs."""
    if _CHECKED_BEFORE[0]:
        return
    others = [(i, n, t) for i, (n, t) in enumerate(outputs + inputs)
              if t is not None and t.numel()]
    for i, (na, a) in enumerate(outputs):
        if a is None or a.numel() == 0:
            continue
        for j, nb, b in others:
            if j == i:
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


_TUNED = {}   # (autotuner, scalar arguments, keyword arguments) -> (the config it picked,
              # the launch's keyword arguments with the config's: built once, not per launch)
_NOT_IN_KEY = (torch.Tensor, TensorDescriptor)   # the launch arguments a key leaves out
_BY_TUNING_KEY = {}   # (autotuner, its tuning key) -> config: from this process or the disk
_COMPILE_ONLY = []   # non-empty inside `compiling_in_parallel`: launches compile, run nothing


@contextlib.contextmanager
def compiling_in_parallel(workers=None):
    """Inside this block `launch` compiles the configs of an autotuned kernel its launch would
    consider (every config, or the tuning key's known pick: `_compile_configs`) on a pool of
    `workers` threads (default: the CPU count) instead of tuning and running it; leaving the
    block waits for the compilations and readies every compiled kernel's launcher on the same
    threads. Kernels launched through `run` compile the same way; no kernel runs inside the
    block (torch operations still do). A cold start that would compile hundreds of (kernel,
    config, shape) variants one by one takes a fraction of the time; the later real launches
    find them compiled and loaded. Once the cache proves cold, each variant's compilation
    also goes through a worker process first (kernels/_compile_pool.py, up to
    TINYSN_COMPILE_PROCESSES): triton's front end holds the GIL, so threads alone queue
    on it."""
    from concurrent.futures import ThreadPoolExecutor

    from ._compile_pool import compile_owners, compiling_in_processes, process_count
    from ._compile_pool import ready_launchers

    mode = getattr(triton, "AsyncCompileMode", None)
    workers = workers or os.cpu_count() or 1
    with ThreadPoolExecutor(workers) as pool:
        compiled = []
        with contextlib.ExitStack() as stack:
            if mode is not None and process_count() > 0:
                stack.enter_context(compiling_in_processes(compile_owners(), process_count()))
            if mode is not None:
                async_mode = stack.enter_context(mode(pool))
                stack.callback(lambda: compiled.extend(
                    getattr(async_mode, "future_kernels", {}).values()))
            _COMPILE_ONLY.append(True)
            stack.callback(_COMPILE_ONLY.pop)
            yield
        # the block's futures are resolved (AsyncCompileMode's exit): ready their launchers
        ready_launchers([k for k in (getattr(fk, "kernel", None) for fk in compiled) if k], pool)


def run(kernel, grid, *args, **kwargs):
    """Launch a @triton.jit kernel that is not autotuned: `kernel[grid](*args, **kwargs)`,
    or, inside `compiling_in_parallel`, only its compilation (queued on the thread pool)."""
    if _COMPILE_ONLY and not INTERPRET:
        kernel.warmup(*args, grid=grid, **kwargs)
    else:
        kernel[grid](*args, **kwargs)


def launch(tuner, grid, args, kwargs):
    """Launch an autotuned kernel (`grid`: a function of the config's meta-parameters). The
    first launch of a shape takes the config from tinysn's disk cache (tinysn/cache.py) or,
    on a miss, goes through the autotuner and stores its pick there; later launches run the
    pick directly, skipping the autotuner's per-call bookkeeping (host time per launch
    matters: the runtime launches hundreds of kernels per step)."""
    if _COMPILE_ONLY and not INTERPRET:
        _compile_configs(tuner, grid, args, kwargs)
        return
    key = (id(tuner), tuple([a for a in args if not isinstance(a, _NOT_IN_KEY)]),
           tuple(kwargs.items()))
    picked = _TUNED.get(key)
    if picked is None:
        cfg, launched = _first_launch(tuner, grid, args, kwargs)
        if cfg is not None:
            picked = _TUNED[key] = (cfg, {**kwargs, **cfg.all_kwargs()})
        if launched:
            return
    cfg, options = picked
    tuner.fn[grid(cfg.kwargs)](*_hooked(tuner, args, kwargs, cfg), **options)


def _hooked(tuner, args, kwargs, cfg):
    """`args` readied for `cfg` by the tuner's config_hook (see `autotune`): TMA descriptors
    copied, with the config's boxes. Without a hook, `args` unchanged."""
    hook = getattr(tuner, "config_hook", None)
    if hook is None:
        return args
    args = [copy.copy(a) if isinstance(a, TensorDescriptor) else a for a in args]
    hook({**dict(zip(tuner.arg_names, args)), **kwargs, **cfg.kwargs})
    return args


def _compile_configs(tuner, grid, args, kwargs) -> None:
    """Compile (queue on the pool) the configs a launch would consider: its tuning key's
    known pick (`_known_config`: the launch takes it untimed), else the autotuner's pruned
    list, or its only config, which triton runs unpruned. A conv's step launches share
    their tuning keys with the rankings' plain launches, which tuned them, but not their
    fused epilogues' specializations (a ReLU, a mask, no bias), so a step's walk compiles
    one config of each such variant, not all of them."""
    if len(tuner.configs) < 2:
        configs = tuner.configs
    elif (known := _known_config(tuner, _launch_tuning_key(tuner, args, kwargs))) is not None:
        configs = [known]
    elif getattr(tuner, "config_hook", None) is None:
        tuner.warmup(*args, grid=grid, **kwargs)
        return
    else:           # triton's warmup does not run config hooks
        tuner.nargs = dict(zip(tuner.arg_names, args))
        configs = tuner.prune_configs(kwargs)
        tuner.nargs = None
    for cfg in configs:
        tuner.fn.warmup(*_hooked(tuner, args, kwargs, cfg), grid=grid, **kwargs,
                        **cfg.all_kwargs())


def _first_launch(tuner, grid, args, kwargs):
    """(config, whether it launched) for a launch key seen for the first time. A config known
    for its tuning key (from this process or the disk cache) is returned unlaunched;
    otherwise the autotuner tunes and launches, and its pick is remembered and stored. A
    tuner with one config tunes nothing, so nothing goes to the disk."""
    if len(tuner.configs) < 2:
        tuner[grid](*args, **kwargs)
        return getattr(tuner, "best_config", None), True
    tkey = _launch_tuning_key(tuner, args, kwargs)
    cfg = _known_config(tuner, tkey)
    if cfg is not None:
        return cfg, False
    tuner[grid](*args, **kwargs)
    cfg = _BY_TUNING_KEY[tkey] = tuner.best_config
    cache.store("autotune", _disk_key(tuner, tkey[1]), _config_fields(cfg))
    return cfg, True


def _launch_tuning_key(tuner, args, kwargs) -> tuple:
    """A launch's key in _BY_TUNING_KEY: the tuner and its tuning key (`_tuning_key`)."""
    return id(tuner), _tuning_key(tuner, args, kwargs)


def _known_config(tuner, tkey):
    """The config a launch's key (`_launch_tuning_key`) has without tuning: this process's
    pick, else the disk cache's (then remembered for the process); None where it is still
    to be tuned."""
    cfg = _BY_TUNING_KEY.get(tkey)
    if cfg is None:
        stored = cache.lookup("autotune", _disk_key(tuner, tkey[1]))
        if stored is not None:
            cfg = _BY_TUNING_KEY[tkey] = triton.Config(**stored)
    return cfg


def _tuning_key(tuner, args, kwargs) -> tuple:
    """What triton's autotuner keys its choice on: the `key=` arguments and the dtypes."""
    named = {**dict(zip(tuner.arg_names, args)), **kwargs}
    values = [named[name] for name in tuner.keys if name in named]
    dtypes = [str(v.dtype) for v in named.values() if isinstance(v, torch.Tensor)]
    return tuple(values + dtypes)


def _disk_key(tuner, tuning_key) -> list:
    """The disk cache's key for one tuning: GPU, triton and torch (cache.device_key), the
    timer's version, the kernel's name and source hash, the configs tuned over, and the
    tuning key (the shape)."""
    return [list(cache.device_key()), TIMER_VERSION, tuner.base_fn.__name__,
            _source_key(tuner), [str(c) for c in tuner.configs], [str(v) for v in tuning_key]]


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
