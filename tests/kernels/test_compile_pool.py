"""kernels/_compile_pool.py: cold compiles go through worker processes, warm ones never do."""
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from triton.backends.compiler import GPUTarget

from tinysn.kernels import _compile_pool as cp

RELU_SIGNATURE = {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}


def _relu_job(name="_relu_fwd_kernel", block=1024):
    return ("tinysn.kernels.act", name, RELU_SIGNATURE, {(3,): block}, {},
            GPUTarget("cuda", 90, 32), {"num_warps": 4})


def test_a_worker_compiles_for_the_gpu_into_the_disk_cache_and_reports_failures(
        tmp_path, monkeypatch):
    """No GPU is needed to compile for one: the worker writes triton's cache (sm_90 here),
    is reused for the next job, and a job it cannot do raises with the worker's reason."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    workers = cp.Workers(1)
    try:
        workers.compile(_relu_job())
        assert len(os.listdir(tmp_path)) == 1
        workers.compile(_relu_job(block=512))
        assert len(os.listdir(tmp_path)) == 2 and len(workers.started) == 1
        with pytest.raises(RuntimeError, match="no attribute 'no_such_kernel'"):
            workers.compile(_relu_job("no_such_kernel"))
        workers.compile(_relu_job(block=256))     # a failed job leaves the worker usable
        assert len(os.listdir(tmp_path)) == 3
        workers.started[0].kill()                 # a worker that dies is replaced
        with pytest.raises(EOFError):
            workers.compile(_relu_job(block=128))
        workers.compile(_relu_job(block=128))
        assert len(os.listdir(tmp_path)) == 4 and len(workers.started) == 1
        with pytest.raises(TypeError):            # a job that does not pickle
            workers.compile(_relu_job() + (threading.Lock(),))
        assert len(workers.started) == 1 and workers.started[0].poll() is None
    finally:
        workers.close()
    assert not workers.started


class _FakeKernel:
    def __init__(self, seconds):
        self.seconds, self.calls = seconds, 0
        self.compile = self._compile

    def _compile(self, src, target=None, options=None):
        self.calls += 1
        time.sleep(self.seconds)
        return ("compiled", src)


def _src():
    fn = SimpleNamespace(__module__="tinysn.kernels.act", __name__="_relu_fwd_kernel")
    return SimpleNamespace(fn=fn, signature=RELU_SIGNATURE, constants={(3,): 64}, attrs={})


def test_workers_start_only_after_a_compile_proves_the_cache_cold(monkeypatch):
    jobs = []
    monkeypatch.setattr(cp, "_workers", lambda count: SimpleNamespace(compile=jobs.append))
    warm = _FakeKernel(0.0)
    with cp.compiling_in_processes([warm], 4):
        for _ in range(3):
            assert warm.compile(_src(), target="t", options={})[0] == "compiled"
    assert jobs == [] and warm.calls == 3                 # disk-cache hits: no worker
    assert warm.compile == warm._compile                   # restored after the block
    cold = _FakeKernel(cp.COLD_COMPILE_S + 0.05)
    with cp.compiling_in_processes([cold], 4):
        cold.compile(_src(), target="t", options={})       # slow: the cache is cold
        cold.compile(_src(), target="t", options={"num_warps": 4})
    assert len(jobs) == 1 and jobs[0][0:2] == ("tinysn.kernels.act", "_relu_fwd_kernel")
    assert jobs[0][5:] == ("t", {"num_warps": 4}) and cold.calls == 2   # then here, cached


def test_a_worker_failure_falls_back_to_compiling_here(monkeypatch):
    def broken(job):
        raise RuntimeError("worker died")
    monkeypatch.setattr(cp, "_workers", lambda count: SimpleNamespace(compile=broken))
    monkeypatch.setattr(cp, "COLD_COMPILE_S", -1.0)        # every compile counts as cold
    kernel = _FakeKernel(0.0)
    with cp.compiling_in_processes([kernel], 2):
        assert kernel.compile(_src(), target="t")[0] == "compiled"
        assert kernel.compile(_src(), target=None)[0] == "compiled"   # no target: no worker
    assert kernel.calls == 2


def test_process_count_reads_the_environment(monkeypatch):
    monkeypatch.delenv("TINYSN_COMPILE_PROCESSES", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert cp.process_count() == (os.cpu_count() or 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(2 * (os.cpu_count() or 1)))   # torchrun ranks
    assert cp.process_count() == 1
    monkeypatch.setenv("TINYSN_COMPILE_PROCESSES", "0")
    assert cp.process_count() == 0
    monkeypatch.setenv("TINYSN_COMPILE_PROCESSES", "many")
    with pytest.raises(ValueError, match="TINYSN_COMPILE_PROCESSES must be a count"):
        cp.process_count()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_every_tinysn_kernel_is_found_for_the_workers():
    from tinysn.kernels import act, conv

    found = cp.tinysn_kernels()
    assert act._relu_fwd_kernel in found and conv._conv_fwd_kernel in found
    assert len(found) == len(set(found))


def test_a_wrapper_kept_after_the_block_compiles_here(monkeypatch):
    """triton 3.6 copies `compile` into a function when it first runs: one that first ran
    inside the block keeps the wrapper, which outside a block is the original."""
    jobs = []
    monkeypatch.setattr(cp, "_workers", lambda count: SimpleNamespace(compile=jobs.append))
    owner = SimpleNamespace(compile=_FakeKernel(cp.COLD_COMPILE_S + 0.05).compile)
    with cp.compiling_in_processes([owner], 2):
        kept = owner.compile
        kept(_src(), target="t")
        kept(_src(), target="t")
    assert len(jobs) == 1
    kept(_src(), target="t")
    assert len(jobs) == 1 and kept.tinysn_original is owner.compile
