"""bench/host_probe.py: a CPU smoke run records every round's probes and steps, and the
summary's ranges, multiples and correlations come from those rounds."""
import json

import numpy as np
import pytest

from bench import host_probe


def test_smoke_run_records_every_round_and_summarises_them(tmp_path):
    out = tmp_path / "probe.json"
    result = host_probe.main(["--models", "lenet", "--batch", "2", "--rounds", "3",
                              "--steps", "1", "--out", str(out)])
    assert json.loads(out.read_text())["rounds"] == result["rounds"]
    rounds, summary = result["rounds"], result["summary"]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert all(r["bare_launch_s"] > 0 and r["python_loop_s"] > 0 and r["lenet_step_s"] > 0
               for r in rounds)
    steps = [r["lenet_step_s"] for r in rounds]
    assert summary["lenet_step_s"] == {"min": min(steps), "max": max(steps)}
    n = result["layer_steps"]["lenet"]
    assert n > 0
    multiples = [r["lenet_step_s"] / n / r["bare_launch_s"] for r in rounds]
    assert summary["lenet_per_layer_step_in_probes"]["max"] == pytest.approx(max(multiples))
    want = np.corrcoef([r["bare_launch_s"] for r in rounds], steps)[0, 1]
    assert summary["lenet_correlation_with_bare_launch_s"] == pytest.approx(want)
    memory = result["memory"]          # the pool's peak per model; no device peak on the CPU
    assert memory["process_peak_bytes"] is None
    lenet = memory["models"]["lenet"]
    assert 0 < lenet["pool_peak_bytes"] == lenet["planned_peak_bytes"] <= lenet["arena_bytes"]


@pytest.mark.parametrize("argv", [["--models", "nope"], ["--rounds", "0"], ["--models", ""]])
def test_bad_arguments_are_refused_before_anything_runs(argv, capsys):
    with pytest.raises(SystemExit):
        host_probe.main(argv)
    assert "--models takes names of" in capsys.readouterr().err
