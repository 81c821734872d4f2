"""The GPU figures quoted in bench/README.md are the ones in the JSON files the scripts wrote."""
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
BENCH_README = (ROOT / "bench" / "README.md").read_text()


def load(name):
    return json.loads((RESULTS / name).read_text())


def table_row(text, first_cell):
    """The cells of the markdown table row that starts with `first_cell`."""
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == first_cell:
            return cells
    raise AssertionError(f"no table row {first_cell!r} in bench/README.md")


def test_every_gpu_training_run_measured_the_planned_peak():
    models = load("memory-NVIDIA-H200.json")["models"]
    runs = [m[key] for m in models.values() if isinstance(m, dict)
            for key in ("real", "reference") if key in m]
    assert len(runs) >= 2
    for run in runs:
        assert run["peak_bytes"] == run["planned_peak_bytes"]


def test_memory_table_quotes_the_json():
    models = load("memory-NVIDIA-H200.json")["models"]
    for name in ("resnet50", "resnet101", "resnet152", "vgg16", "inception_v4"):
        row = table_row(BENCH_README, name)
        real = models[name]["real"]
        assert f"**{models[name]['max_batch_all']}**" in row[1]
        assert f"{real['peak_bytes']:,} B" in row[2]
        assert real["process_peak_within_cap"] and f"{real['process_peak_bytes']:,} B" == row[3]
        assert f"{real['images_per_s']:.1f}" == row[4]
        assert f"{real['bytes_moved_per_step'] / 1e9:.1f} GB" in row[5]
        assert f"{models[name]['recomputed_steps']}" == row[6]
        assert f"{models[name]['pytorch']['largest']}" == row[8]


def test_conv_table_quotes_the_json():
    rows = [r for r in load("kernels-NVIDIA-H200.json")["rows"]
            if r.get("kernel", "").startswith("conv.")]
    ratio = {(r["shape"].rsplit(" b", 1)[0], r["kernel"][5:], r["algo"]): r["ratio"] for r in rows}
    order = {"forward": ("implicit", "im2col"),
             "backward_data": ("implicit", "flipped", "transposed", "zero_insert"),
             "backward_weight": ("onepass", "splitk")}
    shapes = {shape for shape, _, _ in ratio}
    assert len(shapes) == 8
    for shape in shapes:
        cells = table_row(BENCH_README, shape)
        for cell, (phase, algos) in zip(cells[1:], order.items()):
            quoted = [c.strip().strip("*") for c in cell.split("/")]
            for algo, text in zip(algos, quoted):
                if text == "-":
                    assert (shape, phase, algo) not in ratio
                else:
                    assert f"{ratio[(shape, phase, algo)]:.2f}" == text, (shape, phase, algo)


def test_every_quoted_gpu_test_count_is_a_clean_run_in_a_json():
    """Each "passed N of M" in bench/README.md is a gpu-tests-*.json under results/ (written
    by bench/gpu_tests.py) with N passed of M tests and none failed, errored or cut short."""
    import re
    runs = [json.loads(p.read_text()) for p in RESULTS.glob("gpu-tests-*.json")]
    clean = {(r["counts"]["passed"], len(r["rows"])) for r in runs
             if r["exit_code"] == 0 and not r["unfinished"]
             and r["counts"]["failed"] == r["counts"]["error"] == 0}
    text = " ".join(BENCH_README.split())
    for passed, total in re.findall(r"passed (\d+) of (\d+)", text):
        assert (int(passed), int(total)) in clean, f"passed {passed} of {total}"
    assert not list(RESULTS.glob("gpu-tests-*.txt")), "test logs belong in no results folder"


def test_memory_bound_table_quotes_the_json():
    rows = load("kernels-NVIDIA-H200.json")["rows"]
    frac = {(r["kernel"], r["algo"]): r for r in rows if "frac_of_copy" in r}
    cells = table_row(BENCH_README, "concat forward / backward")
    fwd = frac[("join.concat_forward", "2 inputs")]
    bwd = frac[("join.concat_backward", "2 gradients, overwrite")]
    assert cells[2] == f"{fwd['gbps']:,.0f} / {bwd['gbps']:,.0f}"
    assert cells[3] == f"**{fwd['frac_of_copy']:.0%}** / {bwd['frac_of_copy']:.0%}"
    assert cells[4] == f"{fwd['graph_frac_of_copy']:.0%} / {bwd['graph_frac_of_copy']:.0%}"


def test_training_table_quotes_the_json():
    """bench/README.md's training table holds every configuration of every train-*.json,
    as `bench/train.py --table` renders it from the file."""
    from bench import train
    runs = sorted(RESULTS.glob("train-*-b32-*.json"))
    lines = set(BENCH_README.splitlines())
    assert runs
    for path in runs:
        run = json.loads(path.read_text())
        done = [r for r in run["pytorch"] if "images_per_s" in r]
        assert run["pytorch_best_images_per_s"] == max(r["images_per_s"] for r in done)
        for row in train.table_rows(run):
            assert row in lines, row
        measured = [r for r in run["tinysn"] if "losses" in r]
        for row in measured:
            assert row["peak_equals_plan"] and row["losses"] == measured[0]["losses"]


def test_readme_speed_table_quotes_the_json():
    """README.md's batch-32 table holds, for each model, the row `bench/train.py --summary`
    prints for the files the README's command names (one card's runs)."""
    import re
    from bench import train
    text = (ROOT / "README.md").read_text()
    pattern = re.search(r"bench/train\.py --summary (bench/results/\S+\.json)", text)[1]
    runs = [json.loads(p.read_text()) for p in sorted(ROOT.glob(pattern))]
    rows = train.summary_rows(runs)
    assert {row.split(" | ")[0] for row in rows} == {f"| {m}" for m in train.MODEL_NAMES.values()}
    for row in rows:
        assert "  " + row in text.splitlines(), row


def test_readme_cpu_demo_figures_are_the_first_run_json():
    """README.md's CPU demo figures (accuracy, steps, seconds on empty caches) are
    bench/first_run.py's record of the README's first command, run with today's defaults."""
    from tinysn import cli
    run = load("first-run-lenet-digits-cpu.json")
    assert run["command"] == ["tinysn", "train", "--model", "lenet", "--data", "digits"]
    accuracy = next(x for x in run["cold"]["last_lines"] if "held-out accuracy" in x)
    percent = accuracy.split("accuracy ")[1].split("%")[0]
    steps = cli.DIGITS_STEPS
    text = " ".join((ROOT / "README.md").read_text().split())
    assert (f"prints {percent}% after {steps} steps and exits {run['cold']['total_s']:.1f} s "
            f"after it starts, on empty caches") in text


def test_every_script_result_has_the_one_envelope():
    """Every results JSON a bench script wrote carries common.write's envelope (the plan
    JSON and the step's trace are written by `python -m tinysn plan` and `train --trace`,
    not a bench script)."""
    keys = {"gpu", "torch", "triton", "cudnn", "python", "date", "command"}
    written = [p for p in RESULTS.glob("*.json") if not p.name.startswith(("plan-", "trace-"))]
    assert len(written) >= 5
    for path in written:
        assert set(json.loads(path.read_text())["environment"]) == keys, path.name


def test_deep_resnet_graph_run_as_quoted():
    run = load("memory-graph-NVIDIA-H200.json")["models"]["deep_resnet"]
    real = run["real"]
    assert real["cuda_graph"] and real["peak_bytes"] == real["planned_peak_bytes"]
    assert run["conv_fc_layers"] == 6201
    assert f"{real['seconds_per_step']:.2f} s per step, {real['images_per_s']:.1f}" in BENCH_README
    assert f"{real['transfer_gb_per_s']:.1f} GB/s moved" in BENCH_README
    assert real["process_peak_within_cap"]
    assert f"whole run\n(rankings, graph capture, steps) is {real['process_peak_bytes']:,} B" \
        in BENCH_README


def test_step_time_table_is_what_predict_prints():
    """bench/README.md's model-against-measurement table is bench/predict.py's output."""
    from bench import predict
    rows = predict.main(["--results", str(RESULTS)])
    assert len(rows) >= 3
    for row in rows:                       # each prediction is of the plan that ran
        assert row["bytes_moved_per_step"] == row["measured_bytes_moved_per_step"], row
    lines = set(BENCH_README.splitlines())
    for line in predict.table(rows):
        assert line in lines, line


def test_oversubscription_table_quotes_the_json():
    from bench import oversub
    rows = oversub.table_rows(load("oversub-NVIDIA-H200.json"))
    assert rows
    lines = set(BENCH_README.splitlines())
    for row in rows:
        assert row in lines, row


def test_host_probe_figures_quote_the_json():
    """bench/README.md's host-probe figures are host_probe.py's summary."""
    s = load("host-probe-NVIDIA-H200.json")["summary"]
    text = " ".join(BENCH_README.split())

    def span(key, scale, digits):
        return f"between {s[key]['min'] * scale:.{digits}f} and {s[key]['max'] * scale:.{digits}f}"
    assert f"the bare launch moved {span('bare_launch_s', 1e6, 1)} us" in text
    assert f"ResNet-50's step {span('resnet50_step_s', 1e3, 1)} ms" in text
    assert f"AlexNet's {span('alexnet_step_s', 1e3, 1)} ms" in text
    assert (f"(correlation {s['resnet50_correlation_with_bare_launch_s']:.2f}; the Python "
            f"loop's {s['resnet50_correlation_with_python_loop_s']:.2f})") in text
    assert (f"AlexNet's ({s['alexnet_correlation_with_bare_launch_s']:.2f}; "
            f"{s['alexnet_correlation_with_python_loop_s']:.2f})") in text


def test_every_bench_script_has_a_row_in_the_scripts_table():
    """Each bench script (a module with a main()) is named in the first cell of a row of
    bench/README.md's script table, alone or as one that kernels.py runs."""
    first_cells = [line.strip().strip("|").split("|")[0] for line in BENCH_README.splitlines()
                   if line.startswith("| `")]
    scripts = [p.name for p in (ROOT / "bench").glob("*.py") if "\ndef main(" in p.read_text()]
    assert len(scripts) >= 15
    for name in scripts:
        assert any(f"`{name}`" in cell for cell in first_cells), name


def test_fused_fc_step_figures_quote_the_json():
    """The fc weight step's figures (the GEMM with the SGD step in its epilogue) that both
    READMEs quote are linear_configs.py's H100 file: the best config, and the best of the
    others (the list before its thin tile)."""
    rows = load("linear-configs-NVIDIA-H100-80GB-HBM3.json")["rows"]
    best = {(r["case"], r["pass"]): r for r in rows if "best_config" in r}
    text = " ".join(BENCH_README.split())
    readme = " ".join((ROOT / "README.md").read_text().split())
    fc6 = best[("vgg16 fc6", "dw+db+sgd")]
    assert f"**{fc6['tinysn_ms']:.3f} ms, {fc6['gb_per_s'] / 1e3:.2f} TB/s**" in text
    others = [r for r in rows if (r["case"], r["pass"]) == ("vgg16 fc6", "dw+db+sgd")
              and r.get("config") not in (None, fc6["best_config"])]
    before = min(others, key=lambda r: r["tinysn_ms"])
    assert f"fc6: {before['tinysn_ms']:.3f} ms at best, {before['gb_per_s'] / 1e3:.2f} TB/s" \
        in text
    assert (f"VGG16's fc6 step (32x25088->4096) in {before['tinysn_ms']:.3f} ms at best"
            in readme and f"takes it in {fc6['tinysn_ms']:.3f} ms" in readme)
    alex = best[("alexnet fc6", "dw+db+sgd")]
    assert f"AlexNet's fc6 in {alex['tinysn_ms']:.3f}" in text
    plain = best[("vgg16 fc6", "dw+db")]
    assert (f"fc6's weight gradient takes {plain['tinysn_ms']:.3f} ms against cuBLAS's "
            f"{plain['torch_ms']:.3f}") in text
