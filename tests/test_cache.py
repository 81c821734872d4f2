"""The on-disk cache: entries keyed by GPU, triton and torch; tuned configs reused across
processes by kernels' launch()."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from tinysn import cache
from tinysn.kernels import _common


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYSN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_location_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TINYSN_CACHE_DIR", str(tmp_path / "x"))
    assert cache.cache_dir() == tmp_path / "x"
    monkeypatch.delenv("TINYSN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "xdg" / "tinysn"


def test_store_lookup_clear(cache_root):
    key = [list(cache.device_key()), "kernel", [64, "torch.float32"]]
    assert cache.lookup("autotune", key) is None
    cache.store("autotune", key, {"BLOCK": 64})
    assert cache.lookup("autotune", key) == {"BLOCK": 64}
    assert cache.lookup("autotune", key[:-1] + [[128, "torch.float32"]]) is None
    assert cache.lookup("rankings", key) is None                   # kinds are separate
    assert cache.clear() == 1
    assert not cache_root.exists() and cache.lookup("autotune", key) is None


def test_unreadable_entry_is_a_miss(cache_root):
    cache.store("autotune", ["k"], 1)
    (entry,) = (cache_root / "autotune").iterdir()
    entry.write_text("{not json")
    assert cache.lookup("autotune", ["k"]) is None


def test_unwritable_cache_is_skipped(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("TINYSN_CACHE_DIR", str(blocker / "cache"))   # under a file: fails
    cache.store("autotune", ["k"], 1)
    assert cache.lookup("autotune", ["k"]) is None


def test_device_key_names_gpu_triton_and_torch():
    name, triton_version, torch_version = cache.device_key()
    assert triton_version == triton.__version__ and torch_version == torch.__version__
    assert name == (torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")


def _tuned_kernel(timings):
    """An autotuned add-one kernel over two configs whose benchmark reports `timings` in
    turn (the interpreter cannot time kernels); an exhausted iterator fails the tuning."""
    @triton.autotune(configs=[triton.Config({"B": 16}), triton.Config({"B": 32})], key=["n"],
                     do_bench=lambda call, quantiles: [next(timings)] * 3)
    @triton.jit
    def add_one(x, n, B: tl.constexpr):
        offs = tl.program_id(0) * B + tl.arange(0, B)
        mask = offs < n
        tl.store(x + offs, tl.load(x + offs, mask=mask) + 1, mask=mask)
    return add_one


def _launch(tuner, n):
    x = torch.zeros(n)
    _common.launch(tuner, lambda meta: (triton.cdiv(n, meta["B"]),), (x, n), {})
    return x


def test_tuned_config_is_stored_and_reused_by_a_fresh_process(cache_root, monkeypatch):
    """The first launch tunes (the second config is faster) and stores the pick; a new
    process (fresh in-memory tables, a fresh autotuner that cannot benchmark) launches the
    stored config without tuning, for the same shape, and tunes again for a new shape."""
    monkeypatch.setattr(_common, "_TUNED", {})
    monkeypatch.setattr(_common, "_BY_TUNING_KEY", {})
    first = _tuned_kernel(iter([2.0, 1.0]))
    assert torch.equal(_launch(first, 40), torch.ones(40))
    assert first.best_config.kwargs == {"B": 32}
    assert len(list((cache_root / "autotune").iterdir())) == 1

    monkeypatch.setattr(_common, "_TUNED", {})
    monkeypatch.setattr(_common, "_BY_TUNING_KEY", {})
    fresh = _tuned_kernel(iter([]))                        # tuning would raise StopIteration
    assert torch.equal(_launch(fresh, 40), torch.ones(40))
    assert _common._BY_TUNING_KEY[(id(fresh), (40, "torch.float32"))].kwargs == {"B": 32}
    with pytest.raises(StopIteration):
        _launch(fresh, 50)                                 # a new shape is not in the cache


@pytest.mark.gpu
def test_gpu_tuning_is_reused_by_a_second_process(tmp_path):
    """A real autotuned kernel (fc forward) tunes in the first process and not in the second:
    triton prints a line per tuning (TRITON_PRINT_AUTOTUNING), none when the config comes
    from tinysn's cache."""
    script = ("import torch; from tinysn.kernels import linear; "
              "x = torch.randn(64, 256, device='cuda'); w = torch.randn(128, 256, device='cuda'); "
              "y = torch.empty(64, 128, device='cuda'); linear.forward(x, w, None, y); "
              "torch.cuda.synchronize()")
    env = {**os.environ, "TINYSN_CACHE_DIR": str(tmp_path), "TRITON_PRINT_AUTOTUNING": "1"}
    env.pop("TINYSN_AUTOTUNE", None)
    root = Path(__file__).resolve().parents[1]
    runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                           text=True, cwd=root, timeout=300) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr + runs[1].stderr
    assert "Triton autotuning" in runs[0].stdout
    assert list((tmp_path / "autotune").iterdir())
    assert "Triton autotuning" not in runs[1].stdout
