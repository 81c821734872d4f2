"""The step-time model against the measured steps: for every tracked result on the H200
(MODEL_CARD) that trained tinysn (results/memory-<gpu>.json's largest-batch runs,
results/train-*-b32-<gpu>.json's rows), plan the same configuration again (on any machine:
planning needs no GPU) and put `sched/timing.simulate`'s prediction beside the measured
seconds per step.

    PYTHONPATH=. python3 bench/predict.py [--results bench/results] [--today] [--out PATH]

A run that recorded its measured conv times is planned with the rankings they give
(workspace.rankings_of), so the plan made here takes the algorithms the run took; an older
run is planned with the default rankings (least workspace first), whose kernels may differ
from the run's in workspace, not in the bytes moved. A run is planned again as it was
planned when measured: with the `device_model` its planner chose with, and a memory run
with its `trade_budget` and prefetch `lookahead`.
Runs that record none of these ran earlier planners: `PLANNED_BEFORE` holds the device
figures those chose with, a missing budget is 0 (no trade search yet), a missing
lookahead 1, a missing `in_place_gradients` False (every gradient in a block of its own),
a missing `keep_pools` False (no pooling output kept), a missing `evict_by_next_use`
False (the cache evicts the least recently used), a missing `rebuild_joins` False (no
join rebuilt by `plan._rebuild_joins`), a missing `fuse_relu` False (every ReLU its own
layer), a missing `fuse_bn_relu` False (no batch norm's ReLU fused) and a missing
`fuse_add_relu` False (no residual add's ReLU fused), a missing `fuse_bn_add` False (no
batch norm fused into its residual add), a missing `group_updates` False (each layer's SGD
update at its own backward pass), a missing `fuse_updates` False (every gradient stored and
stepped by the SGD kernel), a missing `store_argmaxes` False (every max pool's backward
finds its argmaxes in x). A run without `batch_staged` copied
each batch at its steps' start (sched/staging.py came later). The prediction itself always
uses today's model (DeviceModel.h200, with the conv times the run measured and its probe
of the host, beside its timed steps or else when it planned, where it recorded them), so
the table shows how well today's model explains every measured step.
`--today` plans each train.py run as today's planner does (its defaults, batch staged where
the plan has room), still with the run's measured conv times and host probe: what the
build of today is predicted to take on that run's machine, beside what the run measured.
"""
import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tinysn as sn  # noqa: E402
from bench.common import add_out_argument, write  # noqa: E402
from tinysn.sched import workspace  # noqa: E402
from tinysn.sched.fuse import fusible  # noqa: E402
from tinysn.sched.timing import DeviceModel, simulate  # noqa: E402
from tinysn.units import format_bytes  # noqa: E402


# The device figures planners chose with before runs recorded their `device_model`.
PLANNED_BEFORE = DeviceModel(flops_per_s=100e12, bytes_per_s=3.0e12, to_host_bytes_per_s=55e9,
                             to_device_bytes_per_s=55e9, launch_s=16e-6)


def planned_with(row: dict) -> DeviceModel:
    """The device model a measured run's planner chose with."""
    recorded = row.get("device_model")
    return DeviceModel.from_record(recorded) if recorded else PLANNED_BEFORE


def plan_as_run(net, memory, policy, host_memory=None, **plan_kw):
    """`net` planned as a measured run planned it (`plan_kw` with the `device_model` it
    chose with): with the rankings its measured conv times give, where it recorded them."""
    conv_times = plan_kw["device_model"].conv_times
    return sn.plan(net, memory, policy, host_memory=host_memory,
                   rankings=conv_times and workspace.rankings_of(conv_times), **plan_kw)


def staged_as_run(plan, staged: bool):
    """`plan` as a run ran it that staged its batches (`staged`, sched/staging.py) or copied
    each at its step's start (every run before staging, whatever room its plan left)."""
    return plan if staged else dataclasses.replace(plan, batch_staging=None)


def train_plan_kw(run: dict, row: dict) -> dict:
    """The planner options a train.py row ran with (a missing one as planners before it)."""
    return dict(momentum=run["sgd"]["momentum"],
                in_place_gradients=row.get("in_place_gradients", False),
                keep_pools=row.get("keep_pools", False),
                evict_by_next_use=row.get("evict_by_next_use", False),
                rebuild_joins=row.get("rebuild_joins", False),
                fuse_relu=row.get("fuse_relu", False),
                fuse_bn_relu=row.get("fuse_bn_relu", False),
                fuse_add_relu=row.get("fuse_add_relu", False),
                fuse_bn_add=row.get("fuse_bn_add", False),
                group_updates=row.get("group_updates", False),
                fuse_updates=row.get("fuse_updates", False),
                store_argmaxes=row.get("store_argmaxes", False),
                device_model=planned_with(row))


def compare(net, memory, policy, measured: dict, graphed=False, host_memory=None,
            staged=False, **plan_kw) -> dict:
    """One row: the prediction for `net` planned as it was measured (`measured`: the run's
    seconds per step, the bytes it moved and its probe of the host), and its error. Equal
    bytes moved say the plan made here is the one that ran. A run that did not stage its
    batches (`staged`) is simulated with the batch copied at each step's start."""
    conv_times = plan_kw["device_model"].conv_times     # measured where the run had them
    plan = staged_as_run(plan_as_run(net, memory, policy, host_memory, **plan_kw), staged)
    # the run's host, where it probed it: beside the timed steps, else when it planned
    probe = measured.get("probe") or plan_kw["device_model"].launch_probe_s
    timeline = simulate(plan, DeviceModel.h200(graphed=graphed, conv_times=conv_times,
                                               launch_probe_s=probe))
    return {"batch": net.batch, "memory": memory, "policy": policy, "cuda_graph": graphed,
            "measured_s": measured["s"], "predicted_s": timeline.step_s,
            "bytes_moved_per_step": plan.bytes_to_host + plan.bytes_to_device,
            "measured_bytes_moved_per_step": measured["moved"],
            "error": timeline.step_s / measured["s"] - 1, "bound_by": timeline.bound_by,
            "compute_s": timeline.compute_s, "to_host_s": timeline.to_host_s,
            "to_device_s": timeline.to_device_s, "plan_steps": len(plan.steps)}


def searched_lookahead(real: dict):
    """The prefetch distance to plan a memory run with: the one it chose, or None (search
    again) for a run that rebuilt joins, whose join search judged each choice at every
    distance (plan._rebuild_joins): fixing the distance would change what it chooses."""
    return None if real.get("rebuild_joins") else real.get("lookahead", 1)


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
        measured = {"s": real["seconds_per_step"], "moved": real["bytes_moved_per_step"]}
        rows.append({**compare(net, real["memory"], "all", measured,
                               real["cuda_graph"], row.get("host_memory"),
                               staged=real.get("batch_staged", False),
                               trade_budget=real.get("trade_budget", 0),
                               lookahead=searched_lookahead(real),
                               in_place_gradients=real.get("in_place_gradients", False),
                               keep_pools=real.get("keep_pools", False),
                               evict_by_next_use=real.get("evict_by_next_use", False),
                               rebuild_joins=real.get("rebuild_joins", False),
                               fuse_relu=real.get("fuse_relu", False),
                               fuse_bn_relu=real.get("fuse_bn_relu", False),
                               fuse_add_relu=real.get("fuse_add_relu", False),
                               fuse_bn_add=real.get("fuse_bn_add", False),
                               group_updates=real.get("group_updates", False),
                               fuse_updates=real.get("fuse_updates", False),
                               store_argmaxes=real.get("store_argmaxes", False),
                               device_model=planned_with(real)), "model": name})
    return rows


def today_plan_kw(run: dict, row: dict) -> dict:
    """Today's planner options (its defaults) for a train.py row: the run's momentum and
    the device model its planner chose with (its measured conv times), nothing else."""
    return dict(momentum=run["sgd"]["momentum"], device_model=planned_with(row))


def train_rows(path: Path, today: bool = False) -> list:
    """The tinysn rows of a train.py result (batch 32, its optimizer settings), each planned
    as it ran, or with `today` as today's planner plans it (`today_plan_kw`, staged)."""
    run = json.loads(path.read_text())
    rows = []
    for row in run["tinysn"]:
        if "ms_per_step" not in row:
            continue
        net = getattr(sn.models, run["model"])(batch=run["batch"])
        memory = run.get("memory") or "40GiB"
        measured = {"s": row["ms_per_step"] / 1e3, "moved": row["bytes_moved_per_step"],
                    "probe": row.get("timed_launch_probe_s")}
        plan_kw = today_plan_kw(run, row) if today else train_plan_kw(run, row)
        rows.append({**compare(net, memory, row["policy"], measured, row["cuda_graph"],
                               staged=today or row.get("batch_staged", False), **plan_kw),
                     "model": run["model"], "today": today,
                     "fuse_bn_relu": plan_kw.get("fuse_bn_relu", today)
                     and fuses_a_batch_norm(net)})
    return rows


def fuses_a_batch_norm(net) -> bool:
    """Whether `fuse_bn_relu` changes `net`'s plan: some batch norm's ReLU can fuse into it
    (VGG16 and AlexNet have none, so their rows carry no fusion label)."""
    return any(layer.op == "bn" and fusible(layer, batch_norms=True) for layer in net.layers)


# The card whose runs the model explains: its figures are fitted on the H200's
# (sched/timing.py); a run on another card (an H100's slower memory) is not its to predict.
MODEL_CARD = "NVIDIA-H200"


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--today", action="store_true",
                    help="plan the train.py runs as today's planner does (module docstring); "
                         "the memory runs are left out")
    add_out_argument(ap)
    args = ap.parse_args(argv)
    folder = Path(args.results)
    rows = [] if args.today else [r for p in sorted(folder.glob(f"memory-*{MODEL_CARD}.json"))
                                  if "graph" not in p.name for r in memory_rows(p)]
    rows += [r for p in sorted(folder.glob(f"train-*-b32-*{MODEL_CARD}.json"))
             for r in train_rows(p, args.today)]
    print("\n".join(table(rows)))
    write(args.out, {"rows": rows})
    return rows


def table(rows) -> list:
    """The markdown table bench/README.md quotes."""
    lines = ["| run | measured s/step | predicted | error | bound by (model) |",
             "|---|---|---|---|---|"]
    for r in rows:
        how = "CUDA graph" if r["cuda_graph"] else "eager"
        how += ", batch norms' ReLUs fused" if r.get("fuse_bn_relu") else ""
        how += ", as planned today" if r.get("today") else ""
        memory = format_bytes(sn.parse_bytes(r["memory"]))
        lines.append(f"| {r['model']} batch {r['batch']}, {memory}, \"{r['policy']}\", {how} | "
                     f"{r['measured_s']:.3f} | {r['predicted_s']:.3f} | {r['error']:+.0%} | "
                     f"{r['bound_by']} |")
    return lines


if __name__ == "__main__":
    main()
