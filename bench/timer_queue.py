"""Does the GPU's launch queue pace `bench_ms`? Small batch-norm passes timed behind one wait.

    PYTHONPATH=. python3 bench/timer_queue.py [--repeats 4] [--out PATH]

`kernels/_common.bench_ms` (the timer of the conv rankings, the autotuners and bench/'s
`gpu_ms`) queues the timed calls behind a GPU-side wait, so that each pair of events brackets
the kernels and not the host's launch cost. The launch queue is finite: past it, the host
blocks at each launch until the GPU has taken one, and the calls after that time the host's
pace again. This script shows both sides on a GPU:

- `issue_ms`: the host's milliseconds to issue N tiny launches behind a 0.5 s wait (a jump
  of about 500 ms shows where the queue was full);
- per batch-norm shape and pass, `bench_ms` quantiles (10/50/90%) with every call behind one
  wait (`queued` 1000, the version-2 timer) and in batches of `_common._QUEUED_CALLS`
  (today's), `--repeats` times each, and each timed pass's (calls, wait s, issue s).

Needs a CUDA GPU.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
from bench import bn_configs, common  # noqa: E402
from tinysn.kernels import _common  # noqa: E402

SHAPES = ([32, 512, 7, 7], [32, 256, 14, 14], [32, 128, 28, 28], [32, 1024, 14, 14])


def issue_ms(launches=3000, every=250) -> list:
    """[(launch index, host ms since the first)] of tiny launches behind a 0.5 s wait."""
    x = torch.zeros(1024, device="cuda")
    x.add_(1.0)     # loads torch's kernel now: a first launch that loads it waits for the GPU
    torch.cuda.synchronize()
    _common._hold_queue(0.5)
    marks, start = [], time.perf_counter()
    for i in range(launches):
        x.add_(1.0)
        if i % every == 0:
            marks.append((i, round((time.perf_counter() - start) * 1e3, 2)))
    torch.cuda.synchronize()
    return marks


def timed(fn, queued: int, repeats: int) -> list:
    """`repeats` runs of bench_ms with `queued` calls behind each wait: quantiles, passes."""
    passes, runs = [], []
    timed_calls = _common._timed_calls

    def traced(fn_, events, hold_s):
        issue_s = timed_calls(fn_, events, hold_s)
        passes.append((len(events), round(hold_s, 4), round(issue_s, 4)))
        return issue_s

    before = _common._QUEUED_CALLS
    _common._QUEUED_CALLS, _common._timed_calls = queued, traced
    try:
        for _ in range(repeats):
            passes.clear()
            q = _common.bench_ms(fn, quantiles=[0.1, 0.5, 0.9], warmup_ms=25, rep_ms=100)
            runs.append({"quantiles_ms": [round(v, 4) for v in q], "passes": list(passes)})
    finally:
        _common._QUEUED_CALLS, _common._timed_calls = before, timed_calls
    return runs


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=4)
    common.add_out_argument(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU: the launch queue is the GPU's")
    result = {"queued_today": _common._QUEUED_CALLS, "issue_ms": issue_ms(), "rows": []}
    print("host ms to issue launch i behind a 0.5 s wait:", result["issue_ms"], flush=True)
    for shape in SHAPES:
        case = bn_configs.Case(shape, torch.device("cuda"))
        for queued in (1000, _common._QUEUED_CALLS):
            for name, fn in (("forward", case.forward), ("backward", case.backward)):
                runs = timed(fn, queued, args.repeats)
                result["rows"].append({"shape": shape, "pass": name, "queued": queued,
                                       "runs": runs})
                print(shape, name, f"queued {queued}: medians",
                      [r["quantiles_ms"][1] for r in runs], flush=True)
    common.write(args.out, result)
    return result


if __name__ == "__main__":
    main()
