"""Host time of the runtime's own bookkeeping per plan operation, kernels stubbed out (CPU).

    PYTHONPATH=. python bench/host.py [--blocks 6,32,200,6] [--batch 2] [--policy all] [--out PATH]

Runs two iterations of a deep ResNet's plan with every kernel launch replaced by a no-op, so
what is timed is the runtime walking its plan: allocations and frees through the allocator,
moves, waits and the per-step trace. The GPU's step time beyond this is kernel launches.
Prints the figures and writes them to --out.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tinysn as sn  # noqa: E402
import torch  # noqa: E402

from bench import common  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", default="6,32,200,6")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--policy", default="all")
    common.add_out_argument(ap)
    args = ap.parse_args()
    blocks = [int(b) for b in args.blocks.split(",")]
    net = sn.models.resnet(blocks=blocks, batch=args.batch, classes=10, input_shape=(3, 32, 32))
    rt = sn.Runtime(net, "12GiB", args.policy, device="cpu", conv_algos={})
    for key in list(rt._launch):
        rt._launch[key] = lambda rt, algos, ws: None
    images = torch.randn(args.batch, 3, 32, 32)
    labels = torch.randint(0, 10, (args.batch,))
    rt.step(images, labels)
    t0 = time.perf_counter()
    rt.step(images, labels)
    seconds = time.perf_counter() - t0
    ops = sum(len(s.ops) for s in rt.plan.steps)
    print(f"ResNet {blocks} batch {args.batch}, policy {args.policy}: {len(rt.plan.steps)} steps, "
          f"{ops} operations, {seconds * 1e3:.1f} ms per iteration, "
          f"{seconds / ops * 1e6:.2f} us per operation")
    common.write(args.out, {"blocks": blocks, "batch": args.batch, "policy": args.policy,
                            "plan_steps": len(rt.plan.steps), "operations": ops,
                            "seconds_per_iteration": seconds,
                            "us_per_operation": seconds / ops * 1e6})


if __name__ == "__main__":
    main()
