"""bench/common.Runner, the timing harness of the kernel benchmarks (run on the CPU here with a
fake timer; on the GPU it times with triton's do_bench), its results writer, and
bench/train.py's CPU path."""
import json

import pytest
import torch

import tinysn as sn

from bench import common
from tinysn.testing import every_layer_net


def test_runner_rows_rates_and_errors():
    lines = []
    times = iter([2.0, 4.0, 1.0, 3.0])      # tinysn ms, torch ms, then the second pair
    r = common.Runner(lines.append, lambda row: row["kernel"], timer=lambda fn: next(times))
    r.copy_gbps = 10.0
    x = torch.ones(4)
    row = r.run("k.bw", "a", "4", lambda: x.add_(1), lambda: None, nbytes=8e6, moved=16e6,
                check=lambda: 0.5)
    assert row["ratio"] == 2.0 and row["rel_err"] == 0.5
    assert row["gbps"] == 4.0 and row["torch_gbps"] == 2.0 and row["moved_gbps"] == 8.0
    assert row["frac_of_copy"] == 0.4
    row = r.run("k.mm", "b", "4", lambda: None, lambda: None, flops=3e9)
    assert row["tflops"] == 3.0 and row["torch_tflops"] == 1.0 and "gbps" not in row

    def broken():
        raise ValueError("bad shape")
    row = r.run("k.err", "c", "4", broken, lambda: None, nbytes=1)
    assert row["error"] == "ValueError: bad shape" and "ratio" not in row
    assert lines == ["k.bw", "k.mm", "k.err"] and len(r.rows) == 3


def test_runner_graph_times_and_capture_failures():
    times = iter([2.0, 4.0, 0.5, 1.0, 1.0, 1.0, 0.25])
    fail = {"on": False}

    def graph_timer(fn):
        if fail["on"]:
            raise RuntimeError("capture failed")
        return next(times)
    r = common.Runner(lambda line: None, str, timer=lambda fn: next(times),
                      graph_timer=graph_timer)
    r.copy_gbps = 10.0
    row = r.run("k", "a", "4", lambda: None, lambda: None, nbytes=8e6)
    assert row["tinysn_graph_ms"] == 0.5 and row["torch_graph_ms"] == 1.0
    assert row["graph_ratio"] == 2.0 and row["graph_frac_of_copy"] == 1.6
    fail["on"] = True
    row = r.run("k", "b", "4", lambda: None, lambda: None, nbytes=8e6)
    assert row["ratio"] == 1.0 and row["graph_error"] == "RuntimeError: capture failed"


def test_kernels_groups_rerun_keeps_other_rows(tmp_path):
    from bench import kernels
    rows = [{"kernel": "conv.forward", "shape": "a"}, {"kernel": "bn.forward", "shape": "b"},
            {"kernel": "sgd.update", "shape": "c"}, {"kernel": "misc", "error": "boom"}]
    assert [kernels.group_of(r) for r in rows] == ["conv", "norm", "misc", "misc"]
    assert not kernels.complete(rows)                 # a group failed as a whole
    assert kernels.complete(rows[:3])
    assert not kernels.complete(rows[:2])             # misc missing
    path = tmp_path / "k.json"
    path.write_text(json.dumps({"rows": rows}))
    assert kernels.kept_rows(str(path), ["misc"]) == rows[:2]
    assert kernels.kept_rows(str(tmp_path / "none.json"), ["misc"]) == []


def test_write_puts_the_envelope_beside_the_payload_and_only_where_asked(tmp_path):
    assert common.write(None, {"rows": [1]}) is None          # no --out: nothing written
    path = tmp_path / "sub" / "r.json"
    assert common.write(str(path), {"rows": [1], "batch": 32}) == str(path)
    data = json.loads(path.read_text())
    assert set(data["environment"]) == {"gpu", "torch", "triton", "cudnn", "python", "date",
                                        "command"}
    assert data["environment"]["torch"] == torch.__version__
    assert common.read(str(path)) == {"rows": [1], "batch": 32}
    assert common.read(str(tmp_path / "absent.json")) == {}
    with pytest.raises(ValueError, match="environment"):
        common.write(str(path), {"environment": {}})
    with pytest.raises(Exception, match="must name a .json file"):
        common.write(str(tmp_path / "r.txt"), {"rows": []})
    assert not (tmp_path / "r.txt").exists()


def test_train_bench_smoke_on_the_cpu(tmp_path):
    """bench/train.py's CPU path: the same net and SGD settings on both sides give the same
    losses; the JSON holds each configuration, the best and the ratio to it."""
    from bench import train
    out = tmp_path / "train.json"
    train.main(["--model", "lenet", "--batch", "2", "--steps", "1", "--warmup", "1",
                "--rounds", "1", "--out", str(out)])
    run = json.loads(out.read_text())
    assert run["torch_compile"].startswith("skipped")
    assert [r["config"] for r in run["pytorch"]] == ["eager NCHW", "eager channels-last"]
    best = max(run["pytorch"], key=lambda r: r["images_per_s"])
    assert run["pytorch_best"] == best["config"]
    assert run["pytorch_best_images_per_s"] == best["images_per_s"]
    eager, graph = run["tinysn"]
    assert eager["peak_equals_plan"] and "CUDA" in graph["refused"]
    assert eager["ratio_to_best"] == eager["images_per_s"] / best["images_per_s"]
    assert eager["images_per_s"] == pytest.approx(2 / eager["seconds"])
    table = train.table_rows(run)
    assert table[2].startswith(f'| lenet, tinysn "all", eager | {eager["images_per_s"]:,.0f} |')
    assert table[3].startswith('| lenet, tinysn "all", CUDA graph | refused | | | cuda_graph')
    for row in run["pytorch"]:
        assert torch.allclose(torch.tensor(eager["losses"]), torch.tensor(row["losses"]),
                              rtol=1e-4)
    assert eager["fuse_bn_relu"] is True            # the planner's default


def test_train_bench_plans_batch_norm_relus_apart_when_asked(tmp_path):
    from bench import train
    out = tmp_path / "apart.json"
    train.main(["--model", "lenet", "--batch", "2", "--steps", "1", "--warmup", "1",
                "--rounds", "1", "--no-compile", "--no-fuse-bn-relu", "--out", str(out)])
    run = json.loads(out.read_text())
    eager, graph = run["tinysn"]
    assert eager["fuse_bn_relu"] is False and eager["peak_equals_plan"]
    assert train.table_rows(run)[3].startswith(
        '| lenet, tinysn "all", CUDA graph, batch norms\' ReLUs apart | refused |')


def test_summary_takes_the_fastest_pytorch_over_runs_and_leaves_a_b_rows_out():
    """train.py --summary: one row per model over its files; the PyTorch reference is the
    fastest configuration in any of them, tinysn's cells its default-option rows only (an
    A/B run's turned-off option is not the default build), and an untimed torch.compile or
    an unreached tinysn row is named."""
    from bench import train

    def run(pytorch, tinysn, model="resnet50"):
        return {"model": model, "pytorch": [{"config": c, "images_per_s": v}
                                            for c, v in pytorch.items()],
                "tinysn": [{"policy": "all", "cuda_graph": g, "images_per_s": v, **flags}
                           for g, v, flags in tinysn]}
    runs = [run({"eager NCHW": 100, "eager channels-last": 200, "torch.compile": 150},
                [(False, 50, {})]),
            run({"eager NCHW": 120}, [(False, 40, {}), (True, 190, {})]),
            run({"eager channels-last": 300}, [(True, 400, {"fuse_bn_add": False})]),
            run({"eager NCHW": 10}, [(False, 5, {})], model="vgg16")]
    assert train.summary_rows(runs) == [
        "| ResNet-50 | 300 (eager channels-last) | 190 (0.63x) | 50 (0.17x) |",
        "| VGG16 | 10 (eager NCHW; eager channels-last not timed; torch.compile not timed) "
        "| not reached | 5 (0.50x) |"]


def test_timed_steps_run_with_older_objects_frozen_and_count_collections():
    """train.timed freezes what was alive before the timed steps (a full collection then
    does not walk torch.compile's heap) and reports the seconds collections took."""
    import gc

    from bench import train
    seen, junk = [], [[] for _ in range(1000)]

    def step():
        seen.append(gc.get_freeze_count())
        cycle = []
        cycle.append(cycle)          # garbage only a collection frees
        gc.collect()
        return 0.0
    row = train.timed(step, torch.device("cpu"), warmup=1, steps=2)
    assert seen[0] == 0 and min(seen[1:]) >= len(junk)      # frozen for the timed steps only
    assert gc.get_freeze_count() == 0
    assert 0 < row["gc_s"] <= row["seconds"]


def test_timed_steps_take_the_median_round():
    """With --rounds, each round of steps is one span; the figure is the median round's."""
    import time

    from bench import train
    waits = iter([0.0, 0.03, 0.03, 0.0, 0.0, 0.01, 0.01])   # warm-up, then three rounds of 2

    def step():
        time.sleep(next(waits))
        return 0.0
    row = train.timed(step, torch.device("cpu"), warmup=1, steps=2, rounds=3)
    first, second, third = row["round_ms_per_step"]
    assert first >= 30 and second < 10 <= third < 30
    assert row["ms_per_step"] == third and len(row["losses"]) == 7


def test_runtime_memory_puts_the_pool_peak_beside_the_plan_and_the_process():
    """A bench's memory fields for a Runtime: the pool's measured peak (equal to the plan's
    after a step), the arena's size, and the process's device peak (None on the CPU)."""
    net = every_layer_net()
    rt = sn.Runtime(net, "64MiB", "all", device="cpu")
    rt.step(*sn.data.synthetic(net))
    record = common.runtime_memory(rt)
    assert record == {"arena_bytes": rt.plan.capacity, "pool_peak_bytes": rt.plan.peak_bytes,
                      "planned_peak_bytes": rt.plan.peak_bytes, "process_peak_bytes": None}
    assert 0 < record["pool_peak_bytes"] <= record["arena_bytes"] <= 64 << 20
