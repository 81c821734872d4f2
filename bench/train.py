"""End-to-end training speed: tinysn beside PyTorch eager, same model, batch and process.
Both sides are fed from pinned host memory every step and record the process's
max_memory_allocated since a reset before the model (PyTorch) or Runtime() (tinysn).

    PYTHONPATH=. python bench/train.py [--model resnet50] [--batch 32] [--policies baseline,all]

For each policy: plans, trains `--steps` iterations on one fixed synthetic batch (the loss must
fall), and reports images/s from the median CUDA-event time of an iteration after warm-up,
the pool's measured peak against the plan's, and the bytes moved. PyTorch: torchvision's model
(or the tinysn graph's torch twin when torchvision is missing), TF32 convolutions, SGD with the
same hyper-parameters. Writes bench/results/train-<model>-<gpu>.json.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tinysn as sn  # noqa: E402
import torch  # noqa: E402

from bench import common  # noqa: E402
from tinysn.cli import MODELS  # noqa: E402


def torch_images_per_s(model_name, batch, steps, lr, momentum, net):
    """PyTorch's images/s and its process peak, fed from pinned host memory as tinysn is."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model, source = common.torch_model(model_name, net)
    model = model.cuda().train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    images, labels = (t.pin_memory() for t in sn.data.synthetic(net, seed=0))

    def step():
        opt.zero_grad(set_to_none=True)
        x, y = images.cuda(non_blocking=True), labels.cuda(non_blocking=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    ms = common.cuda_median_ms(step, iters=steps, warmup=3)
    peak = torch.cuda.max_memory_allocated()
    del model, opt
    torch.cuda.empty_cache()
    return {"source": source, "ms_per_step": ms, "images_per_s": batch / ms * 1e3,
            "process_peak_bytes": peak}


def tinysn_run(net, policy, memory, steps, lr, momentum, conv_algos, cuda_graph=False):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    rt = sn.Runtime(net, memory, policy, device="cuda", lr=lr, momentum=momentum,
                    conv_algos=conv_algos, cuda_graph=cuda_graph)
    setup_s = time.perf_counter() - t0
    images, labels = (t.pin_memory() for t in sn.data.synthetic(net, seed=0))  # from the host
    # warm-up: compiles, tunes and (cuda_graph) captures
    losses = [rt.step(images, labels) for _ in range(sn.runtime.GRAPH_WARMUP + 1)]
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        losses.append(rt.step(images, labels))
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    ms = sorted(times)[len(times) // 2]
    out = {"policy": policy, "cuda_graph": cuda_graph, "memory": memory, "ms_per_step": ms,
           "images_per_s": net.batch / ms * 1e3, "losses": losses,
           "loss_fell": losses[-1] < losses[0], "peak_bytes": rt.stats.peak_bytes,
           "planned_peak_bytes": rt.plan.peak_bytes,
           "peak_equals_plan": rt.stats.peak_bytes == rt.plan.peak_bytes,
           "process_peak_bytes": torch.cuda.max_memory_allocated(),
           "bytes_to_host_per_step": rt.plan.bytes_to_host,
           "bytes_to_device_per_step": rt.plan.bytes_to_device,
           "recomputed_steps": rt.plan.recomputed_steps, "setup_s": setup_s,
           "conv_algos": sorted({f"{p}:{a}" for d in rt.plan.conv_algos.values()
                                 for p, a in d.items()})}
    del rt
    torch.cuda.empty_cache()
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="resnet50", choices=sorted(MODELS))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--memory", default="40GiB")
    parser.add_argument("--policies", default="baseline,all")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--pin-algos", default=None,
                        help='pin conv algorithms instead of timing them: "default" '
                             '(zero-workspace) or e.g. "backward_weight=splitk"')
    parser.add_argument("--cuda-graph", default="off", choices=("off", "on", "both"),
                        help="replay the step as a CUDA graph (both: each policy twice)")
    args = parser.parse_args()
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    net = MODELS[args.model](batch=args.batch)
    ref = torch_images_per_s(args.model, args.batch, args.steps, args.lr,
                             args.momentum, net)
    print(f"pytorch ({ref['source']}): {ref['images_per_s']:.1f} images/s "
          f"({ref['ms_per_step']:.2f} ms/step)")
    rows = []
    graphs = {"off": [False], "on": [True], "both": [False, True]}[args.cuda_graph]
    for policy in args.policies.split(","):
        pinned = None if args.pin_algos is None else dict(
            kv.split("=") for kv in args.pin_algos.split(",") if "=" in kv)
        for graph in graphs:
            try:
                row = tinysn_run(net, policy, args.memory, args.steps, args.lr, args.momentum,
                                 pinned, graph)
            except Exception as err:     # keep the other runs' figures
                rows.append({"policy": policy, "cuda_graph": graph,
                             "error": f"{type(err).__name__}: {err}"[:500]})
                print(f"tinysn {policy} cuda_graph={graph}: {rows[-1]['error']}")
                torch.cuda.empty_cache()
                continue
            row["ratio_to_pytorch"] = row["images_per_s"] / ref["images_per_s"]
            rows.append(row)
            label = policy + ("+graph" if graph else "")
            print(f"tinysn {label:>14}: {row['images_per_s']:.1f} images/s "
                  f"({row['ms_per_step']:.2f} "
                  f"ms/step, {row['ratio_to_pytorch']:.2f}x PyTorch); peak "
                  f"{row['peak_bytes']:,} == plan {row['planned_peak_bytes']:,}: "
                  f"{row['peak_equals_plan']}; loss {row['losses'][0]:.3f} -> "
                  f"{row['losses'][-1]:.3f}")
    ref["autotune"] = os.environ.get("TINYSN_AUTOTUNE", "1") != "0"
    path = common.write(f"train-{args.model}-b{args.batch}-{common.gpu_tag()}",
                        {"model": args.model, "batch": args.batch, "pytorch": ref, "tinysn": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
