"""bench/oversub.py: the batch ladder, the PCIe floor, the checkpointed twin against the plain
one, the PyTorch largest-batch search, argument checks, and a CPU smoke run of the whole
script on LeNet under a cap small enough that its largest batch moves bytes."""
import json

import pytest
import torch
from hypothesis import given, settings

import tinysn.testing as snt
from bench import oversub

ROW_KEYS = {"model", "batch", "images_per_s", "no_move_images_per_s", "fraction",
            "pcie_floor_s", "bound_by", "bytes_moved_per_step", "process_peak_bytes",
            "peak_equals_plan", "bytes_to_host", "bytes_to_device", "predicted_step_s",
            "model_bound_by", "seconds_per_step", "predicted_compute_waits_s",
            "recomputed_steps", "speed_centric_everywhere", "launch_probe_s",
            "timed_launch_probe_s"}
# LeNet's largest batch under 151,552 B is 8 where its max pools store no argmaxes, and that
# plan copies 69,632 B each step (with them, 9 plans unmoved: LeNet at its largest batch
# then moves nothing under any cap, so the smoke run plans without them); three timed steps
# per row, as one step on a busy 2-core CI machine once put the moving run at 1.52x the
# no-move run's speed
SMOKE = ["--models", "lenet", "--memory", "153600", "--reference", "64MiB", "--first", "4",
         "--steps", "3", "--batches", "lenet=8", "--no-store-argmaxes"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One CPU run of the script: its JSON, its plot and its --out path."""
    folder = tmp_path_factory.mktemp("oversub")
    out, png = folder / "oversub.json", folder / "oversub.png"
    oversub.main(SMOKE + ["--out", str(out), "--plot", str(png)])
    return json.loads(out.read_text()), png, out


def test_ladder_doubles_from_the_first_batch_to_the_largest():
    assert oversub.ladder(32, 897) == [32, 64, 128, 256, 512, 897]
    assert oversub.ladder(32, 64) == [32, 64]
    assert oversub.ladder(32, 32) == [32]
    assert oversub.ladder(32, 20) == [20]


def test_pcie_floor_adds_both_directions_and_bounds_the_step():
    bandwidth = {"to_host_gb_per_s": 50.0, "to_device_gb_per_s": 25.0}
    floor = oversub.pcie_floor_s(100e9, 50e9, bandwidth)
    assert floor == pytest.approx(4.0)
    assert oversub.bound_by(4.0 * oversub.PCIE_BOUND_FACTOR, floor) == "pcie"
    assert oversub.bound_by(4.0 * oversub.PCIE_BOUND_FACTOR + 0.01, floor) == "compute"
    assert oversub.bound_by(1.0, 0.0) == "compute"


@settings(max_examples=25, deadline=None)
@given(net=snt.nets(min_layers=1, max_layers=6))
def test_checkpointed_twin_computes_the_plain_twins_loss_and_gradients(net):
    """Segments cover every layer up to the logits once, in order, and the checkpointed
    model gives the same loss and parameter gradients as the twin (float64)."""
    twin = net.to_torch().double()
    model = oversub.Checkpointed(net.to_torch().double(), count=3)
    covered = [i for part in model.parts for i in part]
    logits = next(i for i, (n, _, _) in enumerate(twin.plan) if n == twin.logits_name)
    assert covered == list(range(1, logits + 1))
    torch.manual_seed(0)
    images = torch.randn(net.batch, *net.input_shape, dtype=torch.float64)
    labels = torch.randint(0, net.classes, (net.batch,))
    losses = []
    for m in (twin, model):
        m.train()
        torch.manual_seed(1)                      # the same dropout masks on both sides
        loss = torch.nn.functional.cross_entropy(m(images), labels)
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-12)
    grads = dict(model.twin.named_parameters())
    for name, p in twin.named_parameters():
        if p.grad is None:
            assert grads[name].grad is None
        else:
            assert torch.allclose(p.grad, grads[name].grad, rtol=1e-10, atol=1e-12), name


def test_cut_points_of_resnet50_end_each_block():
    import tinysn as sn
    from tinysn.graph import TorchNet
    twin = TorchNet(sn.models.resnet50(batch=1))
    names = [twin.plan[i][0] for i in oversub.cut_points(twin)]
    assert names[:5] == ["data1", "conv1", "bn1", "relu1", "maxpool"]
    assert sum(n.endswith("_add") for n in names) == 16          # inside a block: no cut
    assert not any("conv2" in n or "downsample" in n for n in names)
    assert len(oversub.segments(twin)) == 6


def test_pytorch_search_stops_at_oom_and_at_the_host_cap(monkeypatch):
    """The largest batch that runs; a batch whose projected pinned bytes exceed the host cap
    is never tried."""
    tried = []

    def fake_run(net, model_name, config, cap, device, warmup, steps, host_cap=None):
        tried.append(net.batch)
        if net.batch > 12:
            return None                                    # out of device memory
        return {"ms_per_step": 1.0, "host_peak_bytes": 100 * net.batch}
    monkeypatch.setattr(oversub, "pytorch_run", fake_run)
    cpu = torch.device("cpu")
    row = oversub.pytorch_largest("lenet", "eager", 1, cpu, 64, None, (1, 1))
    assert row["largest"] == 12 and row["images_per_s"] == 12e3 and not row["at_limit"]
    tried.clear()
    row = oversub.pytorch_largest("lenet", "save_on_cpu", 1, cpu, 64, 1000, (1, 1))
    assert row["largest"] == 10 and max(tried) <= 10


def test_pytorch_steps_down_where_the_timed_run_does_not_fit(monkeypatch):
    """The probe's two steps fit at 12, the timed steps only at 10 and below: the row is
    timed at 10 and says the probe found 12; where no timed run fits, the error says so."""
    def fake_run(net, model_name, config, cap, device, warmup, steps, host_cap=None):
        limit = probe_limit if (warmup, steps) == (1, 1) else timed_limit
        return {"ms_per_step": 1.0, "host_peak_bytes": 0} if net.batch <= limit else None
    monkeypatch.setattr(oversub, "pytorch_run", fake_run)
    cpu = torch.device("cpu")
    probe_limit, timed_limit = 12, 10
    row = oversub.pytorch_largest("lenet", "eager", 1, cpu, 64, None, (2, 3))
    assert (row["largest"], row["probed"], row["images_per_s"]) == (10, 12, 10e3)
    for probe_limit in (12, 1):                 # at 1 the step-down reaches batch 0
        timed_limit = 0
        row = oversub.pytorch_largest("lenet", "eager", 1, cpu, 64, None, (2, 3))
        assert "images_per_s" not in row and "out of device memory when timed" in row["error"]


def test_merge_keeps_other_models_and_parts(tmp_path):
    path = tmp_path / "o.json"
    args = oversub.parse_args(["--models", "lenet", "--parts", "pytorch", "--merge",
                               "--out", str(path)])
    path.write_text(json.dumps({"rows": [{"model": "lenet"}, {"model": "vgg16"}],
                                "pytorch": [{"model": "lenet", "config": "eager"},
                                            {"model": "vgg16", "config": "eager"}]}))
    assert oversub.kept(args) == {"rows": [{"model": "lenet"}, {"model": "vgg16"}],
                                  "pytorch": [{"model": "vgg16", "config": "eager"}]}


def test_merge_redoes_only_the_named_pytorch_configurations(tmp_path):
    path = tmp_path / "o.json"
    old = [{"model": "lenet", "config": c} for c in oversub.PYTORCH_CONFIGS]
    path.write_text(json.dumps({"rows": [], "pytorch": old}))
    args = oversub.parse_args(["--models", "lenet", "--parts", "pytorch", "--pytorch-configs",
                               "save_on_cpu", "--merge", "--out", str(path)])
    assert oversub.kept(args)["pytorch"] == old[:2]


def test_merge_with_only_redoes_just_those_batches_of_the_curve(tmp_path):
    path = tmp_path / "o.json"
    rows = [{"model": "lenet", "batch": b} for b in (32, 64, 128)] + [{"model": "vgg16",
                                                                      "batch": 64}]
    path.write_text(json.dumps({"rows": rows, "pytorch": [{"model": "lenet"}]}))
    args = oversub.parse_args(["--models", "lenet", "--parts", "tinysn", "--only", "64,32",
                               "--merge", "--out", str(path)])
    assert args.only == [32, 64]
    assert oversub.kept(args) == {"rows": [rows[2], rows[3]], "pytorch": [{"model": "lenet"}]}
    args = oversub.parse_args(["--models", "lenet", "--parts", "tinysn", "--merge",
                               "--out", str(path)])
    assert oversub.kept(args)["rows"] == [rows[3]]          # the whole curve is redone
    for bad in ("0", "x"):
        with pytest.raises(SystemExit):
            oversub.parse_args(["--only", bad])


def test_a_failed_run_is_recorded_in_its_row():
    bandwidth = {"to_host_gb_per_s": 1.0, "to_device_gb_per_s": 1.0}
    capped = {"ms_per_step": 500.0, "bytes_to_host": 2e9, "bytes_to_device": 1e9,
              "bytes_moved_per_step": 3e9, "predicted_step_s": 3.1, "model_bound_by": "pcie",
              "process_peak_bytes": 7, "peak_bytes": 5, "peak_equals_plan": True,
              "setup_s": 1.0, "losses": [2.3], "predicted_compute_waits_s": {"forward": 0.5},
              "recomputed_steps": 0, "speed_centric_everywhere": False,
              "in_place_gradients": True, "keep_pools": True, "evict_by_next_use": True,
              "rebuild_joins": True, "rebuilt_joins": ["add1"], "fuse_relu": True,
              "fuse_bn_relu": False, "fuse_add_relu": True, "fuse_bn_add": True,
              "group_updates": False, "fuse_updates": True, "store_argmaxes": False,
              "batch_staged": False, "trade_budget": 48, "device_model": {"launch_probe_s": 2e-5},
              "timed_launch_probe_s": 3e-5}
    row = oversub.curve_row("m", 4, capped, {"error": "OutOfMemory: no"}, bandwidth)
    assert row["images_per_s"] == 8.0 and row["pcie_floor_s"] == 3.0
    assert row["bound_by"] == "pcie" and row["fraction"] is None
    assert row["launch_probe_s"] == 2e-5 and row["timed_launch_probe_s"] == 3e-5
    assert row["no_move_error"] == "OutOfMemory: no"
    assert (row["fuse_bn_relu"], row["fuse_add_relu"], row["fuse_bn_add"],
            row["group_updates"], row["fuse_updates"], row["store_argmaxes"],
            row["batch_staged"]) == (False, True, True, False, True, False, False)
    failed = oversub.curve_row("m", 8, {"refused": "too small"}, {}, bandwidth)
    assert failed == {"model": "m", "batch": 8, "error": "too small"}
    lines = oversub.table_rows({"rows": [row, failed], "pytorch": [
        {"model": "m", "config": "eager", "largest": 0}]})
    assert lines == ['| m, tinysn "all" | 4 | 8.0 | - | - | 3.0 GB | 3.00 s | pcie |',
                     '| m, tinysn "all" | 8 | failed: too small | | | | | |',
                     "| m, PyTorch eager | 0 | failed: nothing fits | | | | | |"]


def test_a_batch_that_is_not_the_largest_stops_before_anything_runs(capsys):
    with pytest.raises(SystemExit, match="not the largest batch"):
        oversub.main([a if a != "lenet=8" else "lenet=7" for a in SMOKE])
    assert "copies:" not in capsys.readouterr().out


@pytest.mark.parametrize("argv, names", [
    (["--models", "lenet,nope"], "--models"),
    (["--parts", "both"], "--parts"),
    (["--pytorch-configs", "eager,compile"], "--pytorch-configs"),
    (["--memory", "12G"], "--memory"),
    (["--reference", "1GiB", "--memory", "12GiB"], "--reference"),
    (["--host-memory", "lots"], "--host-memory"),
    (["--first", "0"], "--first"),
    (["--plot", "curve.pdf"], "--plot"),
    (["--merge"], "--merge"),
    (["--batches", "lenet=x"], "--batches"),
    (["--out", "o.txt"], "--out"),
    (["--from", "absent.json", "--plot", "c.png"], "--from"),
])
def test_bad_arguments_give_one_line_naming_them(argv, names, capsys):
    with pytest.raises(SystemExit) as err:
        oversub.parse_args(argv)
    assert err.value.code == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith("oversub.py: error:") or "error:" in message
    assert names in message


def test_cpu_smoke_rows_have_every_key_and_sane_values(smoke):
    data, _, _ = smoke
    rows = data["rows"]
    assert [r["batch"] for r in rows] == [4, 8]
    bandwidth = data["copy_bandwidth"]
    for r in rows:
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        # two timings of LeNet on a CPU shared with another test worker: 1.50 seen once,
        # so the bound only catches nonsense; the ratio itself is checked on the next line
        assert 0 < r["fraction"] <= 3
        assert r["fraction"] == pytest.approx(r["images_per_s"] / r["no_move_images_per_s"])
        assert r["pcie_floor_s"] == pytest.approx(oversub.pcie_floor_s(
            r["bytes_to_host"], r["bytes_to_device"], bandwidth)) and r["pcie_floor_s"] >= 0
        assert r["bound_by"] in ("pcie", "compute") and r["peak_equals_plan"]
        assert r["bytes_moved_per_step"] == r["bytes_to_host"] + r["bytes_to_device"]
        assert r["no_move_bytes_moved"] == 0 and r["store_argmaxes"] is False
        assert set(r["predicted_compute_waits_s"]) <= {"forward", "recompute", "backward"}
    assert rows[-1]["bytes_moved_per_step"] > 0 and rows[-1]["pcie_floor_s"] > 0
    configs = [(r["model"], r["config"]) for r in data["pytorch"]]
    assert configs == [("lenet", c) for c in oversub.PYTORCH_CONFIGS]
    for r in data["pytorch"]:
        assert r["largest"] == r["limit"] == 8 and not r["cap_enforced"]
        assert r["images_per_s"] > 0


def test_cpu_smoke_plot_and_table(smoke, capsys):
    data, png, out = smoke
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    oversub.print_tables([str(out)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == len(data["rows"]) + len(data["pytorch"]) == 5
    rate = data["rows"][1]["images_per_s"]
    assert lines[1].startswith(f'| lenet, tinysn "all" | 8 | {rate:,.1f} |')
    assert lines[-1].startswith("| lenet, PyTorch save_on_cpu | 8 |")
    with pytest.raises(SystemExit, match="no such file"):
        oversub.print_tables([str(out) + ".missing"])
    again = png.parent / "again.png"
    oversub.main(["--from", str(out), "--plot", str(again)])
    assert again.read_bytes() == png.read_bytes()


@pytest.mark.gpu
@pytest.mark.timing
def test_gpu_smoke_counts_the_cap_on_both_sides(tmp_path):
    """On the GPU the PyTorch search is capped for real and tinysn's process stays in its
    cap: LeNet under 256 MiB (PyTorch's cuBLAS workspaces need some 65 MiB of it), the
    reference under 2 GiB. LeNet's steps take milliseconds and are bound by the host, so
    each side times 10 steps after 3 (with the defaults' 2 after 1 the beyond-cap run once
    read 1.57 times the no-move speed)."""
    import tinysn as sn
    out = tmp_path / "o.json"
    oversub.main(["--models", "lenet", "--memory", "256MiB", "--reference", "2GiB",
                  "--first", "4096", "--host-memory", "4GiB", "--steps", "10", "--warmup", "3",
                  "--out", str(out)])
    data = json.loads(out.read_text())
    cap = 256 << 20
    assert len(data["rows"]) >= 2 and data["copy_bandwidth"]["measured"] == "pinned copies"
    for r in data["rows"]:
        assert r["peak_equals_plan"] and 0 < r["fraction"] <= 1.5
        assert r["process_peak_bytes"] <= cap + sn.runtime.PROCESS_SLACK_BYTES
    for r in data["pytorch"]:
        assert r["cap_enforced"] and r["largest"] > 0 and r["process_peak_bytes"] <= cap
        assert r["host_peak_bytes"] is not None
