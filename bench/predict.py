"""The step-time model against the measured steps: for every tracked GPU result that trained
tinysn (results/memory-<gpu>.json's largest-batch runs, results/train-*-b32-<gpu>.json's
rows), plan the same configuration again (on any machine: planning needs no GPU) and put
`sched/timing.simulate`'s prediction beside the measured seconds per step.

    PYTHONPATH=. python3 bench/predict.py [--results bench/results] [--out PATH]

The plan made here uses the default conv rankings (the GPU run used measured ones), so its
kernels may differ in workspace, not in the bytes it moves or the kernels' costs the model
counts. A memory run is planned with the `trade_budget` and prefetch `lookahead` it records
(runs made before policy "all" traded copies for recomputation record no budget: 0, and
runs made before prefetches went ahead record no lookahead: 1, the planners they ran).
"""
import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tinysn as sn  # noqa: E402
from bench.common import add_out_argument, write  # noqa: E402
from tinysn.sched.timing import DeviceModel, simulate  # noqa: E402
from tinysn.units import format_bytes  # noqa: E402


def compare(net, memory, policy, measured_s, graphed=False, host_memory=None, **plan_kw) -> dict:
    """One row: the prediction for `net` planned as it was measured, and its error."""
    plan = sn.plan(net, memory, policy, host_memory=host_memory, **plan_kw)
    timeline = simulate(plan, DeviceModel.h200(graphed=graphed))
    return {"batch": net.batch, "memory": memory, "policy": policy, "cuda_graph": graphed,
            "measured_s": measured_s, "predicted_s": timeline.step_s,
            "error": timeline.step_s / measured_s - 1, "bound_by": timeline.bound_by,
            "compute_s": timeline.compute_s, "to_host_s": timeline.to_host_s,
            "to_device_s": timeline.to_device_s}


def memory_rows(path: Path) -> list:
    """The largest-batch runs of a memory.py result (policy "all", plain SGD), each planned
    with the trade budget it ran with."""
    models = json.loads(path.read_text())["models"]
    rows = []
    for name, row in models.items():
        real = row.get("real") if isinstance(row, dict) else None
        if not real or "seconds_per_step" not in real:
            continue
        net = getattr(sn.models, name)(batch=row["max_batch_all"])
        rows.append({**compare(net, real["memory"], "all", real["seconds_per_step"],
                               real["cuda_graph"], row.get("host_memory"),
                               trade_budget=real.get("trade_budget", 0),
                               lookahead=real.get("lookahead", 1)), "model": name})
    return rows


def train_rows(path: Path) -> list:
    """The tinysn rows of a train.py result (batch 32, its optimizer settings)."""
    run = json.loads(path.read_text())
    rows = []
    for row in run["tinysn"]:
        if "ms_per_step" not in row:
            continue
        net = getattr(sn.models, run["model"])(batch=run["batch"])
        memory = run.get("memory") or "40GiB"
        rows.append({**compare(net, memory, row["policy"], row["ms_per_step"] / 1e3,
                               row["cuda_graph"], momentum=run["sgd"]["momentum"]),
                     "model": run["model"]})
    return rows


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(Path(__file__).parent / "results"))
    add_out_argument(ap)
    args = ap.parse_args(argv)
    folder = Path(args.results)
    rows = [r for p in sorted(folder.glob("memory-*.json")) if "graph" not in p.name
            for r in memory_rows(p)]
    rows += [r for p in sorted(folder.glob("train-*-b32-*.json")) for r in train_rows(p)]
    print("\n".join(table(rows)))
    write(args.out, {"rows": rows})
    return rows


def table(rows) -> list:
    """The markdown table bench/README.md quotes."""
    lines = ["| run | measured s/step | predicted | error | bound by (model) |",
             "|---|---|---|---|---|"]
    for r in rows:
        how = "CUDA graph" if r["cuda_graph"] else "eager"
        memory = format_bytes(sn.parse_bytes(r["memory"]))
        lines.append(f"| {r['model']} batch {r['batch']}, {memory}, \"{r['policy']}\", {how} | "
                     f"{r['measured_s']:.3f} | {r['predicted_s']:.3f} | {r['error']:+.0%} | "
                     f"{r['bound_by']} |")
    return lines


if __name__ == "__main__":
    main()
