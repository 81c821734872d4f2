"""Every kernel and algorithm against PyTorch/cuDNN on ResNet-50 shapes at batch 32.

    PYTHONPATH=. python bench/kernels.py --out k.json              # on a GPU
    PYTHONPATH=. python bench/kernels.py --only misc --out k.json  # re-run some groups

Runs bench/kernels_conv.py, bench/kernels_norm.py and bench/kernels_misc.py in one process,
prints one table (ratio = torch time / tinysn time: above 1 means tinysn is faster) and
writes all rows to --out (after each group, so a time limit that cuts the run short keeps the
groups done; "complete" says whether every group ran without a group-level error). `--only`
re-runs the named groups and keeps the other groups' rows from the --out file already there.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tinysn  # noqa: E402,F401
import torch  # noqa: E402

from bench import common, kernels_conv, kernels_misc, kernels_norm  # noqa: E402


GROUPS = {"conv": kernels_conv, "norm": kernels_norm, "misc": kernels_misc}
_NORM_KERNELS = ("bn.", "pool.", "join.", "lrn.")


def group_of(row) -> str:
    """The benchmark group a row came from (by its kernel name)."""
    kernel = row.get("kernel", "")
    if kernel == "conv" or kernel.startswith("conv."):
        return "conv"
    if kernel in ("norm", "bn", "pool", "join", "lrn") or kernel.startswith(_NORM_KERNELS):
        return "norm"
    return "misc"


def kept_rows(path, rerun) -> list:
    """Rows of the groups not re-run, from an earlier JSON at `path` (none if absent)."""
    return [r for r in common.read(path).get("rows", []) if group_of(r) not in rerun]


def complete(rows) -> bool:
    """Every group has rows and none failed as a whole."""
    groups = {group_of(r) for r in rows if "shape" in r}
    return groups == set(GROUPS) and not any("error" in r and "shape" not in r for r in rows)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=",".join(GROUPS),
                    help="comma-separated groups to run: " + ", ".join(GROUPS))
    ap.add_argument("--out", help="results JSON (none written without it)")
    args = ap.parse_args(argv)
    only = args.only.split(",")
    if not set(only) <= set(GROUPS):
        print(f"--only: unknown group in {only}; groups are {list(GROUPS)}")
        return 2
    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU")
        return 1
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.matmul.allow_tf32 = True
    rows = kept_rows(args.out, only) if set(only) != set(GROUPS) else []
    for group, module in GROUPS.items():
        if group not in only:
            continue
        try:
            rows += module.bench("cuda")
        except Exception as err:   # one group failing must not lose the others' figures
            print(f"{group} benchmark failed: {type(err).__name__}: {err}")
            rows.append({"kernel": group, "error": f"{type(err).__name__}: {err}"})
        common.write(args.out, {"rows": rows, "complete": False})
    print(f"\n{'kernel':<26} {'algo':<12} {'shape':<34} {'tinysn ms':>10} {'torch ms':>9} "
          f"{'ratio':>6} {'rate':>12}")
    for r in rows:
        if "error" in r:
            continue
        rate = (f"{r['tflops']:.1f} TFLOP/s" if "tflops" in r else
                f"{r['gbps']:.0f} GB/s" if "gbps" in r else "")
        print(f"{r['kernel']:<26} {str(r.get('algo', '')):<12} {str(r.get('shape', ''))[:34]:<34} "
              f"{r.get('tinysn_ms', float('nan')):>10.4f} {r.get('torch_ms', float('nan')):>9.4f} "
              f"{r.get('ratio', float('nan')):>6.2f} {rate:>12}")
    if common.write(args.out, {"rows": rows, "complete": complete(rows)}):
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
