"""Shared by the benchmarks: the one results writer, timers and the kernel-pair harness.

Every script writes its results through `write(path, payload)`: one JSON object, the payload's
keys beside an "environment" envelope (gpu, torch, triton, cudnn, python, date, command line),
at the path the caller gave with `--out` (`add_out_argument`); without `--out` nothing is
written, so a smoke run can never overwrite a tracked result.
"""
import argparse
import json
import os
import platform
import sys
import time

import torch
import triton


def environment() -> dict:
    """Which GPU, library versions, date and command line a figure was measured with."""
    cuda = torch.cuda.is_available()
    return {"gpu": torch.cuda.get_device_name() if cuda else "cpu",
            "torch": torch.__version__, "triton": triton.__version__,
            "cudnn": torch.backends.cudnn.version() if cuda else None,
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(sys.argv)}


def out_path(text: str) -> str:
    """An --out value: a path ending in .json (checked before anything runs)."""
    if not str(text).endswith(".json"):
        raise argparse.ArgumentTypeError(f"--out must name a .json file, got {text!r}")
    return text


def add_out_argument(parser) -> None:
    """The `--out PATH` option every benchmark shares."""
    parser.add_argument("--out", default=None, metavar="PATH", type=out_path,
                        help="write the results JSON to PATH (default: print only)")


def write(path, payload: dict):
    """Write payload beside the environment envelope to `path` (a .json file); return the
    path, or None when `path` is None (nothing is written)."""
    if "environment" in payload:
        raise ValueError("payload must not carry its own 'environment' key")
    if path is None:
        return None
    out_path(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"environment": environment(), **payload}, f, indent=1)
    return path


def runtime_memory(rt) -> dict:
    """A Runtime's memory beside the process's: the pool's peak and its plan's, the arena's
    size (the plan's capacity, within the cap), and the device's max_memory_allocated since
    the last reset (a Runtime resets it as its construction begins; None on the CPU), so
    that a bench records the process's peak beside the pool's."""
    return {"arena_bytes": rt.plan.capacity, "pool_peak_bytes": rt.stats.peak_bytes,
            "planned_peak_bytes": rt.plan.peak_bytes,
            "process_peak_bytes": rt.stats.process_peak_bytes}


def release_memory() -> None:
    """Give the last configuration's device and pinned host memory back: whatever of it sits
    in a reference cycle (a Runtime does not; a PyTorch reference's objects may) is
    collected, torch caches both device blocks and pinned host blocks, and PyTorch's cuBLAS
    handles keep their workspaces (65 MiB on the H200) in the caching allocator after a
    PyTorch reference ran; the next configuration's process peak and host arena then start
    from what is really held."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        clear_cublas = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_cublas is not None:
            clear_cublas()
        torch.cuda.empty_cache()
        for name in ("_host_emptyCache", "_accelerator_emptyHostCache"):   # by torch release
            if hasattr(torch._C, name):
                getattr(torch._C, name)()
                break


def read(path) -> dict:
    """The payload of a results file written by `write` (empty when there is none)."""
    if path is None or not os.path.exists(path):
        return {}
    with open(path) as f:
        data = json.load(f)
    data.pop("environment", None)
    return data


def group_main(bench, groups, header: str) -> None:
    """The command line of one kernel group (kernels_norm.py, kernels_misc.py): --batch,
    --only (some of `groups`), --out; prints `header`, then each row as it is timed."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--only", default=",".join(groups))
    add_out_argument(ap)
    a = ap.parse_args()
    print(header, flush=True)
    rows = bench("cuda", a.batch, tuple(a.only.split(",")), log=lambda s: print(s, flush=True))
    if write(a.out, {"batch": a.batch, "rows": rows}):
        print(f"\nwrote {a.out}")


def torch_model(model_name, net):
    """(module, source) of PyTorch's version of a tinysn model: torchvision's when it has
    one, else the tinysn graph's torch twin (e.g. inception_v4, the deep ResNet)."""
    try:
        import torchvision
        return (getattr(torchvision.models, model_name)(num_classes=net.classes),
                f"torchvision.models.{model_name}")
    except (ImportError, AttributeError):
        return net.to_torch(), "tinysn graph's torch twin"


def cuda_median_ms(fn, iters: int = 10, warmup: int = 3, before=None) -> float:
    """Median milliseconds of fn() over `iters` runs, timed with CUDA events after warm-up;
    `before()`, where given, runs ahead of each timed call, outside its events (an L2
    flush, say)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def do_bench(fn) -> float:
    """Median milliseconds of fn() by triton's event timer (warm-up 25 ms, 100 ms of repeats)."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def gpu_ms(fn) -> float:
    """Median milliseconds of fn() on the GPU alone, as the runtime's rankings and autotuners
    time (tinysn's bench_ms: events around each call, the host's launch cost kept out by a
    queue held behind a GPU-side wait, no cache flush; warm-up 25 ms, 100 ms of calls). A
    conv launcher costs the host more than a small conv's kernels run, which do_bench
    would time instead."""
    from tinysn.kernels._common import bench_ms
    return bench_ms(fn, warmup_ms=25, rep_ms=100)


def do_bench_graph(fn) -> float:
    """Median milliseconds of fn() replayed inside a CUDA graph: the GPU time alone, without
    the host's per-launch cost (what a graph-captured training step would see)."""
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def shape_str(s) -> str:
    return "x".join(str(d) for d in s)


def copy_gbps(device) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second / 1e9), 103 MB."""
    x = torch.randn(32, 256, 56, 56, device=device)
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x))
    return 2 * x.numel() * 4 / ms * 1e-6


def graph_note(row) -> str:
    """The log's suffix for a row's CUDA-graph times (empty when there are none)."""
    if "graph_error" in row:
        return "  graph: " + row["graph_error"][:80]
    if "torch_graph_ms" not in row:
        return ""
    frac = f" ({row['graph_frac_of_copy']:.0%} of copy)" if "graph_frac_of_copy" in row else ""
    return f"  graph {row['tinysn_graph_ms']:.4f}/{row['torch_graph_ms']:.4f} ms{frac}"


class Runner:
    """Times a tinysn kernel beside its torch counterpart and collects one row per pair.

    `run(...)` checks (optionally) the result, times both with `timer` (medians, ms) and
    records the ratio torch/tinysn plus GB/s (`nbytes`: bytes each must move once; `moved`:
    bytes it really moves) or TFLOP/s (`flops`), and the fraction of the copy bandwidth when
    `copy_gbps` is set. A failure becomes an "error" row, so one kernel cannot hide the rest.
    With `graph_timer` set (do_bench_graph on the GPU), both are timed again replayed in a
    CUDA graph: `*_graph_ms` and `graph_frac_of_copy` separate a kernel's own speed from the
    host's launch cost; a capture that fails leaves a "graph_error" and the row stands.
    `graph=False` skips that for a pair whose torch side cannot be captured (autograd, RNG):
    a failed capture can leave the CUDA context unusable for the rows after it.
    """

    def __init__(self, log, fmt, timer=None, graph_timer=None):
        self.rows, self.log, self.fmt = [], log, fmt
        self.timer = timer or do_bench
        self.graph_timer = graph_timer
        self.copy_gbps = None

    def run(self, kernel, algo, shape, fn, torch_fn, *, nbytes=None, moved=None, flops=None,
            check=None, graph=True, **extra):
        row = {"kernel": kernel, "algo": algo, "shape": shape, **extra}
        try:
            fn()
            torch_fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            if check is not None:
                row["rel_err"] = check()
            ms, tms = self.timer(fn), self.timer(torch_fn)
            row.update(tinysn_ms=ms, torch_ms=tms, ratio=tms / ms)
            if nbytes is not None:
                row.update(gbps=nbytes / ms * 1e-6, torch_gbps=nbytes / tms * 1e-6)
                if self.copy_gbps:
                    row.update(copy_gbps=self.copy_gbps, frac_of_copy=row["gbps"] / self.copy_gbps)
            if moved is not None:
                row["moved_gbps"] = moved / ms * 1e-6
            if flops is not None:
                row.update(tflops=flops / ms * 1e-9, torch_tflops=flops / tms * 1e-9)
        except Exception as e:  # keep going: one failure should not hide the rest
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        if graph and self.graph_timer is not None and "error" not in row:
            self._graph_times(row, fn, torch_fn, nbytes)
        self.rows.append(row)
        self.log(self.fmt(row))
        return row

    def _graph_times(self, row, fn, torch_fn, nbytes):
        try:
            gms = self.graph_timer(fn)
            row.update(tinysn_graph_ms=gms)
            if nbytes is not None and self.copy_gbps:
                row["graph_frac_of_copy"] = nbytes / gms * 1e-6 / self.copy_gbps
            tgms = self.graph_timer(torch_fn)
            row.update(torch_graph_ms=tgms, graph_ratio=tgms / gms)
        except Exception as e:
            row["graph_error"] = f"{type(e).__name__}: {e}"[:300]
