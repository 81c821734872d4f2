"""bench/host.py: on the CPU it times the walk and the launchers with the GPU's work stubbed,
runs no kernel while it does, and counts the plan it walked."""
import json

import pytest
from triton.runtime import interpreter

from bench import host
from tinysn.kernels import INTERPRET


@pytest.mark.skipif(not INTERPRET, reason="stubs the Triton interpreter (CPU)")
def test_times_the_walk_and_the_launchers_without_running_a_kernel(tmp_path, monkeypatch):
    ran = []
    real_run = interpreter.InterpretedFunction.run
    monkeypatch.setattr(interpreter.InterpretedFunction, "run",
                        lambda self, *a, **kw: (ran.append(self), real_run(self, *a, **kw)))
    before = interpreter.InterpretedFunction.run
    r = host.measure([1, 1, 1, 1], batch=2, policy="all", repeats=2)
    assert ran == []                                     # every kernel call was stubbed
    assert interpreter.InterpretedFunction.run is before            # ... and restored after
    assert 0 < r["layer_launches"] < r["operations"]
    assert r["plan_steps"] > 0
    # the launchers' Python is on top of the walk
    assert r["launchers_seconds_per_iteration"] > r["seconds_per_iteration"] > 0
    assert r["launchers_us_per_layer_launch"] == pytest.approx(
        r["launchers_seconds_per_iteration"] / r["layer_launches"] * 1e6)
    out = tmp_path / "host.json"
    monkeypatch.setattr("sys.argv", ["host.py", "--blocks", "1,1,1,1", "--repeats", "1",
                                     "--out", str(out)])
    host.main()
    assert json.loads(out.read_text())["blocks"] == [1, 1, 1, 1]
