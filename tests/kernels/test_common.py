"""The host arithmetic, argument and workspace checks every kernel module shares
(tinysn/kernels/_common.py)."""
import pytest
import torch

import tinysn  # noqa: F401  (interpreter switch before triton)
import triton
from tinysn.kernels import _common


def test_host_cdiv_and_next_power_of_2_agree_with_triton():
    """The launchers' plain-Python cdiv and next_power_of_2 give triton's values (triton's are
    constexpr functions, slow to call from host code)."""
    for a in range(0, 300):
        assert _common.next_power_of_2(a) == triton.next_power_of_2(a), a
        for b in (1, 3, 4, 64, 128, 1000):
            assert _common.cdiv(a, b) == triton.cdiv(a, b), (a, b)
    assert _common.cdiv(2 ** 40 + 1, 2 ** 20) == 2 ** 20 + 1
    assert _common.next_power_of_2(2 ** 33 + 1) == 2 ** 34


def test_pair_accepts_ints_and_pairs():
    assert _common.pair(3, "k", 1) == (3, 3)
    assert _common.pair((1, 7), "k", 1) == (1, 7)
    assert _common.pair([0, 2], "pad", 0) == (0, 2)


@pytest.mark.parametrize("bad,message", [(True, "pair of ints"), ((1, 2, 3), "pair of ints"),
                                         ((1, 2.0), "pair of ints"), ("3", "pair of ints"),
                                         ((0, 1), ">= 1"), (-1, ">= 1")])
def test_pair_rejects(bad, message):
    with pytest.raises(ValueError, match=f"conv: stride must be .*{message}|{message}"):
        _common.pair(bad, "conv: stride", 1)


def test_check_device_names_the_tensor():
    cpu, meta = torch.empty(2), torch.empty(2, device="meta")
    _common.check_device("op", cpu, a=cpu, b=None)
    with pytest.raises(ValueError, match="op: b is on meta, expected cpu"):
        _common.check_device("op", cpu, a=cpu, b=meta)


def test_check_no_overlap():
    buf = torch.zeros(10)
    _common.check_no_overlap("op", [("y", buf[:5])], [("x", buf[5:]), ("none", None)])
    _common.check_no_overlap("op", [("y", buf[:0])], [("x", buf)])        # empty: no memory
    with pytest.raises(ValueError, match="op: y overlaps x"):
        _common.check_no_overlap("op", [("y", buf[:5])], [("x", buf[4:])])
    with pytest.raises(ValueError, match="op: a overlaps b"):
        _common.check_no_overlap("op", [("a", buf[:3]), ("b", buf[2:])], [])


def test_checked_before_skips_the_tensor_checks_only_inside_its_block():
    """Inside `checked_before` (the Runtime's repeated training steps) the tensor checks
    return at once; outside, and after an error inside, they raise as always."""
    a, bad = torch.zeros(4), torch.zeros(4, dtype=torch.float64)
    checks = [lambda: _common.check_tensor("x", bad),
              lambda: _common.check_device("k", a, y=torch.zeros(4, device="meta")),
              lambda: _common.check_no_overlap("k", [("y", a)], [("x", a)])]
    for check in checks:
        with pytest.raises(ValueError):
            check()
    with pytest.raises(RuntimeError, match="inside"):
        with _common.checked_before():
            for check in checks:
                check()
            raise RuntimeError("an error inside the block")
    for check in checks:
        with pytest.raises(ValueError):
            check()


def test_float_workspace_views_the_first_bytes():
    raw = torch.zeros(64, dtype=torch.uint8)
    ws = _common.float_workspace("op", raw, 16, raw.device)
    assert ws.dtype == torch.float32 and ws.numel() == 4 and ws.data_ptr() == raw.data_ptr()
    f = torch.zeros(8)
    assert _common.float_workspace("op", f, 12, f.device).numel() == 3


@pytest.mark.parametrize("ws,message", [
    (None, "contiguous 1-D"), (torch.zeros(4, 4), "contiguous 1-D"),
    (torch.zeros(8, dtype=torch.int32), "contiguous 1-D"), (torch.zeros(8)[::2], "contiguous 1-D"),
    (torch.zeros(3), "too small: 12 bytes, need 16"),
    (torch.zeros(40, dtype=torch.uint8)[1:], "4-byte aligned"),
    (torch.zeros(8, device="meta"), "on meta, expected cpu")])
def test_float_workspace_rejects(ws, message):
    with pytest.raises(ValueError, match=f"op: .*{message}"):
        _common.float_workspace("op", ws, 16, torch.device("cpu"))


def test_dot_precision_is_per_call():
    assert _common.dot_precision() == "tf32"
    assert _common.dot_precision("ieee") == "ieee"
    assert not hasattr(_common, "set_precision")      # no module-wide default to change
    with pytest.raises(ValueError, match="precision"):
        _common.dot_precision("fp16")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiling_in_parallel_compiles_without_running():
    """Inside the block a direct launch (run) and an autotuned one (launch) compile every
    config and write nothing; afterwards both run from the compiled cache."""
    from tinysn.kernels import act, lrn
    from tinysn.kernels._common import compiling_in_parallel

    x = torch.randn(3000, device="cuda")
    y = torch.full_like(x, 7.0)
    xs = torch.randn(2, 5, 4, 4, device="cuda")
    ys = torch.full_like(xs, 7.0)
    with compiling_in_parallel(4):
        act.forward(x, y)
        lrn.forward(xs, ys, size=3, alpha=1e-4, beta=0.75, k=2.0)
    torch.cuda.synchronize()
    assert bool((y == 7).all()) and bool((ys == 7).all()), "a kernel ran inside the block"
    compiled = [len(k.device_caches[0][0]) for k in (act._relu_fwd_kernel,)]
    act.forward(x, y)
    assert torch.equal(y, x.clamp_min(0))
    assert [len(k.device_caches[0][0]) for k in (act._relu_fwd_kernel,)] == compiled
    lrn.forward(xs, ys, size=3, alpha=1e-4, beta=0.75, k=2.0)
    assert not bool((ys == 7).all())


def test_compile_only_launch_compiles_a_known_pick_alone(monkeypatch, tmp_path):
    """Inside compiling_in_parallel an autotuned launch whose tuning key has a pick (this
    process's, or the disk cache's in a new process) compiles that config alone, as the
    launch will run it untuned; an unknown key compiles every config, all of which tuning
    will run."""
    import triton.language as tl
    from tinysn import cache

    monkeypatch.setenv("TINYSN_CACHE_DIR", str(tmp_path))

    @triton.jit
    def fill(y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, 1.0, mask=offs < n)

    configs = [triton.Config({"BLOCK": b}) for b in (16, 32, 64)]
    tuner = triton.autotune(configs=configs, key=["n"])(fill)
    compiled = []
    monkeypatch.setattr(tuner.fn, "warmup", lambda *a, **kw: compiled.append(kw["BLOCK"]))
    monkeypatch.setattr(tuner, "warmup",
                        lambda *a, **kw: compiled.extend(c.kwargs["BLOCK"] for c in configs))
    args = (torch.zeros(100), 100)

    def grid(meta):
        return (triton.cdiv(100, meta["BLOCK"]),)
    _common._compile_configs(tuner, grid, args, {})
    assert compiled == [16, 32, 64]
    key = _common._launch_tuning_key(tuner, args, {})
    monkeypatch.setitem(_common._BY_TUNING_KEY, key, configs[1])
    compiled.clear()
    _common._compile_configs(tuner, grid, args, {})
    assert compiled == [32]
    _common._BY_TUNING_KEY.pop(key)
    cache.store("autotune", _common._disk_key(tuner, key[1]), _common._config_fields(configs[2]))
    compiled.clear()
    _common._compile_configs(tuner, grid, args, {})
    assert compiled == [64]
    assert _common._BY_TUNING_KEY.pop(key).kwargs == {"BLOCK": 64}    # remembered


class _FakeGPU:
    """A GPU as bench_ms sees it, on the host's clock: each call's kernel runs `kernel_s`,
    starting once the host has issued it and the GPU is free (after any held wait);
    events read the GPU's clock. `issue_s(pass)` is the host's time per call in each timed
    pass after the first three calls."""

    def __init__(self, kernel_s, issue_s, queue=None):
        self.kernel_s, self.issue_s, self.host, self.gpu = kernel_s, issue_s, 0.0, 0.0
        self.calls, self.holds, self.starts, self.queue = 0, [], [], queue

    def call(self):
        """Issue one call; with a launch queue of `queue` calls, the host waits at a full one
        until the GPU has started the call `queue` places back."""
        self.calls += 1
        self.host += self.issue_s(len(self.holds)) if self.calls > 3 else self.issue_s(0)
        if self.queue and len(self.starts) >= self.queue:
            self.host = max(self.host, self.starts[-self.queue])
        self.starts.append(max(self.gpu, self.host))
        self.gpu = self.starts[-1] + self.kernel_s

    def synchronize(self):
        self.host = max(self.host, self.gpu)

    def hold(self, seconds):
        self.holds.append(seconds)
        self.gpu = max(self.gpu, self.host) + seconds

    def event(self, **_):
        gpu = self

        class Event:
            def record(self):
                self.at = max(gpu.gpu, gpu.host)

            def elapsed_time(self, end):
                return (end.at - self.at) * 1e3

            def synchronize(self):
                pass
        return Event()


def test_bench_ms_holds_longer_when_a_loaded_host_issued_slower_than_the_hold(monkeypatch):
    """A kernel of 10 us that the host issues every 100 us, then, in the first held pass,
    every 400 us (a loaded host): that pass's wait runs out before the last call is issued,
    so bench_ms times the calls again behind a wait twice the issuing time, and reports the
    kernel's 10 us, not the host's pace."""
    gpu = _FakeGPU(kernel_s=1e-5, issue_s=lambda held: 4e-4 if held == 1 else 1e-4)
    monkeypatch.setattr(_common.torch.cuda, "Event", gpu.event)
    monkeypatch.setattr(_common.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(_common, "_hold_queue", gpu.hold)
    monkeypatch.setattr(_common.time, "perf_counter", lambda: gpu.host)
    ms = _common.bench_ms(gpu.call, rep_ms=2)
    assert len(gpu.holds) == 2 and gpu.holds[1] > 2 * gpu.holds[0]
    assert ms == pytest.approx(0.01)


def test_bench_ms_keeps_each_held_batch_inside_the_launch_queue(monkeypatch):
    """A kernel of 10 us that the host issues every 100 us, on a GPU whose launch queue holds
    200 calls (an H100 blocks the host after about a thousand launches; bench/timer_queue.py):
    100 ms of calls are 1000 calls, and queued behind one wait all calls past the 200th
    would bracket the host's 100 us. bench_ms queues `_QUEUED_CALLS` behind each wait, and
    reports the kernel's 10 us."""
    gpu = _FakeGPU(kernel_s=1e-5, issue_s=lambda held: 1e-4, queue=200)
    monkeypatch.setattr(_common.torch.cuda, "Event", gpu.event)
    monkeypatch.setattr(_common.torch.cuda, "synchronize", gpu.synchronize)
    monkeypatch.setattr(_common, "_hold_queue", gpu.hold)
    monkeypatch.setattr(_common.time, "perf_counter", lambda: gpu.host)
    ms = _common.bench_ms(gpu.call, rep_ms=100)
    assert ms == pytest.approx(0.01)
    assert len(gpu.holds) == 1000 // _common._QUEUED_CALLS + 1     # one wait per batch


@pytest.mark.gpu
@pytest.mark.timing
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rep_ms", [2, 300])
def test_bench_ms_times_the_gpu_not_a_slow_host(rep_ms):
    """A call that costs the host 300 us and the GPU a few: bench_ms reports the GPU's time
    (timed naively, every pair of events would bracket the host's 300 us). 300 ms of calls
    are 1000 calls, more than the GPU's launch queue holds behind one wait."""
    import time

    x = torch.randn(1024, device="cuda")

    def slow_launch():
        time.sleep(3e-4)
        x.mul_(1.0)

    assert _common.bench_ms(slow_launch, rep_ms=rep_ms) < 0.1


def test_config_hook_gives_descriptors_their_config_boxes():
    """A kernel that takes a TMA descriptor gets the box of its config from `config_hook`: on
    the autotuner's launch and on the later direct ones (`launch` keys its cache without the
    descriptor, and hands the kernel a copy with the box set, whatever box the caller's has)."""
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    @triton.jit
    def copy_rows(x_desc, y_ptr, n, BLOCK: tl.constexpr):
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = x_desc.load([tl.program_id(0) * BLOCK, 0])                    # [BLOCK, 4]
        tl.store(y_ptr + rows[:, None] * 4 + tl.arange(0, 4)[None, :], v, mask=(rows < n)[:, None])

    def boxes(nargs):
        nargs["x_desc"].block_shape = [nargs["BLOCK"], 4]

    cfg = triton.Config({"BLOCK": 8})
    tuner = _common.autotune([cfg], cfg, key=["n"], config_hook=boxes)(copy_rows)
    x = torch.randn(32, 4)
    for _ in range(2):
        desc = TensorDescriptor(x, [32, 4], [4, 1], [1, 4])
        y = torch.zeros(32, 4)
        _common.launch(tuner, lambda meta: (32 // meta["BLOCK"],), (desc, y, 32), {})
        assert torch.equal(y, x)
    assert desc.block_shape == [1, 4]           # the direct launch boxed a copy
