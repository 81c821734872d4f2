"""Every kernel and algorithm against PyTorch/cuDNN on ResNet-50 shapes at batch 32.

    PYTHONPATH=. python bench/kernels.py          # on a GPU; writes bench/results/kernels-<gpu>.json

Runs bench/kernels_conv.py, bench/kernels_norm.py and bench/kernels_misc.py in one process,
prints one table (ratio = torch time / tinysn time: above 1 means tinysn is faster) and
writes all rows with the GPU, torch and triton versions (after each group, so a time limit
that cuts the run short keeps the groups done; "complete" says whether all ran).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tinysn  # noqa: E402,F401
import torch  # noqa: E402

from bench import common, kernels_conv, kernels_misc, kernels_norm  # noqa: E402


def main():
    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU")
        return 1
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.matmul.allow_tf32 = True
    rows = []
    for name, module in (("conv", kernels_conv), ("norm", kernels_norm), ("misc", kernels_misc)):
        try:
            rows += module.bench("cuda")
        except Exception as err:   # one group failing must not lose the others' figures
            print(f"{name} benchmark failed: {type(err).__name__}: {err}")
            rows.append({"kernel": name, "error": f"{type(err).__name__}: {err}"})
        common.write(f"kernels-{common.gpu_tag()}", {"rows": rows, "complete": False})
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
    path = common.write(f"kernels-{common.gpu_tag()}", {"rows": rows, "complete": True})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
