"""Which tile configs the conv autotuners should time: a wide sweep on VGG16 / ResNet-50 shapes.

    PYTHONPATH=. python bench/conv_configs.py --out conv-configs.json     # on a GPU
    PYTHONPATH=. python bench/conv_configs.py --pick SWEEP.json...        # anywhere

For 17 conv shapes at batch 32 (every VGG16 3x3 size, ResNet-50's 3x3 and 1x1 sizes, all
stride 1), times each autotuned conv kernel under every candidate config (today's list plus
wider and deeper tiles; for the forward and "transposed" kernels also today's unpipelined,
`one_stage`), the median GPU time by tinysn's `bench_ms` (as the runtime's rankings
and autotuners time: the host's launch cost kept out, no cache flush), beside cuDNN's for the same
direction: the forward kernel (also the "flipped" data gradient), the implicit and the
"transposed" data-gradient kernels, the weight-gradient kernel as "splitk" and as "onepass"
(one tuner, one list for both), and the channels-last kernel as "nhwc" and "flipped_nhwc"
(one list too; its copies included in the time), and the channels-last weight gradient as
"weight_nhwc" (where it applies: output widths divisible by 4), and the flat-pixel TMA weight
gradient as "weight_tma". Then picks, per tuner,
greedily the configs whose best-per-shape total time is smallest, first the best single
config (what TINYSN_AUTOTUNE=0 runs), as many as today's list holds. The forward and
weight-gradient lists in tinysn/kernels/conv.py are such a pick, and so are the two
data-gradient lists (the channels-last lists were picked by hand from smaller one-off
sweeps). Every candidate is compiled first, in parallel, then checked and timed: a config
whose output on the same inputs changes between three runs, leaves elements unwritten or is
not cuDNN's to TF32 rounding is never picked (its time inf, the fault in the row's
"faults"). The lists before the one-stage pick (EARLIER_FWD, EARLIER_T) stay candidates.

`--pick` sweeps nothing: it picks each tuner's list from sweep files of several GPUs at
once, over the configs every file timed, each file's times over its own cuDNN total so
that each GPU weighs the same (eight configs cannot hold every shape's best, and which
shapes a list favours differs between GPUs).
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tinysn  # noqa: E402,F401
import torch  # noqa: E402
import triton  # noqa: E402

from bench import common  # noqa: E402
from tinysn.kernels import _common, conv  # noqa: E402

cfg = conv._cfg
BATCH = 32
DEVICE = "cuda"
# (C, K, H=W, R=S), stride 1, padding R // 2
SHAPES = [
    (64, 64, 224, 3), (128, 128, 112, 3), (256, 256, 56, 3), (512, 512, 28, 3), (512, 512, 14, 3),
    (64, 64, 56, 3), (128, 128, 28, 3), (256, 256, 14, 3), (512, 512, 7, 3), (64, 256, 56, 1),
    (256, 64, 56, 1), (1024, 256, 14, 1), (256, 1024, 14, 1), (2048, 512, 7, 1),
    (512, 2048, 7, 1), (128, 512, 28, 1), (512, 128, 28, 1),
]
EXTRA_FWD = [
    cfg(128, 128, 32, 4, 4), cfg(128, 128, 32, 8, 4), cfg(128, 128, 64, 8, 3),
    cfg(128, 128, 64, 4, 3), cfg(128, 256, 32, 8, 4), cfg(256, 128, 32, 8, 4),
    cfg(256, 128, 32, 8, 3), cfg(256, 64, 32, 8, 4), cfg(64, 256, 32, 8, 4), cfg(128, 64, 64, 4, 4),
    cfg(64, 128, 64, 4, 4), cfg(128, 128, 16, 8, 5), cfg(128, 64, 32, 4, 5),
    cfg(128, 128, 32, 8, 4, False), cfg(256, 128, 32, 8, 4, False), cfg(128, 256, 32, 8, 4, False),
    cfg(128, 64, 32, 4, 3), cfg(64, 64, 64, 4, 4), cfg(128, 128, 32, 8, 3, False),
    cfg(64, 64, 32, 4, 4, False), cfg(128, 128, 32, 8, 3), cfg(128, 64, 32, 4, 4, False),
]
EXTRA_WGT = [conv._with(c, TAP=False) for c in [
    cfg(128, 128, 64, 8, 3), cfg(64, 128, 64, 4, 3), cfg(128, 64, 64, 4, 3), cfg(64, 64, 128, 4, 3),
    cfg(128, 128, 32, 4, 4), cfg(64, 128, 32, 4, 4), cfg(128, 128, 32, 8, 4), cfg(64, 64, 64, 4, 4),
    cfg(128, 64, 32, 4, 3), cfg(128, 256, 32, 8, 3), cfg(64, 64, 64, 4, 3), cfg(128, 64, 32, 4, 4),
    cfg(128, 128, 32, 8, 3),
]]
# the weight gradient's tap-major columns (conv's TAP flag) under the same tiles as the
# list's and the extra configs that may pay for it
TAP_WGT = [conv._with(cfg(*c), TAP=True) for c in [
    (128, 64, 32, 4, 3), (64, 64, 128, 4, 3), (64, 64, 32, 4, 4), (128, 128, 32, 8, 4),
    (128, 128, 64, 8, 3), (64, 128, 64, 4, 3), (128, 64, 64, 4, 3), (128, 128, 32, 4, 4),
    (64, 128, 32, 4, 4), (64, 64, 64, 4, 4), (128, 256, 32, 8, 3), (128, 128, 32, 8, 3),
]]
EXTRA_DATA = [
    cfg(128, 128, 16, 8, 5), cfg(128, 256, 32, 8, 4, False), cfg(128, 64, 32, 4, 3),
    cfg(64, 256, 32, 8, 4), cfg(128, 128, 32, 8, 4), cfg(128, 128, 64, 8, 3), cfg(64, 128, 64, 4, 4),
    cfg(256, 128, 32, 8, 3), cfg(128, 64, 64, 4, 4),
]
# the channels-last kernel's (conv._nhwc_cfg): the tiles of its first sweep that its list
# does not hold, less [128, 256] tiles and [128, 128] tiles in 8 warps (they computed wrong
# sums: conv._NHWC_CONFIGS says where)
EXTRA_NHWC = [conv._nhwc_cfg(*c) for c in [
    (128, 128, 32, 4, 4), (128, 128, 16, 4, 5), (64, 64, 32, 4, 4), (128, 64, 64, 4, 3),
]]
# the channels-last weight gradient's ([BLOCK_M channels, BLOCK_N output channels], BLOCK_K
# pixels): the rest of its first sweep's tiles
EXTRA_WGT_NHWC = [conv._nhwc_cfg(*c) for c in [
    (128, 64, 32, 4, 4), (128, 128, 32, 8, 3), (128, 64, 64, 4, 3), (64, 128, 32, 4, 4),
    (128, 128, 32, 8, 4), (128, 128, 32, 4, 4), (64, 64, 128, 4, 3),
]]
# the flat-pixel TMA weight gradient's ("tma"): the rest of its first sweep's tiles
EXTRA_WGT_TMA = [conv._nhwc_cfg(*c) for c in [
    (128, 128, 32, 8, 4), (128, 64, 32, 4, 4), (64, 64, 64, 4, 3), (128, 128, 64, 8, 3),
    (128, 64, 64, 4, 3), (64, 128, 64, 4, 3), (64, 64, 32, 4, 4), (256, 128, 32, 8, 3),
]]


# The forward and "transposed" lists before the one-stage configs took their places (picked
# on the H200): candidates still, so a sweep on another GPU can take back what it prefers
EARLIER_FWD = [cfg(*c) for c in [
    (128, 128, 16, 8, 5), (128, 256, 32, 8, 4, False), (128, 64, 32, 4, 3), (64, 256, 32, 8, 4),
    (64, 128, 32, 4, 4, False), (64, 128, 64, 4, 4), (64, 64, 32, 4, 4), (128, 256, 32, 8, 3),
]]
EARLIER_T = [conv._with(cfg(*c[:6]), FLAT=c[6]) for c in [
    (256, 128, 32, 8, 3, True, True), (64, 256, 32, 8, 4, True, True),
    (128, 64, 32, 4, 3, True, True), (64, 128, 32, 8, 4, True, True),
    (64, 256, 32, 8, 4, True, False), (128, 128, 32, 8, 3, True, True),
    (64, 128, 64, 4, 4, True, False), (64, 64, 32, 4, 4, False, False),
]]


def reg_a(configs) -> list:
    """`configs` with conv's REG_A: the forward's x tile or the "transposed" data gradient's
    dY tile reaches the wgmma from registers instead of shared memory (an add of +0.0
    between its load and the dot; conv._pixel_operand says what that changes in the SASS)."""
    return [conv._with(c, REG_A=True) for c in configs]


def one_stage(configs) -> list:
    """`configs` again unpipelined (num_stages=1). Where an operand's contiguous axis is not
    its reduction axis (the NCHW pixels of the forward's and the "transposed" data gradient's
    A tile), the pipelined configs copy it to shared memory 4 bytes at a time (LDGSTS.E),
    the one-stage ones load it 16 bytes at a time into registers (LDG.E.128) but overlap no
    loads with the math (sm_90 SASS from bench/sass.py's compile, triton 3.9)."""
    return [triton.Config(dict(c.kwargs), num_warps=c.num_warps, num_stages=1)
            for c in configs]


SMEM_BYTES = 200 * 1024   # what a config's pipeline stages may hold (H200: 227 KiB per SM)


def fits(c) -> bool:
    """The config's operand tiles, times its stages, fit in shared memory."""
    k = c.kwargs
    return (k["BLOCK_M"] + k["BLOCK_N"]) * k["BLOCK_K"] * 4 * c.num_stages <= SMEM_BYTES


def candidates(today, extra) -> list:
    """Today's configs, then the extra ones that fit and are not among them."""
    seen = {str(c) for c in today}
    out = list(today)
    for c in extra:
        if fits(c) and str(c) not in seen:
            seen.add(str(c))
            out.append(c)
    return out


class ForcedConfig:
    """Stands in for conv's `_launch`: runs an autotuned kernel with `self.config`, or,
    inside `compiling_in_parallel`, compiles it under every candidate of its tuner."""

    def __init__(self, by_tuner):
        self.by_tuner, self.config = by_tuner, None

    def __call__(self, tuner, grid, args, kwargs):
        if _common._COMPILE_ONLY:
            for c in self.by_tuner[id(tuner)]:
                tuner.fn.warmup(*_common._hooked(tuner, args, kwargs, c), grid=grid(c.kwargs),
                                **kwargs, **c.all_kwargs())
            return
        tuner.fn[grid(self.config.kwargs)](*_common._hooked(tuner, args, kwargs, self.config),
                                           **kwargs, **self.config.all_kwargs())


def problem(c, k, hw, r) -> dict:
    """{phase: (tinysn call, cuDNN call, the tensor the tinysn call writes)} for one shape,
    on random inputs. Phases:
    "forward", "data_implicit", "data_transposed", "weight_splitk", "weight_onepass",
    "forward_nhwc", "data_nhwc", and "weight_nhwc" and "weight_tma" where they apply."""
    pad = r // 2
    x = torch.randn(BATCH, c, hw, hw, device=DEVICE)
    w = torch.randn(k, c, r, r, device=DEVICE) * 0.05
    y = torch.empty(BATCH, k, hw, hw, device=DEVICE)
    dy = torch.randn_like(y)
    dx, dw = torch.empty_like(x), torch.empty_like(w)
    ws = torch.empty(max(conv.workspace_bytes(x.shape, w.shape, 1, pad, phase, algo)
                         for phase, algo in (("backward_weight", "splitk"),
                                             ("backward_data", "transposed"),
                                             ("forward", "nhwc"),
                                             ("backward_data", "flipped_nhwc"),
                                             ("backward_weight", "nhwc"),
                                             ("backward_weight", "tma"))) // 4 + 1,
                     device=DEVICE)

    def cudnn(mask):
        return lambda: torch.ops.aten.convolution_backward(
            dy, x, w, None, (1, 1), (pad, pad), (1, 1), False, (0, 0), 1, mask)

    data = cudnn((True, False, False))
    weight = cudnn((False, True, False))
    calls = {
        "forward": (lambda: conv.forward(x, w, None, y, stride=1, padding=pad),
                    lambda: torch.nn.functional.conv2d(x, w, None, 1, pad), y),
        "data_implicit": (lambda: conv.backward_data(dy, w, dx, stride=1, padding=pad), data,
                          dx),
        "data_transposed": (lambda: conv.backward_data(dy, w, dx, stride=1, padding=pad,
                                                       algo="transposed", workspace=ws), data,
                            dx),
        "weight_splitk": (lambda: conv.backward_weight(x, dy, dw, None, stride=1, padding=pad,
                                                       algo="splitk", workspace=ws), weight,
                          dw),
        "weight_onepass": (lambda: conv.backward_weight(x, dy, dw, None, stride=1, padding=pad),
                           weight, dw),
        "forward_nhwc": (lambda: conv.forward(x, w, None, y, stride=1, padding=pad, algo="nhwc",
                                              workspace=ws),
                         lambda: torch.nn.functional.conv2d(x, w, None, 1, pad), y),
        "data_nhwc": (lambda: conv.backward_data(dy, w, dx, stride=1, padding=pad,
                                                 algo="flipped_nhwc", workspace=ws), data, dx),
    }
    if conv._applies("nhwc", x.shape, w.shape, (1, 1), pad, "backward_weight"):
        calls["weight_nhwc"] = (lambda: conv.backward_weight(
            x, dy, dw, None, stride=1, padding=pad, algo="nhwc", workspace=ws), weight, dw)
    if conv._applies("tma", x.shape, w.shape, (1, 1), pad, "backward_weight"):
        calls["weight_tma"] = (lambda: conv.backward_weight(
            x, dy, dw, None, stride=1, padding=pad, algo="tma", workspace=ws), weight, dw)
    return calls


def tuners() -> dict:
    """{tuner name: (the autotuner, today's configs, candidates, the phases it serves)}."""
    data = candidates(conv._DATA_CONFIGS, EXTRA_DATA)
    data_t = [conv._with(c, FLAT=f) for c in data for f in (False, True)]
    return {
        "forward": (conv._conv_fwd, conv._FWD_CONFIGS,
                    candidates(conv._FWD_CONFIGS, EXTRA_FWD + EARLIER_FWD
                               + one_stage(conv._FWD_CONFIGS + EARLIER_FWD)),
                    ("forward",)),
        "data_implicit": (conv._conv_bwd_data, conv._DATA_CONFIGS, data, ("data_implicit",)),
        "data_transposed": (conv._conv_bwd_data_t, conv._T_CONFIGS,
                            candidates(conv._T_CONFIGS, data_t + EARLIER_T
                                       + one_stage(conv._T_CONFIGS + EARLIER_T)
                                       + reg_a(conv._T_CONFIGS + EARLIER_T)),
                            ("data_transposed",)),
        "weight": (conv._conv_bwd_weight, conv._WGT_CONFIGS,
                   candidates(conv._WGT_CONFIGS, EXTRA_WGT + TAP_WGT),
                   ("weight_splitk", "weight_onepass")),
        "nhwc": (conv._conv_nhwc, conv._NHWC_CONFIGS, candidates(conv._NHWC_CONFIGS, EXTRA_NHWC),
                 ("forward_nhwc", "data_nhwc")),
        "weight_nhwc": (conv._conv_bwd_weight_nhwc, conv._WGT_NHWC_CONFIGS,
                        candidates(conv._WGT_NHWC_CONFIGS, EXTRA_WGT_NHWC), ("weight_nhwc",)),
        "weight_tma": (conv._conv_bwd_weight_tma, conv._WGT_TMA_CONFIGS,
                       candidates(conv._WGT_TMA_CONFIGS, EXTRA_WGT_TMA), ("weight_tma",)),
    }


def short_sweeps() -> dict:
    """Narrow sweeps of one tuner, named like `tuners()`'s entries: today's list beside one
    change to it (the "..._reg_a" ones: the same configs with REG_A)."""
    return {"data_transposed_reg_a": (conv._conv_bwd_data_t, conv._T_CONFIGS,
                                      candidates(conv._T_CONFIGS, reg_a(conv._T_CONFIGS)),
                                      ("data_transposed",)),
            "forward_reg_a": (conv._conv_fwd, conv._FWD_CONFIGS,
                              candidates(conv._FWD_CONFIGS, reg_a(conv._FWD_CONFIGS)),
                              ("forward",))}


# ResNet-50's conv shapes among SHAPES (its 3x3 convs at 56, 28, 14 and 7 pixels, its 1x1 ones)
RESNET50 = [s for s in SHAPES if s[3] == 1 or (s[0] == s[1] and s[0] * s[2] == 64 * 56)]


def selection(names, kernel_size=None, resnet50=False) -> tuple:
    """(tuners, shapes) one run sweeps: the autotuners named in `names` (comma-separated; a
    `short_sweeps` name too) over the shapes of one kernel size (None: every shape), of
    ResNet-50's alone where `resnet50`. ValueError names an unknown tuner or a kernel size
    no shape has."""
    every = {**tuners(), **short_sweeps()}
    wanted = names.split(",")
    unknown = [n for n in wanted if n not in every]
    if unknown:
        raise ValueError(f"unknown tuner {', '.join(unknown)} (tuners: {', '.join(every)})")
    shapes = [s for s in (RESNET50 if resnet50 else SHAPES) if kernel_size in (None, s[3])]
    if not shapes:
        raise ValueError(f"no shape has kernel size {kernel_size} "
                         f"(sizes: {', '.join(str(r) for r in sorted({s[3] for s in SHAPES}))})")
    return {n: every[n] for n in wanted}, shapes


def greedy(rows, count) -> list:
    """Indices of `count` configs, each added where it lowers the total of the per-shape best
    times the most (the first: the best single config)."""
    chosen = []
    for _ in range(count):
        total = lambda i: sum(min(r["ms"][j] for j in chosen + [i]) for r in rows)  # noqa: E731
        chosen.append(min((i for i in range(len(rows[0]["ms"])) if i not in chosen), key=total))
    return chosen


def median_ms(fn) -> float:
    """GPU milliseconds per call of `fn`. Not triton's do_bench: it times the host too where
    launching costs more than the kernels run (the channels-last launcher's three kernels
    and descriptors took about 0.15 ms, so every small shape's "nhwc" rows read 0.15-0.17)."""
    return _common.bench_ms(fn, warmup_ms=5, rep_ms=25)


def time_configs(forced, fn, configs, check=None) -> tuple:
    """(median ms of `fn` under each config, {config index: why it is wrong}): inf, never
    picked, where it fails to launch or `check()` names a fault in what it computed."""
    out, faults = [], {}
    for i, c in enumerate(configs):
        forced.config = c
        try:
            faults[i] = check() if check else None
            out.append(float("inf") if faults[i] else median_ms(fn))
        except Exception as err:
            faults[i] = f"{type(err).__name__}: {str(err)[:80]}"
            out.append(float("inf"))
        if faults[i]:
            print(f"  {c}: {faults[i]}")
    return out, {i: why for i, why in faults.items() if why}


# what a config's result may differ from cuDNN's by (relative norm; both round to TF32,
# about 1e-3 apart): only a gross fault is caught so, a race by its changing bits
TOLERANCE = 1e-2


def fault(fn, out, expected, runs: int = 3):
    """Why `fn`, which writes `out`, is not to be picked, or None: elements left unwritten
    (`out` is poisoned before each run), other bits on a later run from the same inputs (a
    race: on the H200 one channels-last tile gave wrong, changing sums), or a result that is
    not `expected` (cuDNN's) to TF32 rounding."""
    first = None
    for run in range(runs):
        out.fill_(float("nan"))
        fn()
        if out.isnan().any():
            return f"run {run} left elements unwritten"
        if first is None:
            first = out.clone()
        elif not torch.equal(out, first):
            return f"run {run} gave other bits than run 0"
    err = float((first.double() - expected.double()).norm() /
                expected.double().norm().clamp_min(1e-12))
    return None if err < TOLERANCE else f"relative error {err:.1e} against cuDNN"


def _result(value):
    """cuDNN's output tensor: the call's result, or the one gradient a backward returns."""
    if isinstance(value, torch.Tensor):
        return value
    return next(t for t in value if t is not None)


def sweep(problems, tuned, shape_done=lambda rows: None, shapes=None) -> list:
    """One row per (shape, phase): every candidate's ms (inf where it computed wrongly: its
    fault in "faults"), today's best, cuDNN's ms. conv's launches run the forced config
    meanwhile; `shape_done(rows)` runs after each shape, so a run cut short by its time
    limit still leaves the rows it timed. `shapes`: the problems' shapes (SHAPES by
    default)."""
    forced = ForcedConfig({id(t): cands for t, _, cands, _ in tuned.values()})
    launch, conv._launch = conv._launch, forced
    try:
        return _sweep(problems, tuned, forced, shape_done, shapes or SHAPES)
    finally:
        conv._launch = launch


def _sweep(problems, tuned, forced, shape_done, shapes) -> list:
    started = time.perf_counter()
    if not _common.INTERPRET:       # the interpreter compiles nothing
        with _common.compiling_in_parallel():
            for calls in problems:
                for _, _, _, phases in tuned.values():
                    for phase in phases:
                        if phase in calls:      # "weight_nhwc" runs only some shapes
                            calls[phase][0]()
    print(f"compiled in {time.perf_counter() - started:.0f} s", flush=True)
    rows = []
    for shape, calls in zip(shapes, problems):
        for name, (_, today, cands, phases) in tuned.items():
            for phase in (p for p in phases if p in calls):
                fn, ref, *written = calls[phase]
                check = None
                if written:
                    expected = _result(ref())
                    check = lambda: fault(fn, written[0], expected)  # noqa: E731
                ms, faults = time_configs(forced, fn, cands, check)
                r = {"shape": list(shape), "tuner": name, "phase": phase, "ms": ms,
                     "faults": faults, "today_ms": min(ms[:len(today)]),
                     "cudnn_ms": median_ms(ref)}
                rows.append(r)
                print(f"{str(shape):<20} {phase:<16} cuDNN {r['cudnn_ms']:.4f} ms, today's "
                      f"best {r['today_ms']:.4f} ({r['cudnn_ms'] / r['today_ms']:.2f}x), best "
                      f"{min(ms):.4f} ({r['cudnn_ms'] / min(ms):.2f}x)", flush=True)
        shape_done(rows)
    return rows


def pick_all(rows, tuned) -> dict:
    """{tuner name: its greedy pick, as many configs as today's list}, each printed with
    the pick's, today's and cuDNN's total time over the shapes."""
    picks = {}
    for name, (_, today, cands, _) in tuned.items():
        mine = [r for r in rows if r["tuner"] == name]
        pick = greedy(mine, len(today))
        picks[name] = [str(cands[i]) for i in pick]
        print(f"{name}: pick {sum(min(r['ms'][i] for i in pick) for r in mine):.3f} ms, today's "
              f"{sum(r['today_ms'] for r in mine):.3f} ms, cuDNN "
              f"{sum(r['cudnn_ms'] for r in mine):.3f} ms")
        for c in picks[name]:
            print(f"  {c}")
    return picks


def config_key(text: str) -> tuple:
    """A config's name as a sweep file writes it, less the fields that hold None (triton
    3.9 names one more such field than 3.6), so two versions' sweeps name a config alike."""
    return tuple(p for p in text.split(", ") if not p.endswith(": None"))


def sweep_file(path) -> dict:
    """A sweep this script wrote (environment included); ValueError names a file that is
    missing or is not one."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"--pick: cannot read {path}: {err}") from None
    if not all(k in data for k in ("environment", "candidates", "rows")):
        raise ValueError(f"--pick: {path} is not a conv_configs.py sweep (no candidates or rows)")
    return data


def joint_rows(sweeps, tuner) -> tuple:
    """(candidate names, rows) for `greedy` over several sweep files (GPUs) of one tuner: the
    candidates every file timed, in the first file's order, and each file's rows with their
    times over that file's cuDNN total for the tuner, so each GPU weighs the same."""
    names = [n for n in sweeps[0]["candidates"][tuner]
             if all(config_key(n) in map(config_key, s["candidates"][tuner]) for s in sweeps)]
    rows = []
    for s in sweeps:
        where = {config_key(n): i for i, n in enumerate(s["candidates"][tuner])}
        mine = [r for r in s["rows"] if r["tuner"] == tuner]
        cudnn = sum(r["cudnn_ms"] for r in mine)
        rows += [{"ms": [r["ms"][where[config_key(n)]] / cudnn for n in names]} for r in mine]
    return names, rows


def pick_jointly(sweeps, counts) -> dict:
    """{tuner: the greedy pick of counts[tuner] configs over every file's shapes} for each
    tuner all files swept (`joint_rows`), each printed with every file's best-per-shape total
    under the pick and under today's list, beside its cuDNN total."""
    picks = {}
    for tuner in [t for t in sweeps[0]["candidates"] if all(t in s["candidates"] for s in sweeps)]:
        names, rows = joint_rows(sweeps, tuner)
        pick = [names[i] for i in greedy(rows, counts[tuner])]
        picks[tuner] = pick
        today = [str(c) for c in tuners()[tuner][1]]
        print(f"{tuner}: pick of {len(names)} configs every file timed")
        for s in sweeps:
            mine = [r for r in s["rows"] if r["tuner"] == tuner]
            print(f"  {s['environment']['gpu']}: pick {_total(s, mine, tuner, pick):.3f} ms, "
                  f"today's list {_total(s, mine, tuner, today):.3f} ms, cuDNN "
                  f"{sum(r['cudnn_ms'] for r in mine):.3f} ms")
        for c in pick:
            print(f"  {c}")
    return picks


def _total(sweep, rows, tuner, names) -> float:
    """The shapes' summed best time under the configs `names` (inf where the file lacks one)."""
    where = {config_key(n): i for i, n in enumerate(sweep["candidates"][tuner])}
    if any(config_key(n) not in where for n in names):
        return float("inf")
    return sum(min(r["ms"][where[config_key(n)]] for n in names) for r in rows)


def main():
    ap = argparse.ArgumentParser()
    common.add_out_argument(ap)
    ap.add_argument("--pick", nargs="+", metavar="SWEEP",
                    help="no sweep: pick each tuner's list jointly from these sweep files "
                         "(several GPUs; no GPU needed), as long as today's")
    ap.add_argument("--tuners",
                    default="forward,data_implicit,data_transposed,weight,nhwc,weight_nhwc,"
                            "weight_tma",
                    help="the autotuners to sweep (comma-separated)")
    ap.add_argument("--kernel-size", type=int, help="only the shapes of this kernel size")
    ap.add_argument("--resnet50", action="store_true", help="only ResNet-50's shapes")
    args = ap.parse_args()
    if args.pick:
        try:
            sweeps = [sweep_file(path) for path in args.pick]
        except ValueError as err:
            ap.error(str(err))
        picks = pick_jointly(sweeps, {n: len(t[1]) for n, t in tuners().items()})
        if args.out:
            common.write(args.out, {"sweeps": args.pick, "picks": picks})
        return 0
    try:
        tuned, shapes = selection(args.tuners, args.kernel_size, args.resnet50)
    except ValueError as err:
        ap.error(str(err))
    if not torch.cuda.is_available():
        print("bench/conv_configs.py needs a CUDA GPU")
        return 1
    torch.backends.cudnn.allow_tf32 = True
    result = {"batch": BATCH, "shapes": [list(s) for s in shapes],
              "candidates": {n: [str(c) for c in t[2]] for n, t in tuned.items()}}
    rows = sweep([problem(*s) for s in shapes], tuned,
                 lambda rows: common.write(args.out, {**result, "rows": rows}), shapes)
    common.write(args.out, {**result, "rows": rows, "picks": pick_all(rows, tuned)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
