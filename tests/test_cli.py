"""The command line: every bad value is one line on stderr, exit status 2, before any work;
what it prints and writes when the values are good."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tinysn as sn
from tinysn import cli
from tinysn.sched.plan import Launch, Offload, Prefetch

ROOT = Path(__file__).resolve().parents[1]

# (arguments, text the one error line must contain: the flag and a valid example)
BAD = [
    ("train --batch 0", ["--batch", "e.g. --batch 32"]),
    ("train --batch -4", ["--batch", "e.g. --batch 32"]),
    ("plan --batch 0", ["--batch", "e.g. --batch 32"]),
    ("train --memory abc", ["--memory", "e.g. --memory 12GiB"]),
    ("train --memory -1", ["--memory", "e.g. --memory 12GiB"]),
    ("train --memory 12G", ["--memory", "12GiB"]),
    ("train --memory 1e9", ["--memory", "e.g. --memory 12GiB"]),
    ("train --memory 0.5", ["--memory", "whole number", "e.g. --memory 12GiB"]),
    ("train --memory 0", ["--memory", "e.g. --memory 12GiB"]),
    ("plan --memory 12G", ["--memory", "12GiB"]),
    ("train --host-memory abc", ["--host-memory", "e.g. --host-memory 60GiB"]),
    ("train --host-memory 12G", ["--host-memory", "12GiB"]),
    ("plan --host-memory -1", ["--host-memory", "e.g. --host-memory 60GiB"]),
    ("train --bucket-bytes 0", ["--bucket-bytes", "e.g. --bucket-bytes 25MiB"]),
    ("train --bucket-bytes 25M", ["--bucket-bytes", "e.g. --bucket-bytes 25MiB"]),
    ("train --seed -1", ["--seed", "e.g. --seed 0"]),
    ("train --steps -1", ["--steps", "e.g. --steps 20"]),
    ("train --steps 0", ["--steps", "e.g. --steps 20"]),
    ("train --steps two", ["--steps", "e.g. --steps 20"]),
    ("train --lr -0.1", ["--lr", "e.g. --lr 0.05"]),
    ("train --lr nan", ["--lr", "e.g. --lr 0.05"]),
    ("train --momentum x", ["--momentum", "e.g. --momentum 0.9"]),
    ("train --weight-decay inf", ["--weight-decay", "e.g. --weight-decay"]),
    ("train --model nosuchnet", ["--model", "lenet"]),
    ("train --policy none", ["--policy", "all"]),
    ("train --memory 10TiB --device cpu", ["--memory", "RAM", "e.g. --memory"]),
    ("train --host-memory 10TiB --device cpu", ["--host-memory", "RAM", "e.g. --host-memory"]),
    ("train --trace /no/such/dir/t.json", ["--trace", "does not exist", "e.g. --trace out.json"]),
    ("train --trace trace.txt", ["--trace", ".json", "e.g. --trace out.json"]),
    ("train --trace {tmp}/sub.json", ["--trace", "is a directory", "e.g. --trace out.json"]),
    ("plan --json /no/such/dir/p.json", ["--json", "does not exist", "e.g. --json out.json"]),
    ("plan --plot /no/such/dir/p.png", ["--plot", "does not exist", "e.g. --plot out.png"]),
    ("plan --plot noext", ["--plot", ".png", "e.g. --plot out.png"]),
    ("train --model alexnet --data digits", ["--data digits", "--model lenet"]),
    ("train --cuda-graph --device cpu", ["--cuda-graph", "GPU", "--device cpu"]),
    ("train --cuda-graph --trace {tmp}/t.json", ["--trace", "--cuda-graph"]),
    ("train --memory 300KiB --device cpu", ["does not fit", "step", "bytes", "--memory",
                                           "--batch"]),
    ("plan --model alexnet --batch 8 --memory 1MiB --policy baseline",
     ["does not fit", "To fit, raise --memory to"]),
    ("trace /no/such/dir/t.json", ["'/no/such/dir/t.json' is not a file",
                                   "e.g. tinysn trace t.json"]),
    ("trace {tmp}/sub.json", ["is not a file", "e.g. tinysn trace t.json"]),
    ("trace {tmp}/sub.json --plot /no/such/dir/p.png", ["--plot", "does not exist"]),
    ("trace {tmp}/sub.json --plot noext", ["--plot", ".png", "e.g. --plot out.png"]),
    ("bogus", ["bogus", "train"]),
    ("", ["command"]),
]


def run_main(argv, capsys):
    """cli.main(argv) -> (exit status, stdout, stderr)."""
    status = cli.main(argv)
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize("args,expected", BAD, ids=[a or "(none)" for a, _ in BAD])
def test_bad_value_is_one_line_exit_2_before_any_work(args, expected, tmp_path, capsys):
    (tmp_path / "sub.json").mkdir()
    argv = args.replace("{tmp}", str(tmp_path)).split()
    status, out, err = run_main(argv, capsys)
    assert status == 2
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    for text in expected:
        assert text in err, err
    assert out == ""                     # nothing planned, trained or written
    assert [p.name for p in tmp_path.iterdir()] == ["sub.json"]


def test_no_gpu_refuses_device_cuda(capsys):
    if __import__("torch").cuda.is_available():
        pytest.skip("a GPU is present")
    status, _, err = run_main(["train", "--device", "cuda"], capsys)
    assert status == 2 and "--device cpu" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("flags, graphed", [
    ([], True), (["--no-cuda-graph"], False), (["--cuda-graph"], True),
    (["--trace", "{tmp}/t.json"], False), (["--device", "cpu"], False)])
def test_cuda_graph_is_the_default_on_a_gpu_unless_traced(flags, graphed, tmp_path,
                                                          monkeypatch):
    """On a GPU the train command replays its steps as a CUDA graph unless told not to or
    asked for a trace (which records eager steps); on the CPU it never does."""
    monkeypatch.setattr(cli, "_default_device", lambda: "cuda")
    monkeypatch.setattr(cli, "_check_room", lambda *a: None)
    args = cli._parser().parse_args(["train"] + [f.format(tmp=tmp_path) for f in flags])
    cli._check_args(args)
    assert args.cuda_graph is graphed


@pytest.mark.parametrize("command", [["plan"], ["trace", "t.json"]])
def test_missing_matplotlib_is_one_line(command, monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # import matplotlib fails
    status, out, err = run_main(command + ["--plot", str(tmp_path / "t.png")], capsys)
    assert status == 2 and out == ""
    assert "--plot needs matplotlib" in err and len(err.splitlines()) == 1


def test_unwritable_output_directory(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if __import__("os").access(locked, __import__("os").W_OK):
        pytest.skip("running as a user who can write anywhere")
    status, _, err = run_main(["plan", "--json", str(locked / "p.json")], capsys)
    assert status == 2 and "not writable" in err


def test_process_exit_is_one_line_without_traceback():
    """The same through the interpreter: `python -m tinysn` exits 2 with one line."""
    result = subprocess.run([sys.executable, "-m", "tinysn", "train", "--steps", "0"],
                            capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "tinysn train: error: argument --steps: must be at least 1, got 0 (e.g. --steps 20)"]


def test_help_shows_defaults_and_policies(capsys):
    status, out, _ = run_main(["train", "--help"], capsys)
    assert status == 0
    assert "(default: 512MiB)" in out and "(default: all)" in out
    for policy in sn.POLICIES:
        assert f"\n  {policy} " in out
    assert "(default: None)" not in out


def test_version_names_tinysn_torch_and_triton(capsys):
    status, out, _ = run_main(["--version"], capsys)
    assert status == 0 and out.startswith("tinysn ") and "torch" in out and "triton" in out


def test_console_script_is_declared():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["tinysn"] == "tinysn.cli:main"
    assert any(dep.startswith("scikit-learn") for dep in project["dependencies"])


def test_plan_every_marks_what_does_not_fit_and_what_would(capsys):
    """AlexNet at batch 200 under 2 GiB: baseline (3.5 GiB) does not fit, the others do; its
    row gives the smallest cap (which fits, while 1 MiB less does not) and a batch that plans
    where one more does not (found by bisection in a few plans)."""
    status, out, _ = run_main(["plan", "--model", "alexnet", "--batch", "200",
                               "--memory", "2GiB"], capsys)
    assert status == 0
    lines = out.splitlines()
    rows = dict(line.strip().split(":", 1) for line in lines if not line.startswith(" " * 10))
    assert set(rows) == set(sn.POLICIES)
    # a policy that moves bytes is followed by where its predicted step idles
    after_offload = lines[[i for i, line in enumerate(lines) if line.strip().startswith(
        "offload:")][0] + 1]
    assert after_offload.strip().startswith("compute stream idle (waiting for copies or")
    assert rows["baseline"].startswith(" does not fit. To fit, raise --memory to ")
    assert all("peak" in rows[p] for p in sn.POLICIES if p != "baseline")
    largest = int(rows["baseline"].split("--batch to ")[1].rstrip("."))
    assert 0 < largest < 200                      # it plans and one more does not
    sn.plan(sn.models.alexnet(batch=largest), "2GiB", "baseline")
    with pytest.raises(sn.OutOfMemory):
        sn.plan(sn.models.alexnet(batch=largest + 1), "2GiB", "baseline")


@pytest.mark.parametrize("model,batch", [(sn.models.alexnet, 16), (sn.models.lenet, 4)])
def test_smallest_cap_fits_and_is_within_0_1_percent(model, batch):
    cap = cli.smallest_cap(model, batch, "liveness")
    sn.plan(model(batch=batch), cap, "liveness")
    with pytest.raises(sn.OutOfMemory):
        sn.plan(model(batch=batch), int(cap * 0.999) - 1024, "liveness")


def test_advice_values_are_valid_memory_flags():
    for nbytes, text in [(1000, "1KiB"), (1025, "2KiB"), (2**20 + 1, "2MiB"),
                         (12 * 2**30, "12.0GiB"), (12 * 2**30 + 1, "12.1GiB")]:
        assert cli._flag_bytes(nbytes) == text
        assert sn.parse_bytes(text) >= nbytes


def test_plan_json_dash_is_stdout_only(capsys):
    status, out, err = run_main(["plan", "--model", "alexnet", "--batch", "8", "--json", "-"],
                                capsys)
    assert status == 0
    figures = json.loads(out)                    # stdout is the JSON and nothing else
    assert set(figures) == set(sn.POLICIES) and all(f["fits"] for f in figures.values())
    assert "baseline" in err                     # the table went to stderr
    # each policy's predicted H200 step, as the planner's model gives it, in JSON and table
    net = sn.models.alexnet(batch=8)
    for policy in ("baseline", "all"):
        seconds = sn.plan(net, "12GiB", policy).predicted_step_s
        assert figures[policy]["predicted_step_s"] == pytest.approx(seconds)
    assert f"H200 step {figures['all']['predicted_step_s']:.3f} s" in err
    assert set(figures["all"]["predicted_compute_waits_s"]) <= {"forward", "recompute",
                                                                "backward"}


def test_plan_plot_draws_the_cap(tmp_path, capsys):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.rcParams["svg.fonttype"] = "none"            # keep text as text in the SVG
    svg = tmp_path / "timeline.svg"
    status, out, _ = run_main(["plan", "--model", "alexnet", "--batch", "8", "--memory",
                               "1GiB", "--plot", str(svg)], capsys)
    assert status == 0 and str(svg) in out
    assert "cap 1.0 GiB" in svg.read_text()


def test_cache_command_shows_and_clears(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TINYSN_CACHE_DIR", str(tmp_path / "c"))
    from tinysn import cache
    cache.store("autotune", ["k"], {"x": 1})
    status, out, _ = run_main(["cache"], capsys)
    assert status == 0 and "1 files" in out and str(tmp_path / "c") in out
    status, out, _ = run_main(["cache", "--clear"], capsys)
    assert status == 0 and "removed 1 files" in out
    assert cache.lookup("autotune", ["k"]) is None


def test_train_writes_a_chrome_trace_and_progress_on_stderr(tmp_path, capsys):
    """The smallest net, two steps, policy offload (so copies appear): exit 0, the bar on
    stderr with images/s after the warm-up step, and a trace holding every kernel and copy
    of one step."""
    trace = tmp_path / "trace.json"
    status, out, err = run_main(["train", "--model", "lenet", "--data", "synthetic",
                                 "--batch", "2", "--steps", "2", "--memory", "8MiB",
                                 "--policy", "offload", "--device", "cpu",
                                 "--trace", str(trace)], capsys)
    assert status == 0, err
    assert "img_s=warm-up" in err and "images/s after 1 warm-up step" in out
    assert "it/s" not in err and "%|" not in out             # progress stays on stderr
    assert "100%" in err and "2/2" in err                    # the bar counted both steps
    events = json.loads(trace.read_text())["traceEvents"]
    plan = sn.plan(sn.models.lenet(batch=2), "8MiB", "offload", momentum=0.9)
    kernels = sum(isinstance(op, Launch) for s in plan.steps for op in s.ops)
    copies = sum(isinstance(op, (Offload, Prefetch)) for s in plan.steps for op in s.ops)
    spans = [e for e in events if e["ph"] == "X"]
    assert sum(e["tid"] == 0 for e in spans) == kernels
    assert sum(e["tid"] in (1, 2) for e in spans) == copies > 0
    meta = json.loads(trace.read_text())["otherData"]
    assert (meta["model"], meta["batch"], meta["policy"]) == ("lenet", 2, "offload")
    assert f"busy: compute {meta['busy']['compute']:.1%}" in out


@pytest.mark.gpu
def test_gpu_cap_above_free_memory_is_one_line(capsys):
    status, out, err = run_main(["train", "--device", "cuda", "--memory", "10TiB"], capsys)
    assert status == 2 and out == "" and "GPU memory free" in err and len(err.splitlines()) == 1


@pytest.mark.gpu
def test_gpu_train_notice_rate_and_trace(tmp_path, monkeypatch, capsys):
    """On the GPU: the tuning notice names the cache, images/s excludes the warm-up step,
    and the trace holds CUDA-event times of every kernel and copy of one step."""
    monkeypatch.setenv("TINYSN_CACHE_DIR", str(tmp_path / "cache"))
    trace = tmp_path / "trace.json"
    status, out, err = run_main(["train", "--model", "lenet", "--data", "synthetic",
                                 "--batch", "8", "--steps", "3", "--memory", "64MiB",
                                 "--policy", "offload", "--device", "cuda",
                                 "--trace", str(trace)], capsys)
    assert status == 0, err
    assert f"compiling and tuning kernels for the first step (tuning cached in {tmp_path}" in err
    assert "images/s after 1 warm-up step" in out
    spans = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["tid"] for e in spans} == {0, 1, 2} and all(e["dur"] >= 0 for e in spans)


@pytest.mark.gpu
def test_gpu_train_cuda_graph_under_the_linear_schedule_is_the_eager_run(tmp_path, capsys):
    """The train command's default on a GPU, a CUDA graph, under the default schedule (a
    new rate every step, read from the pool: one capture serves them all) ends bitwise where
    the --no-cuda-graph run does, AlexNet's dropout masks included; the two checkpoints hold
    the same state."""
    from tinysn import checkpoint
    saved = {}
    for mode in ("eager", "graph"):
        saved[mode] = tmp_path / f"{mode}.safetensors"
        status, out, err = run_main(["train", "--model", "alexnet", "--data", "synthetic",
                                     "--batch", "4", "--steps", "6", "--memory", "2GiB",
                                     "--policy", "all", "--device", "cuda",
                                     "--save", str(saved[mode])]
                                    + (["--no-cuda-graph"] if mode == "eager" else []), capsys)
        assert status == 0, err
        assert ("replayed as a CUDA graph" in out) == (mode == "graph")
    eager, graph = (checkpoint.read(saved[mode])[0] for mode in ("eager", "graph"))
    assert eager.keys() == graph.keys()
    for name, value in eager.items():
        assert torch.equal(value, graph[name]), name
