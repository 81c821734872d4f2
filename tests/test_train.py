"""Real training: LeNet on scikit-learn's digits through the train command, on the CPU."""
import json

import pytest

from tinysn import cli


def test_lenet_learns_digits_to_95_percent(tmp_path, capsys):
    trace = tmp_path / "trace.json"
    assert cli.main(["train", "--model", "lenet", "--data", "digits", "--device", "cpu",
                     "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    accuracy = float(out.split("held-out accuracy ")[1].split("%")[0]) / 100
    assert accuracy >= 0.95, out[-2000:]
    events = json.loads(trace.read_text())["traceEvents"]      # a Chrome trace of a step
    assert {"X", "C"} <= {e["ph"] for e in events}


def test_plan_command_prints_every_policy_and_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "timeline.png"
    assert cli.main(["plan", "--model", "alexnet", "--batch", "8", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    for policy in ("baseline", "liveness", "offload", "recompute", "all"):
        assert policy in out
    assert png.stat().st_size > 10_000


def test_train_rejects_digits_for_other_models(capsys):
    assert cli.main(["train", "--model", "alexnet", "--data", "digits"]) == 2


def test_plan_command_takes_a_host_cap(capsys):
    """--host-memory reaches the planner: "offload" of AlexNet at batch 8 needs a few MiB of
    host arena, so 1 MiB fails (exit 2, the error names the host, no traceback) and 64 MiB
    plans."""
    assert cli.main(["plan", "--model", "alexnet", "--batch", "8", "--policy", "offload",
                     "--host-memory", "1MiB"]) == 2
    assert "host" in capsys.readouterr().err
    assert cli.main(["plan", "--model", "alexnet", "--batch", "8", "--policy", "offload",
                     "--host-memory", "64MiB"]) == 0
    assert "host arena" in capsys.readouterr().out


def test_cli_cuda_graph_refusals_exit_2(capsys):
    """--cuda-graph needs a GPU, under either schedule (the updates read the rate from the
    pool); the refusal is one line on stderr and exit status 2, before anything trains (a
    model with dropout is no refusal)."""
    from tinysn import cli
    base = ["train", "--data", "synthetic", "--steps", "1", "--batch", "2", "--memory",
            "64MiB", "--cuda-graph", "--device", "cpu"]
    for model in ("lenet", "alexnet"):              # alexnet's dropout is no refusal
        for schedule in ("linear", "constant"):
            assert cli.main(base + ["--schedule", schedule, "--model", model]) == 2
            err = capsys.readouterr().err
            assert "--cuda-graph" in err and "GPU" in err and "dropout" not in err
            assert len(err.splitlines()) == 1
