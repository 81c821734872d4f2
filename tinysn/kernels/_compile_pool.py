"""Cold compilation spread over worker processes, and launchers readied on threads.

Triton compiles a kernel in two halves: its Python front end (the kernel's AST turned into
MLIR, a few tens of milliseconds per variant) holds the GIL, the MLIR/LLVM passes and ptxas
release it. A cold ResNet-50 start compiles some 550 variants, so on a thread pool the front
ends queue on one GIL: the compile took 39 s on 16 cores (H200 machine). Here each variant is
compiled first in a worker process (no GIL shared, no CUDA context: workers only write
triton's disk cache), then by triton in the calling thread as usual, which finds the cache
and only loads the result. Whatever a worker cannot do (a kernel it cannot import, an
argument that does not pickle, a failed compile) the calling thread compiles itself, so the
result never depends on the workers.

Once compiled, a kernel still builds its launcher (a small C module, compiled by gcc once
per signature) and loads its binary at its first launch, one at a time on the launching
thread; `ready_launchers` does both for many kernels at once on a thread pool.
"""
import atexit
import contextlib
import importlib
import os
import pickle
import queue
import subprocess
import sys
import threading
import time

import torch
import triton

COLD_COMPILE_S = 0.2   # a compile slower than this was not a disk-cache hit: the cache is cold


class Workers:
    """Up to `count` worker processes (`python -m tinysn.kernels._compile_pool`), started as
    jobs need them, each serving one compile at a time over its pipes. Plain subprocesses,
    not multiprocessing: a worker never re-imports the user's main script, and it sees no
    GPU (CUDA_VISIBLE_DEVICES is empty), so it can never create a CUDA context."""

    def __init__(self, count: int):
        self.count, self.started = count, []
        self.idle = queue.Queue()
        self.lock = threading.Lock()
        atexit.register(self.close)

    def compile(self, job: tuple) -> None:
        """Run `compile_in_worker(*job)` in a worker; raises if it did not compile."""
        data = pickle.dumps(job)            # a job that does not pickle reaches no worker
        proc = self._take()
        try:
            proc.stdin.write(data)
            proc.stdin.flush()
            error = pickle.load(proc.stdout)
        except Exception:
            self._drop(proc)                # a broken worker makes room for a new one
            raise
        self.idle.put(proc)
        if error:
            raise RuntimeError(error)

    def _take(self):
        try:
            return self.idle.get_nowait()
        except queue.Empty:
            pass
        with self.lock:
            if len(self.started) < self.count:
                root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
                path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
                env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "0",
                       "PYTHONPATH": path}
                proc = subprocess.Popen([sys.executable, "-m", __name__], env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                self.started.append(proc)
                return proc
        return self.idle.get()

    def _drop(self, proc) -> None:
        proc.kill()
        proc.wait()
        with self.lock:
            self.started.remove(proc)

    def close(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self.started = []


_WORKERS = []   # the process's Workers, made at first use


def _workers(count: int) -> Workers:
    if not _WORKERS:
        _WORKERS.append(Workers(count))
    return _WORKERS[0]


def serve() -> None:
    """A worker's loop: compile each job read from stdin, answer "" or the error's text."""
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)                           # anything printed goes to stderr, not the pipe
    jobs = sys.stdin.buffer
    while True:
        try:
            job = pickle.load(jobs)
        except EOFError:
            return
        try:
            compile_in_worker(*job)
            error = ""
        except Exception as err:  # noqa: BLE001  (reported; the parent compiles it itself)
            error = f"{type(err).__name__}: {err}"[:500]
        pickle.dump(error, replies)
        replies.flush()


def tinysn_kernels() -> list:
    """Every @triton.jit function of tinysn.kernels, autotuned ones unwrapped."""
    found = []
    for name, module in list(sys.modules.items()):
        if name.startswith("tinysn.kernels.") and module is not None:
            for value in vars(module).values():
                fn = _jit_function(value)
                if fn is not None and fn not in found:
                    found.append(fn)
    return found


def _jit_function(value):
    """The JITFunction that `value` is or wraps (autotuners, heuristics), else None."""
    while isinstance(value, (triton.runtime.Autotuner, triton.runtime.Heuristics)):
        value = value.fn
    return value if isinstance(value, triton.runtime.JITFunction) else None


def worker_job(src, target, options) -> tuple:
    """The arguments of `compile_in_worker` for triton source `src`. The target must be
    explicit: without one triton would ask the (worker's absent) GPU."""
    if target is None:
        raise ValueError("no compile target")
    return (src.fn.__module__, src.fn.__name__, src.signature, src.constants, src.attrs,
            target, options)


def compile_in_worker(module: str, name: str, signature, constants, attrs, target,
                      options) -> None:
    """(In a worker process.) Compile kernel `module.name` for `target`: the result goes to
    triton's disk cache, where the parent's own compile of the same source finds it."""
    from triton.compiler import ASTSource

    fn = _jit_function(getattr(importlib.import_module(module), name))
    triton.compile(ASTSource(fn, signature, constants, attrs), target=target, options=options)


def process_count() -> int:
    """Worker processes for cold compiles: TINYSN_COMPILE_PROCESSES, else this process's
    share of the CPUs (torchrun's LOCAL_WORLD_SIZE ranks share one machine's); 0 compiles on
    threads only (e.g. in many parallel test processes, each of which would start its own
    workers)."""
    value = os.environ.get("TINYSN_COMPILE_PROCESSES", "")
    if not value:
        ranks = os.environ.get("LOCAL_WORLD_SIZE", "1")
        return max(1, (os.cpu_count() or 1) // (int(ranks) if ranks.isdigit() and ranks != "0"
                                                 else 1))
    if not value.isdigit():
        raise ValueError(f"TINYSN_COMPILE_PROCESSES must be a count (0 for none), got {value!r}")
    return int(value)


def compile_owners() -> list:
    """Where a JITFunction finds `compile`: its own attribute, which triton 3.9 sets when
    the function is made and triton 3.6 when it first runs, copying it from the
    triton.compiler package (patched too, for functions first run inside the block)."""
    import triton.compiler

    return [fn for fn in tinysn_kernels() if "compile" in vars(fn)] + [triton.compiler]


_BLOCK = {}   # inside compiling_in_processes: {"workers": count, "cold": bool}


def _through_workers(original):
    """`original` (triton's compile), sent through a worker first while a block is active
    and the cache has proved cold; otherwise `original` itself. A function that picked this
    wrapper up inside a block (triton 3.6) keeps it, harmlessly, after the block."""
    def compile(src, *args, **kwargs):
        block = _BLOCK
        if not block:
            return original(src, *args, **kwargs)
        if not block["cold"]:
            started = time.perf_counter()
            kernel = original(src, *args, **kwargs)
            if time.perf_counter() - started > COLD_COMPILE_S:
                block["cold"] = True
            return kernel
        try:
            _workers(block["workers"]).compile(worker_job(src, kwargs.get("target"),
                                                          kwargs.get("options")))
        except Exception:  # noqa: BLE001  (the calling thread compiles it instead)
            pass
        return original(src, *args, **kwargs)
    compile.tinysn_original = original
    return compile


@contextlib.contextmanager
def compiling_in_processes(owners, workers: int):
    """Inside this block every `compile` of `owners` (see compile_owners) compiles in a
    worker process first, then from the disk cache in the calling thread. The workers start
    only once a compile has been seen to take longer than a disk-cache hit
    (COLD_COMPILE_S): a warm start never pays for them."""
    originals = [(owner, getattr(owner.compile, "tinysn_original", owner.compile))
                 for owner in owners]
    for owner, original in originals:
        owner.compile = _through_workers(original)
    _BLOCK.update(workers=workers, cold=False)
    try:
        yield
    finally:
        _BLOCK.clear()
        for owner, original in originals:
            owner.compile = original


def ready_launchers(kernels, pool) -> None:
    """Build the launcher and load the binary of each compiled kernel (triton's
    CompiledKernel) on the thread pool `pool`, on the caller's CUDA device."""
    if not kernels:
        return
    device = torch.cuda.current_device()

    def ready(kernel):
        with torch.cuda.device(device):
            kernel._init_handles()
    for done in [pool.submit(ready, k) for k in kernels if hasattr(k, "_init_handles")]:
        try:
            done.result()
        except Exception:  # noqa: BLE001  (raised again, where it belongs, at its launch)
            pass


if __name__ == "__main__":
    serve()
